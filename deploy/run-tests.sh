#!/usr/bin/env bash
# Sets up a Debian machine and runs rota's whole test suite: unit tests,
# golden scenarios, the RocksDB storage suite and the end-to-end tests that
# start real replicas on 127.0.0.1.
#
# Then a short chaos run (see the end).
#
# One profile (release) serves tests, binaries and benchmarks, so RocksDB's
# C++ is compiled once. CARGO_TARGET_DIR defaults to a directory outside
# the checkout that later runs reuse.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup-debian.sh
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/rota-target}"
cargo build --release --workspace --bins
cargo test --release --workspace -- --test-threads 2
# A short chaos run against the real binaries: 3 replicas, 2 fake-GPU agents,
# leader kills and pauses; exits non-zero on any violation.
"$CARGO_TARGET_DIR/release/rota-chaos" run --replicas 3 --agents 2 --duration-s 60 \
  --faults kill-leader,pause-leader --interval-s 8 --seed 1
