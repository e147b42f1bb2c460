#!/usr/bin/env bash
# From a fresh Debian machine: install build dependencies, build rota, start
# a local 3-replica cluster and two node agents with 8 declared H100s each
# under DIR (default /tmp/rota-demo), and run a 2 x 8 GPU gang.
# Stop it with: deploy/local/cluster.sh stop /tmp/rota-demo
set -euo pipefail
dir=$(realpath -m -- "${1:-/tmp/rota-demo}")
cd "$(dirname "$0")/../.."
bash deploy/setup-debian.sh
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/rota-target}"
cargo build --release --workspace --bins
bash deploy/local/cluster.sh start "$dir" 3
bash deploy/local/cluster.sh agents "$dir" 2 8xH100-80GB
ROTA="$CARGO_TARGET_DIR/release/rota"
# ROTA_ENDPOINTS and the CLI's certificate (ROTA_CA, ROTA_CERT, ROTA_KEY).
. "$dir/env"
echo '+ rota submit --replicas 2 --gpus 8 -- sh -c "echo rank \$RANK of \$WORLD_SIZE ..."'
job=$("$ROTA" submit --replicas 2 --gpus 8 -- sh -c 'echo "rank $RANK of $WORLD_SIZE on GPUs $CUDA_VISIBLE_DEVICES, master $MASTER_ADDR:$MASTER_PORT"; sleep 2')
echo "job $job submitted"
for _ in $(seq 1 100); do
  state=$("$ROTA" status "$job" --output json | grep '"state"' | head -1)
  case "$state" in *succeeded*|*failed*|*cancelled*) break;; esac
  sleep 0.2
done
"$ROTA" status "$job"
"$ROTA" logs "$job" --rank 0
"$ROTA" logs "$job" --rank 1
"$ROTA" jobs --limit 5
echo "stop with: deploy/local/cluster.sh stop $dir"
