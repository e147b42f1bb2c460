#!/usr/bin/env bash
# Installs what building rota needs on Debian/Ubuntu: protoc (for the gRPC
# code) and libclang (bindgen in librocksdb-sys), plus a C++ compiler.
# Rust itself comes from rustup (https://rustup.rs) and must be on PATH.
set -euo pipefail
need=()
command -v protoc >/dev/null || need+=(protobuf-compiler)
command -v c++ >/dev/null || need+=(g++)
ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1 || ls /usr/lib/x86_64-linux-gnu/libclang*.so* >/dev/null 2>&1 || need+=(libclang-dev)
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}"
fi
command -v cargo >/dev/null || { echo "cargo not found: install Rust with rustup first" >&2; exit 1; }
