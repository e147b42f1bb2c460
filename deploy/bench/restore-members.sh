# Sourced by the big-state benchmarks: restore_members ROTA DIR BASE_PORT
# restores DIR/backup.rota into the data directories of three members
# (DIR/replica-I/db) with peers on 127.0.0.1:BASE_PORT.., one cluster id for
# all; sets `peers` for the caller.
restore_members() {
  local rota="$1" dir="$2" base="$3" cluster_id="" out i
  peers="1=127.0.0.1:$base,2=127.0.0.1:$((base + 1)),3=127.0.0.1:$((base + 2))"
  for i in 1 2 3; do
    mkdir -p "$dir/replica-$i"
    out=$("$rota" --output json snapshot restore "$dir/backup.rota" --data-dir "$dir/replica-$i/db" --id "$i" \
      --peers "$peers" ${cluster_id:+--cluster-id "$cluster_id"}) || return 1
    [ -n "$cluster_id" ] || cluster_id=$(echo "$out" | python3 -c 'import json,sys; print(json.load(sys.stdin)["cluster_id"])')
  done
}
