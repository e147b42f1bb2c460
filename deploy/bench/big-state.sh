#!/usr/bin/env bash
# Benchmark: three local replicas restored from a synthetic state of
# FINISHED finished and PENDING pending jobs (`rota bench backup`), then:
# time to a serving leader, resident memory, three rounds of the open loop
# (1,000 submits/s for 20 s) with snapshots during them, a follower
# restarted from its data directory, and a fourth member added (it installs
# a snapshot). Loopback only, TLS on; stops every process it started.
#
#   deploy/bench/big-state.sh DIR [FINISHED] [PENDING]
#
# ROTA_BIN: the rota binary (default: the release build); SERVER_BIN: the
# binary the replicas run, to compare two builds with one CLI;
# SNAPSHOT_EVERY: entries between snapshots (20000, the default).
set -u
dir="${1:?usage: $0 DIR [FINISHED] [PENDING]}"; finished="${2:-1000000}"; pending="${3:-50000}"
rota="${ROTA_BIN:-${CARGO_TARGET_DIR:-/var/tmp/rota-target}/release/rota}"
server="${SERVER_BIN:-$rota}"
here="$(cd "$(dirname "$0")/../local" && pwd)"; base=7501
[ -e "$dir" ] && { echo "$dir exists; give a new directory" >&2; exit 2; }
mkdir -p "$dir"
now() { date +%s.%N; }
since() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 2))" "$1" "$(now)"; }
rss() { grep VmRSS "/proc/$(cat "$dir/replica-$1/pid")/status" | awk '{print int($2/1024) " MiB"}'; }
cleanup() {
  ROTA_BIN="$server" bash "$here/cluster.sh" stop "$dir" >/dev/null 2>&1
  [ -f "$dir/replica-4/pid" ] && kill "$(cat "$dir/replica-4/pid")" 2>/dev/null
}
trap cleanup EXIT

t=$(now); "$rota" bench backup "$dir/backup.rota" --finished "$finished" --pending "$pending" >/dev/null || exit 1
echo "backup of $((finished + pending)) jobs: $(stat -c %s "$dir/backup.rota") bytes in $(since "$t") s"
# shellcheck source=deploy/bench/restore-members.sh
. "$(dirname "$0")/restore-members.sh"
restore_members "$rota" "$dir" "$base" || exit 1
export ROTA_SERVER_ARGS="--user-requests-per-s 0 --user-max-in-flight 100000 --snapshot-every ${SNAPSHOT_EVERY:-20000}"
t=$(now); ROTA_BIN="$server" bash "$here/cluster.sh" start "$dir" 3 "$base" >"$dir/start.log" 2>&1 || { echo "no leader; see $dir" >&2; exit 1; }
echo "three restored members: a leader serving after $(since "$t") s; rss $(rss 1), $(rss 2), $(rss 3)"
# shellcheck disable=SC1091
. "$dir/env"
for round in 1 2 3; do
  "$rota" bench submit --clients 256 --rate 1000 --duration-s 20 >"$dir/open-loop-$round.json" 2>&1
  python3 - "$dir/open-loop-$round.json" "$round" <<'PY' 2>/dev/null || echo "open loop round $round: $(head -1 "$dir/open-loop-$round.json")"
import json, sys
d = json.load(open(sys.argv[1]))
l = d["latency_ms"]
kinds = ", ".join(f"{k} {n}" for k, n in d.get("errors_by_kind", {}).items())
print(f"open loop round {sys.argv[2]}: {d['acked']} acked, {d['errors']} errors{' (' + kinds + ')' if kinds else ''}, p50 {l['p50']} ms, p99 {l['p99']} ms")
for kind, example in d.get("error_examples", {}).items():
    print(f"  first {kind}: {example}")
PY
done
# When the slow submits started, next to when each replica froze and wrote
# a snapshot (seconds from the start of the round).
python3 - "$dir" <<'PY'
import datetime, json, re, sys
d = sys.argv[1]
events = []
for i in (1, 2, 3):
    for line in open(f"{d}/replica-{i}/server.log", errors="replace"):
        line = re.sub(r"\x1b\[[0-9;]*m", "", line)
        m = re.match(r"(\S+Z)\s", line)
        if not m or ("snapshot" not in line and "slow" not in line):
            continue
        at = datetime.datetime.fromisoformat(m.group(1).replace("Z", "+00:00")).timestamp()
        if "state frozen" in line:
            events.append((at, f"replica {i} froze"))
        elif "encoded, writing" in line:
            events.append((at, f"replica {i} encoded"))
        elif "slow log sync" in line or "slow apply" in line:
            took = " ".join(re.findall(r"took_ms=\d+", line))
            events.append((at, f"replica {i} {'log sync' if 'sync' in line else 'apply'} {took}"))
        elif "built snapshot" in line:
            took = " ".join(re.findall(r"(?:encode|write)_ms=\d+", line))
            events.append((at, f"replica {i} built ({took})"))
