#!/usr/bin/env bash
# Install redis-server (and redis-cli) from the Debian/Ubuntu package when neither Redis nor Valkey
# is on this machine: the remote-tier tests and scripts/bench_cluster.py start their own cluster.
set -euo pipefail
if { command -v valkey-server && command -v valkey-cli; } >/dev/null 2>&1 \
    || { command -v redis-server && command -v redis-cli; } >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends redis-server >/dev/null
# The package's own service is not needed (the tests start nodes on free ports); leave it stopped.
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
  $SUDO systemctl disable --now redis-server >/dev/null 2>&1 || true
fi
command -v redis-server >/dev/null && command -v redis-cli >/dev/null
