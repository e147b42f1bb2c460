#!/bin/sh
# Starts one rota replica of the StatefulSet.
#
# The replica's id lives in its persistent volume, not in the pod's name:
# the first start of a founding pod (rota-0, rota-1, rota-2) takes the
# ordinal + 1 and writes it down; every later start reads it back. A pod
# whose volume was lost must not come back under its old id (its peers
# would take an empty log for a member that still holds their entries):
# the operator picks a new id, adds the pod's name and that id to the
# ConfigMap `rota-replica-join` (key: pod name, value: id), and runs
# `rota member add ID POD.rota.NAMESPACE.svc:7000` once it is up.
set -eu

data="${ROTA_DATA:-/var/lib/rota}"
tls="${ROTA_TLS_DIR:-/etc/rota/tls}"
join_dir="${ROTA_JOIN_DIR:-/etc/rota/join}"
service="${ROTA_SERVICE:-rota}"
namespace="${POD_NAMESPACE:?POD_NAMESPACE is not set}"
pod="${POD_NAME:?POD_NAME is not set}"
founders="${ROTA_FOUNDING_REPLICAS:-3}"
port="${ROTA_PORT:-7000}"

fail() { echo "rota-replica-start: $*" >&2; exit 64; }
numeric() { case "$1" in ''|*[!0-9]*) return 1 ;; *) [ "$1" -gt 0 ] ;; esac; }

mkdir -p "$data"
if [ -f "$data/replica-id" ]; then
  id="$(cat "$data/replica-id")"
  numeric "$id" || fail "$data/replica-id holds '$id', not an id"
elif [ -f "$join_dir/$pod" ]; then
  id="$(cat "$join_dir/$pod")"
  numeric "$id" || fail "rota-replica-join names '$id' for $pod, not an id"
  touch "$data/replica-join"
elif [ -d "$data/replica" ]; then
  fail "$data/replica exists but $data/replica-id does not: this volume was not written by this script"
else
  ordinal="${pod##*-}"
  case "$ordinal" in ''|*[!0-9]*) fail "pod name $pod does not end in an ordinal" ;; esac
  [ "$ordinal" -lt "$founders" ] || fail "$pod is past the $founders founding replicas: give it an id in rota-replica-join"
  id=$((ordinal + 1))
fi
echo "$id" > "$data/replica-id.tmp"
mv "$data/replica-id.tmp" "$data/replica-id"

name() { echo "$service-$1.$service.$namespace.svc:$port"; }
if [ -f "$data/replica-join" ]; then
  # Itself first, then the founding pods but this one: the replica's
  # start-up check asks them whether this id held data before (a wiped
  # volume under a joined id must be refused too).
  peers="$id=$(name "${pod##*-}")"
  i=0
  while [ "$i" -lt "$founders" ]; do
    [ "$i" = "${pod##*-}" ] || peers="$peers,$((i + 1))=$(name "$i")"
    i=$((i + 1))
  done
  join="--join"
else
  peers=""
  i=0
  while [ "$i" -lt "$founders" ]; do
    peers="${peers:+$peers,}$((i + 1))=$(name "$i")"
    i=$((i + 1))
  done
  join=""
fi

cert="$tls/replica-$id.pem"
key="$tls/replica-$id-key.pem"
[ -f "$cert" ] && [ -f "$key" ] || fail "no certificate for replica $id in $tls (rota tls cert create --server $id, then add it to the Secret rota-replica-tls)"

set -- server --id "$id" --listen "0.0.0.0:$port" --peers "$peers" --data-dir "$data/replica" \
  --tls-ca "$tls/ca.pem" --tls-cert "$cert" --tls-key "$key" --metrics-listen "0.0.0.0:${ROTA_METRICS_PORT:-9100}"
[ -z "$join" ] || set -- "$@" "$join"
[ -z "${ROTA_BOOTSTRAP_ADMIN:-}" ] || set -- "$@" --bootstrap-admin "$ROTA_BOOTSTRAP_ADMIN"
exec "${ROTA_BIN:-rota}" "$@"
