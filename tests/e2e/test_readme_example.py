"""The README's first example, run as printed against `kvbridge up` (real proxy, P and D, the
default model) with the official openai client: it prints the answer the README shows, which
names Paris."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.launcher.cluster import free_ports
from tests.e2e.processes import wait_until_ready

README = Path(__file__).resolve().parents[2] / "README.md"
README_URL = "http://127.0.0.1:8000/v1"


def first_example() -> tuple[str, str]:
    """The README's first python block and the block right after it: what it prints."""
    blocks = re.findall(r"```(\w*)\n(.*?)```", README.read_text(), re.S)
    first = next(i for i, (language, _) in enumerate(blocks) if language == "python")
    assert blocks[first + 1][0] == "text", "the README's first example shows no output right after it"
    return blocks[first][1], blocks[first + 1][1]


pytestmark = pytest.mark.timeout(480)  # the instances start in minutes on a busy machine


def test_the_readmes_first_example_prints_what_the_readme_shows(tmp_path: Path) -> None:
    code, shown = first_example()
    assert README_URL in code and "Paris" in shown
    port = free_ports(1)[0]
    argv = [sys.executable, "-m", "kvbridge.cli", "up", "--port", str(port), "--num-threads", "1",
            "--num-blocks", "64", "--max-model-len", "1024"]  # a chat without max_tokens may fill the context
    env = {k: v for k, v in os.environ.items() if k != "KVBRIDGE_API_KEY"}
    stdout, stderr = tmp_path / "up.out", tmp_path / "up.err"
    with open(stdout, "wb") as out, open(stderr, "wb") as err:
        launcher = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env)
    try:
        wait_until_ready(launcher, stdout, stderr)
        run = subprocess.run([sys.executable, "-c", code.replace(README_URL, f"http://127.0.0.1:{port}/v1")],
                             capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        assert run.returncode == 0, run.stderr
        assert run.stdout == shown
        assert "Paris" in run.stdout
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
