#!/usr/bin/env bash
# Benchmark: rota's durable submits/s next to etcd 3.4's durable puts/s, the
# same closed loop (`rota bench submit` / `rota bench etcd`) at 1, 16 and 256
# clients, three local members each, plaintext, on 127.0.0.1; then rota
# again with TLS 1.3 on every link (client certificates included). Rounds
# alternate, each on fresh data directories. Installs etcd from Debian's
# `etcd-server` when it is missing (as root). Stops what it started by PID.
# Beside each rate: the servers' CPU time (user + system, all three members,
# from /proc) per acknowledged write, a figure a busy or noisy host moves far
# less than the rate, and the one that says which store costs the host more;
# and the benchmark client's own CPU time per write, which shares the host's
# cores with the servers.
#
#   deploy/bench/etcd-side-by-side.sh DIR [ROUNDS] [SECONDS]
set -u
dir="${1:?usage: $0 DIR [ROUNDS] [SECONDS]}"; rounds="${2:-3}"; seconds="${3:-8}"
rota="${ROTA_BIN:-${CARGO_TARGET_DIR:-/var/tmp/rota-target}/release/rota}"
here="$(cd "$(dirname "$0")/../local" && pwd)"
[ -e "$dir" ] && { echo "$dir exists; give a new directory" >&2; exit 2; }
command -v etcd >/dev/null || { DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server >/dev/null || exit 1; }
mkdir -p "$dir"
etcd --version | head -1
client_port() { echo $((23790 + $1)); }
peer_port() { echo $((23800 + $1)); }
etcd_pids=()
leader=""
stop_etcd() { for pid in "${etcd_pids[@]}"; do kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; done; etcd_pids=(); }
trap 'stop_etcd; ROTA_INSECURE=1 ROTA_BIN="$rota" bash "$here/cluster.sh" stop "$dir/rota" >/dev/null 2>&1' EXIT

# start_etcd DIR: three members; sets etcd_pids and leader (its client address).
start_etcd() {
  local d="$1" cluster="" token="bench-$RANDOM"
  mkdir -p "$d"
  for i in 1 2 3; do cluster+="${cluster:+,}e$i=http://127.0.0.1:$(peer_port "$i")"; done
  for i in 1 2 3; do
    etcd --name "e$i" --data-dir "$d/e$i" \
      --listen-client-urls "http://127.0.0.1:$(client_port "$i")" --advertise-client-urls "http://127.0.0.1:$(client_port "$i")" \
      --listen-peer-urls "http://127.0.0.1:$(peer_port "$i")" --initial-advertise-peer-urls "http://127.0.0.1:$(peer_port "$i")" \
      --initial-cluster "$cluster" --initial-cluster-state new --initial-cluster-token "$token" \
      >"$d/e$i.log" 2>&1 &
    etcd_pids+=($!)
  done
  # The leader: the member whose status names itself leader (bounded wait).
  for _ in $(seq 1 100); do
    for i in 1 2 3; do
      if curl -s --max-time 1 -X POST "http://127.0.0.1:$(client_port "$i")/v3/maintenance/status" -d '{}' 2>/dev/null |
        python3 -c 'import json,sys; d=json.load(sys.stdin); sys.exit(0 if d.get("leader") and d["leader"] == d["header"]["member_id"] else 1)' 2>/dev/null; then
        leader="127.0.0.1:$(client_port "$i")"; return 0
      fi
    done
    sleep 0.2
  done
  return 1
}

# cpu_ticks PID...: user + system clock ticks of the processes, summed.
cpu_ticks() {
  local total=0 stat fields
  for pid in "$@"; do
    stat=$(cut -d')' -f2 "/proc/$pid/stat" 2>/dev/null) || continue
    read -ra fields <<<"$stat"
    # After the command name: state is field 0, utime 11 and stime 12.
    total=$((total + fields[11] + fields[12]))
  done
  echo "$total"
}

# timed FILE COMMAND...: runs COMMAND, its output to FILE; prints the CPU
# seconds (user + system) it used.
timed() {
  local file="$1" TIMEFORMAT='%U %S' used
  shift
  used=$( { time "$@" >"$file" 2>&1; } 2>&1 )
  awk '{ print $1 + $2 }' <<<"$used"
}

