#!/usr/bin/env bash
# Installs kvbridge with its test extras and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh --test
export OMP_WAIT_POLICY=PASSIVE UCX_NET_DEVICES=lo UCX_MODULES=^ib HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
