#!/usr/bin/env bash
# Installs kvbridge and starts the main job: a local proxy + prefill + decode cluster
# serving the default model. Extra arguments go to `kvbridge up` (with --ray or --ray-address,
# the install adds the `ray` extra: the same application on Ray Serve).
set -euo pipefail
cd "$(dirname "$0")/.."
ray=""
for arg in "$@"; do
  case "$arg" in --ray|--ray-address|--ray-address=*) ray="--ray" ;; esac
done
scripts/install.sh $ray
export OMP_WAIT_POLICY=PASSIVE UCX_NET_DEVICES=lo
exec .venv/bin/kvbridge up "$@"