# with_cpu FILE TICKS_BEFORE TICKS_AFTER CLIENT_S: adds the servers' and the
# client's CPU microseconds per acknowledged write to the JSON report.
with_cpu() {
  python3 - "$@" <<'PY' 2>/dev/null || true
import json, os, sys
path, before, after, client_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
d = json.load(open(path))
acked = max(d["acked"], 1)
d["server_cpu_us_per_write"] = (after - before) / os.sysconf("SC_CLK_TCK") * 1e6 / acked
d["client_cpu_us_per_write"] = client_s * 1e6 / acked
json.dump(d, open(path, "w"), indent=2)
PY
}

figure() { # FILE KEY
  python3 - "$1" "$2" <<'PY' 2>/dev/null || echo "failed: $(head -c 200 "$1")"
import json, sys
d = json.load(open(sys.argv[1]))
l = d["latency_ms"]
cpu, client = d.get("server_cpu_us_per_write"), d.get("client_cpu_us_per_write")
cpu_text = f", servers' CPU {cpu:.0f} us, client's {client:.0f} us per write" if cpu is not None else ""
print(f"{d[sys.argv[2]]:.0f}/s, p50 {l['p50']} ms, p99 {l['p99']} ms, {d['errors']} errors{cpu_text}")
PY
}

# run_rota MODE ROUND CLIENTS: the closed loop on a fresh 3-replica cluster,
# plaintext (MODE plain) or TLS on every link (MODE tls). A fresh cluster
# for each concurrency: every submitted job stays pending (no agents). A
# cluster holds 200,000 live jobs by default, which one run at 25,000/s
# fills within 8 s; a full cluster refuses at once and its rate means
# nothing, so the bound is raised through the log first (once the new
# leader has raised the cluster version that carries it).
run_rota() {
  local mode="$1" round="$2" clients="$3" insecure=0 out cli=("$rota")
  out="$dir/rota-$round-$clients"
  if [ "$mode" = plain ]; then insecure=1; cli+=(--insecure); else out="$dir/rota-tls-$round-$clients"; fi
  ROTA_INSECURE=$insecure ROTA_SERVER_ARGS="--user-requests-per-s 0 --user-max-in-flight 100000" ROTA_BIN="$rota" \
    bash "$here/cluster.sh" start "$dir/rota" 3 7601 >"$out.log" 2>&1 || { echo "rota elected no leader" >&2; return 1; }
  [ "$mode" = tls ] && cli+=(--tls-ca "$dir/rota/tls/ca.pem" --tls-cert "$dir/rota/tls/user-operator.pem" --tls-key "$dir/rota/tls/user-operator-key.pem")
  cli+=(--endpoints "$(cat "$dir/rota/endpoints")")
  local raised=""
  for _ in $(seq 1 100); do
    "${cli[@]}" limits set --max-live-jobs 1000000 >/dev/null 2>&1 && { raised=1; break; }
    sleep 0.1
  done
  [ -n "$raised" ] || { echo "could not raise the live-job bound" >&2; return 1; }
  local pids=() before client_s
  for i in 1 2 3; do pids+=("$(cat "$dir/rota/replica-$i/pid")"); done
  before=$(cpu_ticks "${pids[@]}")
  client_s=$(timed "$out.json" "${cli[@]}" bench submit --clients "$clients" --duration-s "$seconds")
  with_cpu "$out.json" "$before" "$(cpu_ticks "${pids[@]}")" "$client_s"
  printf 'round %s rota%-5s %s clients: %s\n' "$round" "$([ "$mode" = tls ] && echo " tls")" "$clients" "$(figure "$out.json" jobs_per_s)"
  ROTA_INSECURE=$insecure ROTA_BIN="$rota" bash "$here/cluster.sh" stop "$dir/rota" >/dev/null
  mv "$dir/rota" "$out-data"
}

for round in $(seq 1 "$rounds"); do
  start_etcd "$dir/etcd-$round" || { echo "etcd elected no leader; see $dir/etcd-$round" >&2; exit 1; }
  for clients in 1 16 256; do
    before=$(cpu_ticks "${etcd_pids[@]}")
    client_s=$(timed "$dir/etcd-$round-$clients.json" "$rota" bench etcd --endpoint "$leader" --clients "$clients" --duration-s "$seconds")
    with_cpu "$dir/etcd-$round-$clients.json" "$before" "$(cpu_ticks "${etcd_pids[@]}")" "$client_s"
    echo "round $round etcd  $clients clients: $(figure "$dir/etcd-$round-$clients.json" puts_per_s)"
  done
  stop_etcd
  for mode in plain tls; do
    for clients in 1 16 256; do
      run_rota "$mode" "$round" "$clients" || exit 1
    done
  done