events.sort()
for r in (1, 2, 3):
    try:
        run = json.load(open(f"{d}/open-loop-{r}.json"))
    except (OSError, ValueError):
        continue
    start = run.get("started_unix_s", 0)
    first = lambda s: f" from {s['first_slow_ms'] / 1000:.3f} s" if s.get("first_slow_ms") is not None else ""
    slow = ", ".join(f"{s['second']}s: {s['slow']} slow{first(s)}, {s['failed']} failed, max {s['max_ms']:.0f} ms" for s in run.get("troubled_seconds", []))
    print(f"round {r} seconds with submits over 50 ms: {slow or 'none'}")
    for at, what in events:
        if start <= at <= start + run.get("duration_s", 20) + 2:
            print(f"  {at - start:7.3f} s {what}")
PY
# Snapshots built, and the bucket holding the 99th percentile of the
# replica's synced log appends over the whole run (every metric is kept
# in DIR/metrics-N.txt).
metrics_line() {
  curl -s "127.0.0.1:$((base + 100 + $1 - 1))/metrics" | python3 -c '
import re, sys
text = sys.stdin.read()
def value(name):
    m = re.search(r"^" + name + r" (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0
buckets = [(float(le), float(n)) for le, n in re.findall(r"^rota_log_sync_seconds_bucket\{le=\"([0-9.e+-]+)\"\} (\S+)$", text, re.M)]
count = value("rota_log_sync_seconds_count")
p99 = next((le for le, n in sorted(buckets) if count and n >= 0.99 * count), float("inf"))
built, build_s = int(value("rota_snapshot_build_seconds_count")), value("rota_snapshot_build_seconds_sum")
over = lambda limit: int(count - max((n for le, n in buckets if le <= limit), default=0))
print(f"{built} snapshots built in {build_s:.1f} s; {int(count)} log syncs, p99 <= {p99 * 1000:g} ms, {over(0.01)} over 10 ms, {over(0.05)} over 50 ms")'
}
for i in 1 2 3; do
  echo "replica $i: rss $(rss "$i"); $(metrics_line "$i")"
  curl -s "127.0.0.1:$((base + 100 + i - 1))/metrics" >"$dir/metrics-$i.txt"
done
leader=$("$rota" --output json cluster | python3 -c 'import json,sys; print(json.load(sys.stdin)["leader_id"])' 2>/dev/null)
follower=2; [ "$leader" = 2 ] && follower=3
pid=$(cat "$dir/replica-$follower/pid"); kill "$pid"; while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
t=$(now); ROTA_BIN="$server" bash "$here/cluster.sh" start "$dir" 3 "$base" >"$dir/restart.log" 2>&1
for _ in $(seq 1 1200); do "$rota" health --endpoint "127.0.0.1:$((base + follower - 1))" >/dev/null 2>&1 && break; sleep 0.1; done
echo "replica $follower restarted from its data directory: serving after $(since "$t") s; rss $(rss "$follower")"
"$rota" tls cert create --server 4 --dir "$dir/tls" >/dev/null
mkdir -p "$dir/replica-4"
# shellcheck disable=SC2086
nohup "$server" server --tls-ca "$dir/tls/ca.pem" --tls-cert "$dir/tls/replica-4.pem" --tls-key "$dir/tls/replica-4-key.pem" \
  --id 4 --join --listen "127.0.0.1:$((base + 3))" --data-dir "$dir/replica-4/db" --peers "$peers,4=127.0.0.1:$((base + 3))" \
  --metrics-listen "127.0.0.1:$((base + 103))" --http-listen "127.0.0.1:$((base + 203))" $ROTA_SERVER_ARGS >>"$dir/replica-4/server.log" 2>&1 &
echo $! >"$dir/replica-4/pid"
t=$(now); "$rota" --timeout-s 300 member add 4 "127.0.0.1:$((base + 3))" >"$dir/member-add.log" 2>&1
echo "member 4 added (learner caught up by snapshot, then voter) after $(since "$t") s; rss $(rss 4)"
