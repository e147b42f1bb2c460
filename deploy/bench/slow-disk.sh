#!/usr/bin/env bash
# Durable submits on slow disks: a fresh 3-replica cluster (plaintext,
# 127.0.0.1) whose disks are made slow in one of two ways, then a closed
# loop of submits at each concurrency. Rounds alternate between the builds
# given, each on fresh data directories. Stops what it started by PID, also
# when interrupted.
#
#   deploy/bench/slow-disk.sh DIR SLOWNESS ROUNDS SECONDS "CLIENTS..." TAG=BIN [TAG=BIN...]
#
# SLOWNESS is either
#   400iops (or 400)  each replica in a cgroup of its own whose write IOPS on
#                     the data directory's device are throttled (cgroup v1
#                     blkio throttle, as a cloud volume with provisioned IOPS;
#                     it lets bursts through, then holds writes back). Needs
#                     root and a cgroup v1 blkio hierarchy; removes the
#                     cgroups it made.
#   2000us-sync       every fsync/fdatasync of a replica takes at least that
#                     long (deploy/bench/slow-sync.c, built here with cc and
#                     loaded with LD_PRELOAD): a uniformly slow disk, as a
#                     network block device, one per replica.
#
# e.g. deploy/bench/slow-disk.sh /tmp/sd 400iops 3 6 "1 16 64 256" now=target/release/rota
set -u
dir="${1:?usage: $0 DIR SLOWNESS ROUNDS SECONDS \"CLIENTS...\" TAG=BIN...}"; slowness="$2"; rounds="$3"; seconds="$4"; concurrency="$5"
shift 5
[ $# -ge 1 ] || { echo "give at least one TAG=BIN" >&2; exit 2; }
[ -e "$dir" ] && { echo "$dir exists; give a new directory" >&2; exit 2; }
case "$slowness" in
  *us-sync) mode=sync; sync_us="${slowness%us-sync}" ;;
  *iops) mode=iops; iops="${slowness%iops}" ;;
  *) mode=iops; iops="$slowness" ;;
esac
case "${iops:-}${sync_us:-}" in ''|*[!0-9]*) echo "SLOWNESS: give NNNiops or NNNus-sync, not '$slowness'" >&2; exit 2;; esac
here="$(cd "$(dirname "$0")/../local" && pwd)"
bench="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$dir"
blkio=/sys/fs/cgroup/blkio
groups=()
running=()  # the cluster under way: its directory and binary
# Stop the cluster under way, if any.
stop_running() {
  [ ${#running[@]} -eq 0 ] || ROTA_INSECURE=1 ROTA_BIN="${running[1]}" bash "$here/cluster.sh" stop "${running[0]}" >/dev/null 2>&1
  running=()
}
cleanup() {
  stop_running
  for group in "${groups[@]}"; do
    # A cgroup is removed once empty: move anything left back to the root.
    [ -d "$group" ] && { while read -r pid; do echo "$pid" >"$blkio/cgroup.procs" 2>/dev/null; done <"$group/cgroup.procs"; rmdir "$group"; }
  done
}
trap 'cleanup' EXIT
preload=()  # the environment the replicas start with
if [ "$mode" = iops ]; then
  [ -w "$blkio" ] || { echo "no writable cgroup v1 blkio hierarchy at $blkio" >&2; exit 2; }
  # The device holding DIR, as MAJOR:MINOR (a whole disk: throttles apply to it).
  devnum=$(stat -c '%Hd:%Ld' "$dir")
  for i in 1 2 3; do
    group="$blkio/rota-slow-disk-$$-$i"
    mkdir "$group" && echo "$devnum $iops" >"$group/blkio.throttle.write_iops_device" || exit 1
    groups+=("$group")
  done
  echo "write IOPS per replica: $iops on device $devnum"
else
  cc -shared -fPIC -O2 -o "$dir/slow-sync.so" "$bench/slow-sync.c" -ldl || exit 1
  preload=(LD_PRELOAD="$dir/slow-sync.so" ROTA_SLOW_SYNC_US="$sync_us")
  echo "every sync of a replica takes at least $sync_us us"
fi
for round in $(seq 1 "$rounds"); do
  for spec in "$@"; do
    tag="${spec%%=*}"; bin="${spec#*=}"; d="$dir/$tag-$round"
    running=("$d" "$bin")
    env "${preload[@]}" ROTA_INSECURE=1 ROTA_SERVER_ARGS="--user-requests-per-s 0 --user-max-in-flight 100000" ROTA_BIN="$bin" \
      bash "$here/cluster.sh" start "$d" 3 7601 >"$d.log" 2>&1 || { echo "$tag: the cluster did not start (see $d.log)" >&2; exit 1; }
    if [ "$mode" = iops ]; then
      for i in 1 2 3; do cat "$d/replica-$i/pid" >"${groups[$((i - 1))]}/cgroup.procs"; done
    fi
    cli=("$bin" --insecure --endpoints "$(cat "$d/endpoints")")
    for _ in $(seq 1 100); do "${cli[@]}" limits set --max-live-jobs 1000000 >/dev/null 2>&1 && break; sleep 0.1; done
    for clients in $concurrency; do
      "${cli[@]}" bench submit --clients "$clients" --duration-s "$seconds" >"$d.$clients.json" 2>&1
      python3 - "$d.$clients.json" "$tag" "$round" "$clients" <<'PY'
import json, sys
path, tag, round_, clients = sys.argv[1:]
try:
    d = json.load(open(path))
except ValueError:
    sys.exit(f"{tag} round {round_} {clients} clients: no result ({path})")
l = d["latency_ms"]
print(f"round {round_} {tag:>8} {int(clients):>4} clients: {d['jobs_per_s']:8.0f}/s, p50 {l['p50']} ms, p99 {l['p99']} ms, {d['errors']} errors")
PY
    done
    stop_running
    rm -rf "$d"
  done
done