done

# Medians over the rounds, and rota's rate over etcd's.
python3 - "$dir" "$rounds" <<'PY'
import json, statistics, sys
d, rounds = sys.argv[1], int(sys.argv[2])
def by_round(stem, key):
    """Each round's figure where its report is there and readable."""
    out = {}
    for r in range(1, rounds + 1):
        try:
            out[r] = json.load(open(f"{d}/{stem.format(r=r)}.json"))[key]
        except (OSError, ValueError, KeyError):
            pass
    return out
def rates(stem, key):
    return list(by_round(stem, key).values())
def medians(c, etcd_key, rota_key):
    """etcd's, rota's and rota with TLS's medians at c clients; None if a series is empty."""
    series = [rates(f"etcd-{{r}}-{c}", etcd_key), rates(f"rota-{{r}}-{c}", rota_key), rates(f"rota-tls-{{r}}-{c}", rota_key)]
    return [statistics.median(s) for s in series] if all(series) else None
def table(etcd_key, rota_key, row):
    """One line per concurrency: row(etcd, rota, rota with TLS) of the medians."""
    for c in (1, 16, 256):
        m = medians(c, etcd_key, rota_key)
        print(f"{c:>7}  " + ("incomplete" if m is None else row(*m)))
print("clients  etcd/s  rota/s  rota-tls/s  rota/etcd  rota-tls/etcd  (medians)")
table("puts_per_s", "jobs_per_s", lambda e, p, t: f"{e:6.0f}  {p:6.0f}  {t:10.0f}  {p / e:9.2f}  {t / e:13.2f}")
print()
print("servers' CPU microseconds per acknowledged write, three members (medians; lower is better)")
print("clients  etcd  rota  rota-tls  etcd/rota  etcd/rota-tls")
cpu = "server_cpu_us_per_write"
table(cpu, cpu, lambda e, p, t: f"{e:4.0f}  {p:4.0f}  {t:8.0f}  {e / p:9.2f}  {e / t:13.2f}")
print()
print("the benchmark client's CPU microseconds per acknowledged write, and the host's in all")
print("(servers' and client's, summed in each round): what the cores give each write (medians)")
print("clients  etcd  rota  rota-tls  host: etcd  rota  rota-tls  etcd/rota  etcd/rota-tls")
client = "client_cpu_us_per_write"
def host_medians(c):
    """Medians over the rounds of servers' plus client's CPU per write: etcd, rota, rota with TLS."""
    out = []
    for stem in (f"etcd-{{r}}-{c}", f"rota-{{r}}-{c}", f"rota-tls-{{r}}-{c}"):
        servers, own = by_round(stem, cpu), by_round(stem, client)
        sums = [servers[r] + own[r] for r in servers.keys() & own.keys()]
        if not sums:
            return None
        out.append(statistics.median(sums))
    return out
def host_row(c):
    k, h = medians(c, client, client), host_medians(c)
    if k is None or h is None:
        return "incomplete"
    return f"{k[0]:4.0f}  {k[1]:4.0f}  {k[2]:8.0f}  {h[0]:10.0f}  {h[1]:4.0f}  {h[2]:8.0f}  {h[0] / h[1]:9.2f}  {h[0] / h[2]:13.2f}"
for c in (1, 16, 256):
    print(f"{c:>7}  " + host_row(c))
# Each round runs etcd and rota a minute apart; the host's speed drifts more
# than that over a whole run, so the ratio within each round says more than
# the ratio of two medians taken from different rounds.
def paired(stem, c):
    """rota's rate over etcd's in each round that has both."""
    etcd = by_round(f"etcd-{{r}}-{c}", "puts_per_s")
    rota = by_round(f"{stem}-{{r}}-{c}", "jobs_per_s")
    return [rota[r] / etcd[r] for r in sorted(etcd.keys() & rota.keys()) if etcd[r] > 0]
print()
print("rota's rate over etcd's within each round (the rounds' ratios; their median)")
for c in (1, 16, 256):
    cells = []
    for name, stem in (("plaintext", "rota"), ("tls", "rota-tls")):
        ratios = paired(stem, c)
        cells.append(f"{name} " + (" / ".join(f"{x:.2f}" for x in ratios) + f"; {statistics.median(ratios):.2f}" if ratios else "incomplete"))
    print(f"{c:>7}  " + "   ".join(cells))
PY
