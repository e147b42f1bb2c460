#!/usr/bin/env bash
# From a fresh Debian machine: install build dependencies, build rota, start
# a local 3-replica cluster under DIR (default /tmp/rota-demo) and submit a job.
# Stop it with: deploy/local/cluster.sh stop /tmp/rota-demo
set -euo pipefail
cd "$(dirname "$0")/../.."
dir="${1:-/tmp/rota-demo}"
bash deploy/setup-debian.sh
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/rota-target}"
cargo build --release --workspace --bins
bash deploy/local/cluster.sh start "$dir" 3
ROTA="$CARGO_TARGET_DIR/release/rota"
export ROTA_ENDPOINTS="$(cat "$dir/endpoints")"
echo "+ rota submit --gpus 8 --replicas 2 -- python train.py"
job=$("$ROTA" submit --gpus 8 --replicas 2 -- python train.py)
echo "job $job submitted"
"$ROTA" status "$job"
"$ROTA" jobs --limit 5
