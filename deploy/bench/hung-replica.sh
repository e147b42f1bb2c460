#!/usr/bin/env bash
# Fresh `rota submit` processes against a 3-replica cluster on 127.0.0.1
# whose first listed endpoint is a follower stopped with SIGSTOP (it still
# accepts connections; nothing answers). Each CLI binary given is run in
# turn, ROUNDS times, alternating; the script prints each binary's median
# and max wall time per submit, with and without the remembered endpoint.
#
#   deploy/bench/hung-replica.sh DIR ROUNDS ROTA_BIN [ROTA_BIN...]
#
# The cluster's replicas run the first binary. Stopped by PID at the end.
set -euo pipefail
dir="$1"; rounds="$2"; shift 2
bins=("$@")
export ROTA_BIN="${bins[0]}"
here="$(cd "$(dirname "$0")/../.." && pwd)"
"$here/deploy/local/cluster.sh" start "$dir" 3 17401 >/dev/null
trap '"$here/deploy/local/cluster.sh" stop "$dir" >/dev/null 2>&1 || true' EXIT
# shellcheck disable=SC1091
. "$dir/env"
for _ in $(seq 1 100); do "${bins[0]}" cluster >/dev/null 2>&1 && break; sleep 0.1; done
leader=$("${bins[0]}" --output json cluster | python3 -c 'import json,sys; print(json.load(sys.stdin)["leader_address"])')
hung=$(echo "$ROTA_ENDPOINTS" | tr ',' '\n' | grep -v "^$leader$" | head -1)
others=$(echo "$ROTA_ENDPOINTS" | tr ',' '\n' | grep -v "^$hung$" | paste -sd,)
hung_pid=$(pgrep -f -- "--listen $hung" | head -1)
kill -STOP "$hung_pid"
trap 'kill -CONT '"$hung_pid"' 2>/dev/null; "$here/deploy/local/cluster.sh" stop "$dir" >/dev/null 2>&1 || true' EXIT
for b in "${!bins[@]}"; do : > "$dir/times-$b-fresh"; : > "$dir/times-$b-kept"; done
for _ in $(seq 1 "$rounds"); do
  for b in "${!bins[@]}"; do
    for mode in fresh kept; do
      cache="$dir/cache-$b-$mode"
      [ "$mode" = fresh ] && rm -rf "$cache"
      start=$(date +%s%N)
      XDG_CACHE_HOME="$cache" "${bins[$b]}" --endpoints "$hung,$others" submit --group bench -- true >/dev/null
      echo $(( ($(date +%s%N) - start) / 1000000 )) >> "$dir/times-$b-$mode"
    done
  done
done
for b in "${!bins[@]}"; do
  for mode in fresh kept; do
    sort -n "$dir/times-$b-$mode" | awk -v bin="${bins[$b]}" -v mode="$mode" \
      '{ v[NR] = $1 } END { printf "%s %s: n=%d median %d ms, max %d ms\n", bin, mode, NR, v[int((NR + 1) / 2)], v[NR] }'
  done
done
