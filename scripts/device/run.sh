#!/usr/bin/env bash
# On the GPU machine: the wheels prepare.sh gathered into /tmp/site, then the CUDA checks
# (scripts/device/cuda_check.py; stages as arguments, all by default). Results under $OUT.
set -o pipefail
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export KVBRIDGE_CPU_KERNELS=0 PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 UCX_NET_DEVICES=lo HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
echo "installed in $(( $(date +%s) - t0 )) s"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import nixl, nixl._api; print('nixl from', nixl.__file__)" 2>&1 | tail -2
timeout "${CHECK_TIMEOUT:-420}" python3 scripts/device/cuda_check.py "$@" 2>&1 | grep -v "Writing model shards" | tee "$OUT/check.log"
echo "rc=$? total $(( $(date +%s) - t0 )) s"
