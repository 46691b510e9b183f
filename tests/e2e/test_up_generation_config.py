"""`kvbridge up --generation-config FOLDER`: every instance gets the option, and the defaults apply
where the sampling happens. P answers the proxy's one-token request (its max_tokens wins over the
default) and samples the first token of a streamed request with the defaults; D samples the rest
with them. A small random-weight Llama folder (its own generation_config.json asks for other
values) is served by a real proxy, P and D on loopback."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from kvbridge.engine.loader import load_model
from kvbridge.engine.loader.synthetic import TINY_4_KV_HEADS, write_synthetic_folder
from kvbridge.launcher.cluster import free_ports
from tests.e2e.processes import wait_until_ready

FOLDER_DEFAULTS = {"temperature": 0.0, "max_new_tokens": 6}  # greedy, 6 tokens
MODEL_DEFAULTS = {"temperature": 1.5, "max_new_tokens": 3}  # what `auto` would have given
PROMPT = "The history of the Roman Empire spans many centuries, from the founding of the city"
STARTUP_WARNING = "Default sampling parameters have been overridden by the model's generation config"


pytestmark = pytest.mark.timeout(480)  # the instances start in minutes on a busy machine


def test_up_passes_the_generation_config_to_p_and_d_and_p_answers_one_token(tmp_path: Path) -> None:
    model = write_synthetic_folder(tmp_path / "tiny-llama", load_model("SmolLM2-135M-Instruct").tokenizer,
                                   **TINY_4_KV_HEADS)
    (model / "generation_config.json").write_text(json.dumps(MODEL_DEFAULTS))
    folder = tmp_path / "generation-config"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps(FOLDER_DEFAULTS))
    port = free_ports(1)[0]
    argv = [sys.executable, "-m", "kvbridge.cli", "up", str(model), "--port", str(port), "--num-threads", "1",
            "--num-blocks", "64", "--max-model-len", "256", "--generation-config", str(folder)]
    env = {k: v for k, v in os.environ.items() if k != "KVBRIDGE_API_KEY"}
    stdout, stderr = tmp_path / "up.out", tmp_path / "up.err"
    with open(stdout, "wb") as out, open(stderr, "wb") as err:
        launcher = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env)
    try:
        text = wait_until_ready(launcher, stdout, stderr)
        instances = {name: int(pid) for name, pid in re.findall(r"started (\S+) \(pid (\d+)\)", stderr.read_text())}
        for name in ("prefill-0", "decode-0"):
            cmdline = Path(f"/proc/{instances[name]}/cmdline").read_bytes().decode().split("\0")
            assert ["--generation-config", str(folder)] in [cmdline[i:i + 2] for i in range(len(cmdline))]
            log = Path(os.readlink(f"/proc/{instances[name]}/fd/1")).read_text()
            assert STARTUP_WARNING in log and "{'temperature': 0.0, 'max_tokens': 6}" in log, (name, log)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        prefill = re.search(r"prefill: (\S+)", text).group(1)
        p_only = openai.OpenAI(base_url=prefill + "/v1", api_key="unused", max_retries=0, timeout=120)
        extra = {"ignore_eos": True}
        greedy = p_only.completions.create(model=model.name, prompt=PROMPT, max_tokens=6, temperature=0,
                                           extra_body=extra)
        assert greedy.usage.completion_tokens == 6
        # Through the proxy: P answers max_tokens 1 (the request's own value beats the default 6), D
        # continues; sampling options omitted, so both use the folder's greedy decoding.
        whole = client.completions.create(model=model.name, prompt=PROMPT, extra_body=extra)
        assert (whole.choices[0].text, whole.usage.completion_tokens) == (greedy.choices[0].text, 6)
        streamed = client.completions.create(model=model.name, prompt=PROMPT, stream=True, extra_body=extra)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == greedy.choices[0].text
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def test_up_with_a_bad_generation_config_fails_before_anything_starts(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0}))
    up = subprocess.run([sys.executable, "-m", "kvbridge.cli", "up", "--port", "0", "--generation-config",
                         str(tmp_path)], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert up.returncode == 2
    assert f"error: {tmp_path / 'generation_config.json'}: top_p must be a number in (0, 1], got 0" in up.stderr
    assert "started" not in up.stderr  # no child was ever spawned
