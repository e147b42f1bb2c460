#!/usr/bin/env bash
# Benchmark: durable submits while people read the whole job table. Three
# local replicas restored from a synthetic state of FINISHED finished and
# PENDING pending jobs (`rota bench backup`); the open loop (1,000 submits/s
# for SECONDS) runs twice, first alone, then with a reader asking the
# leader, one after another, for a listing of a user's jobs (`rota jobs
# --user`), the newest finished jobs (`rota history`) and a month's report
# (`rota report`): each walks the job table. Prints both rounds' submit
# latency and how long the leader held its state lock for reads.
# Loopback only, TLS on; stops every process it started.
#
#   deploy/bench/walk-reads.sh DIR [FINISHED] [PENDING] [SECONDS]
#
# ROTA_BIN: the rota binary (default: the release build); SERVER_BIN: the
# binary the replicas run, to compare two builds with one CLI.
set -u
dir="${1:?usage: $0 DIR [FINISHED] [PENDING] [SECONDS]}"; finished="${2:-1000000}"; pending="${3:-50000}"; seconds="${4:-15}"
rota="${ROTA_BIN:-${CARGO_TARGET_DIR:-/var/tmp/rota-target}/release/rota}"
server="${SERVER_BIN:-$rota}"
here="$(cd "$(dirname "$0")/../local" && pwd)"; base=7521
[ -e "$dir" ] && { echo "$dir exists; give a new directory" >&2; exit 2; }
mkdir -p "$dir"
reader_pid=""
cleanup() {
  [ -n "$reader_pid" ] && kill "$reader_pid" 2>/dev/null
  ROTA_BIN="$server" bash "$here/cluster.sh" stop "$dir" >/dev/null 2>&1
}
trap cleanup EXIT

"$rota" bench backup "$dir/backup.rota" --finished "$finished" --pending "$pending" >/dev/null || exit 1
# shellcheck source=deploy/bench/restore-members.sh
. "$(dirname "$0")/restore-members.sh"
restore_members "$rota" "$dir" "$base" || exit 1
export ROTA_SERVER_ARGS="--user-requests-per-s 0 --user-max-in-flight 100000"
ROTA_BIN="$server" bash "$here/cluster.sh" start "$dir" 3 "$base" >"$dir/start.log" 2>&1 || { echo "no leader; see $dir" >&2; exit 1; }
# shellcheck disable=SC1091
. "$dir/env"
leader=$("$rota" cluster --output json | python3 -c 'import json,sys; print(json.load(sys.stdin)["leader_id"])')
metrics="http://127.0.0.1:$((base + 100 + leader - 1))/metrics"
# The leader's read-lock holds: histogram lines (cumulative buckets, count
# and sum since start), so two readings bracket a round.
read_holds() { curl -sf "$metrics" | grep '^rota_state_lock_hold_seconds.*kind="read"'; }
holds_between() { # BEFORE AFTER
  python3 - "$1" "$2" <<'PY'
import re, sys
def parse(text):
    out = {}
    for line in text.splitlines():
        name, value = line.rsplit(" ", 1)
        le = re.search(r'le="([^"]+)"', name)
        key = "le" + le.group(1) if le else ("sum" if "_sum" in name else "count" if "_count" in name else name)
        out[key] = float(value)
    return out
a, b = parse(sys.argv[1]), parse(sys.argv[2])
def delta(key):
    return b.get(key, 0) - a.get(key, 0)
n = delta("count")
mean = delta("sum") / n * 1000 if n else 0
def over(bound):
    return int(n - delta("le" + bound))
bounds = sorted((float(k[2:]), k[2:]) for k in b if k.startswith("le") and k != "le+Inf")
longest = next((f"<= {v * 1000:g} ms" for v, k in bounds if delta("le" + k) == n), "over the largest bucket") if n else "none"
print(f"{int(n)} read-lock holds, mean {mean:.3f} ms, {over('0.01')} over 10 ms, {over('0.05')} over 50 ms, longest {longest}")
PY
}
round() { # NAME
  local before after
  before=$(read_holds)
  "$rota" bench submit --clients 256 --rate 1000 --duration-s "$seconds" >"$dir/$1.json" 2>&1
  after=$(read_holds)
  python3 - "$dir/$1.json" "$1" <<'PY' 2>/dev/null || echo "$1: $(head -1 "$dir/$1.json")"
import json, sys
d = json.load(open(sys.argv[1]))
l = d["latency_ms"]
print(f"{sys.argv[2]}: {d['acked']} acked, {d['errors']} errors, p50 {l['p50']} ms, p99 {l['p99']} ms, max {l['max']} ms")
for kind, count in d.get("errors_by_kind", {}).items():
    print(f"  {count} x {kind}: {d.get('error_examples', {}).get(kind, '')}")
PY
  echo "  leader: $(holds_between "$before" "$after")"
}
round alone
# The reader appends a line per answered read, so the round's reads are
# counted too: a build that spares the submits by starving the reads is no
# better.
(
  month=$(date -u +%Y-%m)
  while true; do
    "$rota" jobs --user nobody --limit 20 >/dev/null 2>&1 && echo jobs
    "$rota" history --limit 20 >/dev/null 2>&1 && echo history
    "$rota" report --month "$month" >/dev/null 2>&1 && echo report
  done
) >"$dir/reads.txt" &
reader_pid=$!
round with-readers
kill "$reader_pid" 2>/dev/null; wait "$reader_pid" 2>/dev/null; reader_pid=""
echo "  reader: $(sort "$dir/reads.txt" | uniq -c | awk '{printf "%s%s %s", sep, $1, $2; sep=", "}') answered"
