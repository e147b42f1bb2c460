#!/usr/bin/env bash
# Where one durable submit's time goes: a fresh 3-replica cluster on
# 127.0.0.1 (plaintext, as next to etcd), a closed loop of CLIENTS submits
# for SECONDS, then each replica's own histograms read over the same span:
# log sync (write + fsync of appended entries), the leader's AppendEntries
# round trips (network both ways and the follower's sync) and the leader's
# time to serve a submit.
#
#   deploy/bench/commit-path.sh DIR [CLIENTS=1] [SECONDS=8] [BASE_PORT=7701]
#
# ROTA_BIN: the rota binary (default: the release build).
set -euo pipefail
dir="${1:?usage: commit-path.sh DIR [CLIENTS] [SECONDS] [BASE_PORT]}"
dir=$(realpath -m -- "$dir")
case "${ROTA_BIN:-}" in */*) ROTA_BIN=$(realpath -m -- "$ROTA_BIN") ;; esac
cd "$(dirname "$0")/../.."
clients="${2:-1}"; seconds="${3:-8}"; base="${4:-7701}"
ROTA="${ROTA_BIN:-${CARGO_TARGET_DIR:-/var/tmp/rota-target}/release/rota}"
export ROTA_BIN="$ROTA"
[ ! -e "$dir" ] || { echo "$dir exists: give a new directory" >&2; exit 2; }
trap 'deploy/local/cluster.sh stop "$dir" >/dev/null 2>&1 || true' EXIT
ROTA_INSECURE=1 ROTA_SERVER_ARGS="--user-requests-per-s 0 --user-max-in-flight 100000" \
  deploy/local/cluster.sh start "$dir" 3 "$base" >/dev/null
endpoints=$(cat "$dir/endpoints")

# scrape I: replica I's metrics text.
scrape() { curl -sf "http://127.0.0.1:$((base + 100 + $1 - 1))/metrics"; }
# sum_count TEXT NAME FILTER: "sum count" of histogram NAME's series matching FILTER.
sum_count() {
  awk -v name="$2" -v filter="$3" '
    index($0, name "_sum") == 1 && index($0, filter) { s += $NF }
    index($0, name "_count") == 1 && index($0, filter) { c += $NF }
    END { printf "%.9f %d\n", s, c }' <<<"$1"
}
leader=$("$ROTA" --insecure --endpoints "$endpoints" cluster --output json | python3 -c 'import json,sys; print(json.load(sys.stdin)["leader_id"])')
declare -A before
for i in 1 2 3; do before[$i]=$(scrape "$i"); done
"$ROTA" --insecure --endpoints "$endpoints" bench submit --clients "$clients" --duration-s "$seconds"
declare -A after
for i in 1 2 3; do after[$i]=$(scrape "$i"); done

# mean_ms I NAME FILTER: mean of the histogram's new samples on replica I, in ms.
mean_ms() {
  read -r s0 c0 <<<"$(sum_count "${before[$1]}" "$2" "$3")"
  read -r s1 c1 <<<"$(sum_count "${after[$1]}" "$2" "$3")"
  python3 -c "import sys; s,c=float(sys.argv[1]),int(sys.argv[2]); print(f'{1e3*s/c:.3f} ms over {c}' if c else 'no samples')" \
    "$(python3 -c "print($s1-$s0)")" "$((c1 - c0))"
}
echo "leader: replica $leader"
for i in 1 2 3; do
  echo "replica $i log sync (write + fsync): $(mean_ms "$i" rota_log_sync_seconds "")"
done
echo "leader AppendEntries round trip: $(mean_ms "$leader" rota_raft_rpc_seconds 'kind="append_entries"')"
for i in 1 2 3; do [ "$i" = "$leader" ] || echo "replica $i serving AppendEntries: $(mean_ms "$i" rota_raft_serve_seconds 'kind="append_entries"')"; done
echo "leader serving a submit: $(mean_ms "$leader" rota_request_duration_seconds 'method="submit_job"')"
