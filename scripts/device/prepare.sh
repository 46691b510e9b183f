#!/usr/bin/env bash
# Prepares, on this machine, what the GPU check (scripts/device/run.sh) carries to a machine with
# one NVIDIA GPU, Python 3.12 and torch+cu13 but no NIXL and no network: the wheels kvbridge
# needs there (.whl, about 62 MB: nixl-cu13 is 59 MB) and SmolLM2's tokenizer (.devkit), both
# git-ignored. Then, there: `bash scripts/device/run.sh [up] [mixed] [tp]` (carry .whl and .devkit).
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude || echo /.whl/ >> .git/info/exclude
grep -qx '/.devkit/' .git/info/exclude || echo /.devkit/ >> .git/info/exclude
mkdir -p .whl .devkit
plat=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: "${plat[@]}" -d .whl \
  nixl-cu13==1.5.1 nixl==1.5.1 fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 \
  typing-inspection==0.4.5 annotated-types uvicorn==0.54.0 gguf==0.19.0 typing_extensions==4.16.0 \
  opentelemetry-api==1.45.2
HF_HUB_OFFLINE=1 .venv/bin/python - <<'PY'
import gzip
from pathlib import Path
from kvbridge.engine.loader import load_model
Path(".devkit/smollm2_tokenizer.json.gz").write_bytes(
    gzip.compress(load_model("SmolLM2-135M-Instruct").tokenizer.to_json().encode(), 9))
PY
du -sh .whl .devkit
