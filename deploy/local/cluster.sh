#!/usr/bin/env bash
# Start or stop a local cluster of N rota replicas on 127.0.0.1.
#
#   deploy/local/cluster.sh start DIR [N=3] [BASE_PORT=7001]
#   deploy/local/cluster.sh agents DIR [COUNT=2] [GPUS=8xH100-80GB]   # fake-GPU node agents
#   deploy/local/cluster.sh stop DIR                                  # replicas and agents
#
# Replica i listens on BASE_PORT+i-1 (API and Raft), BASE_PORT+100+i-1
# (Prometheus metrics) and BASE_PORT+200+i-1 (REST API, HTTPS; /v1); its data and log live in DIR/replica-i. Every link is
# TLS: a CA and certificates are made in DIR/tls on first start (replica-i,
# agent-node-i, and user-operator for the CLI). DIR/env sets ROTA_ENDPOINTS,
# ROTA_CA, ROTA_CERT and ROTA_KEY for the CLI (use: . DIR/env).
# ROTA_SERVER_ARGS adds flags to every `rota server` (e.g. "--snapshot-every 50000").
# ROTA_INSECURE=1 starts plaintext processes instead (--insecure; never in production).
set -euo pipefail
cmd="${1:-}"; dir="${2:-}"
[ -n "$cmd" ] && [ -n "$dir" ] || { sed -n '2,14p' "$0"; exit 2; }
# DIR and a ROTA_BIN path mean what they meant where the script was called
# from, not in the repository root it moves to.
dir=$(realpath -m -- "$dir")
case "${ROTA_BIN:-}" in */*) ROTA_BIN=$(realpath -m -- "$ROTA_BIN") ;; esac
cd "$(dirname "$0")/../.."
ROTA="${ROTA_BIN:-${CARGO_TARGET_DIR:-/var/tmp/rota-target}/release/rota}"
tls="$dir/tls"

# tls_flags KIND NAME: the --tls-* flags of a process (making its certificate
# on first use), or --insecure.
tls_flags() {
  if [ "${ROTA_INSECURE:-0}" = 1 ]; then echo "--insecure"; return; fi
  local stem="$1-$2"
  [ -f "$tls/ca.pem" ] || "$ROTA" tls ca create --dir "$tls" >/dev/null
  local flag
  case "$1" in
    replica) flag=--server;; agent) flag=--agent;; user) flag=--client;;
  esac
  [ -f "$tls/$stem.pem" ] || "$ROTA" tls cert create "$flag" "$2" --dir "$tls" >/dev/null
  echo "--tls-ca $tls/ca.pem --tls-cert $tls/$stem.pem --tls-key $tls/$stem-key.pem"
}

# rota_cli ARGS...: the CLI as user operator.
rota_cli() {
  local flags; flags=$(tls_flags user operator)
  # shellcheck disable=SC2086
  "$ROTA" $flags "$@"
}

start() {
  local n="${3:-3}" base="${4:-7001}" peers="" endpoints=""
  [ -x "$ROTA" ] || { echo "no rota binary at $ROTA: run cargo build --release --workspace --bins" >&2; exit 1; }
  case "$n" in 1|3|5|7) ;; *) echo "N must be 1, 3, 5 or 7" >&2; exit 2;; esac
  mkdir -p "$dir"
  for i in $(seq 1 "$n"); do
    peers+="${peers:+,}$i=127.0.0.1:$((base + i - 1))"
    endpoints+="${endpoints:+,}127.0.0.1:$((base + i - 1))"
  done
  for i in $(seq 1 "$n"); do
    local rdir="$dir/replica-$i"
    mkdir -p "$rdir"
    if [ -f "$rdir/pid" ] && kill -0 "$(cat "$rdir/pid")" 2>/dev/null; then
      echo "replica $i already running (pid $(cat "$rdir/pid"))"; continue
    fi
    local flags; flags=$(tls_flags replica "$i")
    # shellcheck disable=SC2086
    nohup "$ROTA" server $flags --bootstrap-admin operator --id "$i" --listen "127.0.0.1:$((base + i - 1))" \
      --data-dir "$rdir/db" --peers "$peers" \
      --metrics-listen "127.0.0.1:$((base + 100 + i - 1))" --http-listen "127.0.0.1:$((base + 200 + i - 1))" ${ROTA_SERVER_ARGS:-} >>"$rdir/server.log" 2>&1 &
    echo $! >"$rdir/pid"
    echo "replica $i: pid $!, api 127.0.0.1:$((base + i - 1)), metrics 127.0.0.1:$((base + 100 + i - 1)), rest 127.0.0.1:$((base + 200 + i - 1))"
  done
  echo "$endpoints" >"$dir/endpoints"
  tls_flags user operator >/dev/null
  {
    echo "export ROTA_ENDPOINTS=$endpoints"
    if [ "${ROTA_INSECURE:-0}" = 1 ]; then
      echo "# plaintext cluster: pass --insecure to rota"
    else
      echo "export ROTA_CA=$(realpath "$tls/ca.pem") ROTA_CERT=$(realpath "$tls/user-operator.pem") ROTA_KEY=$(realpath "$tls/user-operator-key.pem")"
    fi
  } >"$dir/env"
  # Wait (bounded) until the replicas agree on a leader.
  for _ in $(seq 1 100); do
    if rota_cli --endpoints "$endpoints" --timeout-s 1 cluster --output json 2>/dev/null | grep -q '"role": "leader"'; then
      rota_cli --endpoints "$endpoints" cluster; return 0
    fi
    sleep 0.2
  done
  echo "no leader elected; see $dir/replica-*/server.log" >&2; exit 1
}

