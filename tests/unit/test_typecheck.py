"""The type checker as a test: mypy, strict (pyproject.toml's [tool.mypy]), finds no error in the
packages CHECKED lists; a self-check plants a type error and sees mypy fail on it.

Runtime: mypy keeps its cache in one folder per user under the system temp dir, so a run after the
first re-reads only what changed (torch's stubs are most of a cold run: about a minute on 2 cores,
a few seconds warm)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)  # a cold cache reads torch's stubs

ROOT = Path(__file__).resolve().parents[2]
# The packages checked, strict, with zero errors: add one here once it checks clean.
CHECKED = ("kvbridge/engine", "kvbridge/kv_events", "kvbridge/kv_transfer", "kvbridge/proxy", "kvbridge/server",
           "kvbridge/tracing")
CACHE_DIR = Path(tempfile.gettempdir()) / f"kvbridge-mypy-cache-{os.getuid()}"


def mypy(*targets: str | Path) -> subprocess.CompletedProcess[str]:
    """mypy with the project's configuration on `targets`; its report is stdout."""
    argv = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
            "--cache-dir", str(CACHE_DIR), *map(str, targets)]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=540)


def test_the_checked_packages_have_no_type_error() -> None:
    result = mypy(*CHECKED)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("Success: no issues found")


PLANTED = '''\
from kvbridge.kv_transfer.params import BlockIds


def first_block(block_ids: BlockIds) -> str:
    return block_ids[0][0]


def unannotated(x):
    return x
'''


def test_the_check_fails_on_a_planted_error(tmp_path: Path) -> None:
    """A wrong return type and an unannotated function (strict) in a scratch package, checked with
    the same configuration and cache: mypy fails and names both."""
    package = tmp_path / "planted"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "wrong.py").write_text(PLANTED)
    result = mypy(package)
    assert result.returncode == 1, result.stdout + result.stderr
    assert 'wrong.py:5: error: Incompatible return value type (got "int", expected "str")  [return-value]' \
        in result.stdout, result.stdout
    assert "wrong.py:8: error: Function is missing a type annotation  [no-untyped-def]" in result.stdout, \
        result.stdout
