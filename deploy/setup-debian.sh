#!/usr/bin/env bash
# Installs what building rota needs on Debian/Ubuntu: protoc (for the gRPC
# code), libclang itself (bindgen in librocksdb-sys loads it at build time)
# and a C++ compiler; and what its tests need: systemd (systemd-analyze
# verifies the units), prometheus (promtool checks the alert rules; the
# end-to-end alert test runs a Prometheus server of its own) and chromium
# (the board's test opens the board in a headless browser). Rust itself comes from rustup (https://rustup.rs) and
# must be on PATH.
#
#   deploy/setup-debian.sh            install what is missing
#   deploy/setup-debian.sh --check    print the packages that would be installed
#
# ROTA_SETUP_ROOT (default /) is the root the detection looks under; the
# setup test points it at a fake root.
set -euo pipefail
root="${ROTA_SETUP_ROOT:-/}"
root="${root%/}"

# True when the real libclang (libclang.so, libclang.so.N, libclang-N.so...)
# is present. libclang-cpp*.so is a different library (the C++ interface,
# shipped on many images without libclang) and does not satisfy bindgen.
have_libclang() {
  local dir f base
  for dir in "$root"/usr/lib/llvm-*/lib "$root"/usr/lib/*-linux-gnu "$root"/usr/lib "$root"/usr/local/lib; do
    [ -d "$dir" ] || continue
    for f in "$dir"/libclang.so* "$dir"/libclang-[0-9]*.so*; do
      [ -e "$f" ] || continue
      base="${f##*/}"
      case "$base" in
        libclang-cpp*) continue ;;
      esac
      return 0
    done
  done
  return 1
}

have_command() {
  if [ -n "${ROTA_SETUP_ROOT:-}" ]; then
    [ -x "$root/usr/bin/$1" ]
  else
    command -v "$1" >/dev/null
  fi
}

need=()
have_command protoc || need+=(protobuf-compiler)
have_command c++ || need+=(g++)
have_libclang || need+=(libclang-dev)
# Tests: systemd-analyze verifies the units in deploy/systemd.
have_command systemd-analyze || need+=(systemd)
# Tests: kubectl renders deploy/kubernetes (its built-in kustomize).
have_command kubectl || need+=(kubernetes-client)
# Tests: promtool and a prometheus server for the alert rules.
{ have_command promtool && have_command prometheus; } || need+=(prometheus)
# Tests: the REST tests drive the API with curl.
have_command curl || need+=(curl)
# Tests: the board's test drives a headless Chromium over its DevTools port.
have_command chromium || need+=(chromium)

if [ "${1:-}" = "--check" ]; then
  echo "${need[*]:-}"
  exit 0
fi
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  # The prometheus package starts its own server as a service; the tests
  # start theirs. A policy-rc.d that refuses (101) keeps the package's from
  # starting during the install (only one we put there is removed).
  policy=/usr/sbin/policy-rc.d
  added_policy=""
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null
    $SUDO chmod 755 "$policy"
    added_policy=1
  fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
  [ -n "$added_policy" ] && $SUDO rm -f "$policy"
  # Where systemd runs, keep the package's server from starting at boot too.
  if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
    $SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true
  fi
fi
command -v cargo >/dev/null || { echo "cargo not found: install Rust with rustup first" >&2; exit 1; }

# The Debian package is built with cargo-deb.
cargo deb --version >/dev/null 2>&1 || cargo install --locked cargo-deb --version 3.8.0

# Tests: Python tools from PyPI (deploy/python-tools.txt) in a virtualenv of
# their own, installed again only when that list changes.
venv="${ROTA_VENV:-/var/tmp/rota-venv}"
tools="$(dirname "$0")/python-tools.txt"
if ! cmp -s "$tools" "$venv/python-tools.txt"; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check -r "$tools"
  cp "$tools" "$venv/python-tools.txt"
fi
