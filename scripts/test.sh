#!/usr/bin/env bash
# Installs kvbridge with its test extras and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh --test
export OMP_WAIT_POLICY=PASSIVE UCX_NET_DEVICES=lo UCX_MODULES=^ib HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# --fast: the tier a developer runs before every commit (no process fleets, no Ray, no real model;
# markers in tests/conftest.py). Without it, everything, and the 25 slowest tests are listed.
if [ "${1:-}" = "--fast" ]; then
  shift
  exec .venv/bin/python -m pytest -q -p no:cacheprovider -m "not cluster and not model" "$@"
fi
# Two lanes (pytest-xdist workers; which tests share one: tests/conftest.py, lane_group; why two:
# README, Tests). KVBRIDGE_TEST_WORKERS=0 runs everything in this one process.
workers=${KVBRIDGE_TEST_WORKERS:-2}
lanes=()
[ "$workers" = 0 ] || lanes=(-n "$workers")
exec .venv/bin/python -m pytest -q -p no:cacheprovider "${lanes[@]}" --durations=25 "$@"
