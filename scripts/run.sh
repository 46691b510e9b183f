#!/usr/bin/env bash
# Installs kvbridge and starts the main job: a local proxy + prefill + decode cluster
# serving the default model. Extra arguments go to `kvbridge up`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
export OMP_WAIT_POLICY=PASSIVE UCX_NET_DEVICES=lo
exec .venv/bin/kvbridge up "$@"