agents() {
  local count="${3:-2}" gpus="${4:-8xH100-80GB}"
  local agent_bin="${ROTA_AGENT_BIN:-$(dirname "$ROTA")/rota-agent}"
  [ -f "$dir/endpoints" ] || { echo "start the replicas first" >&2; exit 1; }
  case "$count" in [1-9]|1[0-6]) ;; *) echo "COUNT must be 1..16" >&2; exit 2;; esac
  for i in $(seq 1 "$count"); do
    local adir="$dir/agent-node-$i"
    mkdir -p "$adir"
    if [ -f "$adir/pid" ] && kill -0 "$(cat "$adir/pid")" 2>/dev/null; then continue; fi
    # Ranks in cgroups (a subtree per agent) when root can create them; else the /proc scan alone.
    local contain="--no-cgroups"
    [ "$(id -u)" = 0 ] && grep -q " cgroup2 " /proc/mounts && contain="--cgroup-parent=rota-local-node-$i"
    local flags; flags=$(tls_flags agent "node-$i")
    # shellcheck disable=SC2086
    nohup "$agent_bin" $flags --endpoints "$(cat "$dir/endpoints")" --node-name "node-$i" --data-dir "$adir/data" \
      --fake-gpus "$gpus" --heartbeat-ms 500 "$contain" --job-users agent >>"$adir/agent.log" 2>&1 &
    echo $! >"$adir/pid"
    echo "agent node-$i: pid $!, $gpus"
  done
  # Wait (bounded) until every agent has registered.
  for _ in $(seq 1 100); do
    local ready
    ready=$(rota_cli --endpoints "$(cat "$dir/endpoints")" nodes --output json 2>/dev/null | grep -c '"state": "ready"' || true)
    [ "$ready" -ge "$count" ] && { rota_cli --endpoints "$(cat "$dir/endpoints")" nodes | grep -v "gpu "; return 0; }
    sleep 0.2
  done
  echo "agents did not register; see $dir/agent-*/agent.log" >&2; exit 1
}

stop() {
  for pidfile in "$dir"/agent-*/pid "$dir"/replica-*/pid; do
    [ -f "$pidfile" ] || continue
    local pid; pid="$(cat "$pidfile")"
    if kill -0 "$pid" 2>/dev/null; then
      kill "$pid"
      for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$pidfile"
  done
  echo "stopped"
}

case "$cmd" in
  start) start "$@";;
  agents) agents "$@";;
  stop) stop;;
  *) echo "unknown command $cmd (start|agents|stop)" >&2; exit 2;;
esac
