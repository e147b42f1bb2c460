#!/usr/bin/env bash
# Sets up a Debian machine and runs rota's whole test suite: unit tests,
# golden scenarios, the RocksDB storage suite and the end-to-end tests that
# start real replicas on 127.0.0.1. Then a short chaos run (see the end).
#
# One profile (release) serves tests, binaries and benchmarks, so RocksDB's
# C++ is compiled once. CARGO_TARGET_DIR defaults to a directory outside
# the checkout that later runs reuse.
#
# Each stage prints how long it took, and a summary closes the run.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/rota-target}"

timings=()
stage() {
  local name="$1"; shift
  local started=$SECONDS
  echo "==> stage: $name"
  "$@"
  local took=$((SECONDS - started))
  echo "==> stage: $name took ${took} s"
  timings+=("$(printf '%-8s %5d s' "$name" "$took")")
}

chaos() {
  # 3 replicas, 2 fake-GPU agents, leader kills and pauses; exits non-zero
  # on any violation.
  "$CARGO_TARGET_DIR/release/rota-chaos" run --replicas 3 --agents 2 --duration-s 60 \
    --faults kill-leader,pause-leader --interval-s 8 --seed 1
}

stage setup bash deploy/setup-debian.sh
stage build cargo build --release --workspace --bins --tests
# The Debian package of the binaries just built (tests/tests/debian_package.rs installs it).
package() {
  rm -rf "$CARGO_TARGET_DIR/debian"
  cargo deb -p rota-cli --no-build --output "$CARGO_TARGET_DIR/debian/"
}
stage package package
stage test cargo test --release --workspace -- --test-threads 2
stage chaos chaos

echo "==> stage times"
printf '    %s\n' "${timings[@]}"
