"""`kvbridge up` as a user runs it: a real process on loopback (real proxy, P and D, the
default model), with engine options given to `up` and after `--`. They must reach every
instance (command line, environment, and their effect), and SIGTERM must leave no process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from kvbridge.launcher.cluster import free_ports
from tests.e2e.processes import metric, wait_until_ready

KEY = "sk-up-e2e"


def test_up_passes_options_to_every_instance_and_sigterm_leaves_no_process(tmp_path: Path) -> None:
    port = free_ports(1)[0]
    argv = [sys.executable, "-m", "kvbridge.cli", "up", "--port", str(port), "--kv-backend", "tcp",
            "--num-threads", "1", "--num-blocks", "64", "--max-model-len", "512", "--api-key", KEY,
            "--", "--max-num-seqs", "4"]
    env = {k: v for k, v in os.environ.items() if k != "KVBRIDGE_API_KEY"}
    stdout, stderr = tmp_path / "up.out", tmp_path / "up.err"
    with open(stdout, "wb") as out, open(stderr, "wb") as err:
        launcher = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env)
    children: dict[str, tuple[int, str]] = {}
    try:
        text = wait_until_ready(launcher, stdout, stderr)
        proxy = f"http://127.0.0.1:{port}"
        prefill = re.search(r"prefill: (\S+)", text).group(1)
        decode = re.search(r"decode: +(\S+)", text).group(1)
        # The launcher logs each child's pid and command line as it starts it.
        children = {name: (int(pid), cmd) for name, pid, cmd in
                    re.findall(r"started (\S+) \(pid (\d+)\): (.*)", stderr.read_text())}
        assert sorted(children) == ["decode-0", "prefill-0", "proxy"]
        dtypes = set()
        for name in ("prefill-0", "decode-0"):
            pid, _ = children[name]
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            for option in (["--kv-backend", "tcp"], ["--num-threads", "1"], ["--num-blocks", "64"],
                           ["--max-model-len", "512"], ["--max-num-seqs", "4"]):
                assert any(cmdline[i:i + 2] == option for i in range(len(cmdline))), (name, option, cmdline)
            assert KEY not in cmdline
            dtypes.add(cmdline[cmdline.index("--dtype") + 1])  # --dtype auto, resolved once by `up`
            environ = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
            assert f"KVBRIDGE_API_KEY={KEY}" in environ and "OMP_NUM_THREADS=1" in environ
        assert len(dtypes) == 1 and dtypes <= {"float32", "bfloat16"}, dtypes
        assert KEY not in children["proxy"][1]
        # ... and their effect: the KV cache size, the context length, the key on the proxy and instances.
        assert [metric(url, "kvbridge_kv_cache_total_blocks") for url in (prefill, decode)] == [64, 64]
        assert httpx.get(proxy + "/v1/models", trust_env=False).status_code == 401
        assert httpx.get(decode + "/v1/models", trust_env=False).status_code == 401
        auth = {"Authorization": f"Bearer {KEY}"}
        models = httpx.get(proxy + "/v1/models", headers=auth, trust_env=False).json()
        assert models["data"][0]["max_model_len"] == 512
        r = httpx.post(proxy + "/v1/completions", headers=auth, trust_env=False, timeout=120,
                       json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    for name, (pid, _) in children.items():
        assert not Path(f"/proc/{pid}").exists(), f"{name} (pid {pid}) outlived kvbridge up"


def test_up_with_invalid_instance_options_fails_fast_with_serves_message(tmp_path: Path) -> None:
    up = subprocess.run([sys.executable, "-m", "kvbridge.cli", "up", "--port", "0", "--", "--max-num-seqs", "x"],
                        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert up.returncode == 2
    assert "argument --max-num-seqs: invalid int value: 'x'" in up.stderr
    assert "started" not in up.stderr  # no child was ever spawned
