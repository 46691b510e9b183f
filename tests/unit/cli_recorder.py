"""`kvbridge` run in this process (the command line's unit tests; the `started` fixture in
conftest.py records what `up` would start instead of starting it)."""

from __future__ import annotations

from kvbridge import cli


def run_cli(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as exc:  # argparse's errors
        return exc.code if isinstance(exc.code, int) else 1
