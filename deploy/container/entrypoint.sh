#!/bin/sh
# The container's entrypoint: `daemon` runs the cache daemon, `api` the HTTP API over it (they share the
# socket's volume); anything else is run as it is (e.g. `tiercache admin stats`). Its own settings are
# TC_* variables (TIERCACHE_* ones are the daemon's config: TIERCACHE_HOST__CAPACITY_BYTES=... passes through).
#   TC_DATA   the data directory, a volume (default /var/lib/tiercache): blocks, namespaces, API keys
#   TC_RUN    the socket's directory, a volume both services mount (default /run/tiercache)
#   TC_CONFIG a TOML config for the daemon, if present (default /etc/tiercache/tiercache.toml)
#   TC_MODEL  a Hugging Face model directory for the API (default: the built-in model)
#   TC_WORKERS, TC_HOST, TC_PORT: the API's workers (2), address (0.0.0.0), port (8000)
#   TC_METRICS_PORT, TC_METRICS_HOST: the daemon's metrics and status page (9464 on 0.0.0.0; 0: none)
# The API listens on every address of the container, so it needs keys: without $TC_DATA/api-keys,
# the first start writes one key (tenant "household") there and prints it once.
set -eu
DATA=${TC_DATA:-/var/lib/tiercache}
RUN=${TC_RUN:-/run/tiercache}
CONFIG=${TC_CONFIG:-/etc/tiercache/tiercache.toml}
TIERCACHE=${TC_BIN:-tiercache}
SOCKET="$RUN/tiercache.sock"

case "${1:-}" in
  daemon)
    mkdir -p "$DATA" "$RUN"
    set -- serve --socket "$SOCKET" --data-dir "$DATA"
    if [ -f "$CONFIG" ]; then
      set -- "$@" --config "$CONFIG"
    fi
    export TIERCACHE_SERVER__METRICS_PORT="${TC_METRICS_PORT:-9464}"
    export TIERCACHE_SERVER__METRICS_HOST="${TC_METRICS_HOST:-0.0.0.0}"
    exec $TIERCACHE "$@"
    ;;
  api)
    mkdir -p "$DATA"
    keys="$DATA/api-keys"
    if [ ! -f "$keys" ]; then
      key=$(python3 -c 'import secrets; print("tc-" + secrets.token_urlsafe(24))')
      umask 077
      printf '# KEY TENANT: one per line (tiercache api --api-keys)\n%s household\n' "$key" > "$keys"
      echo "tiercache: wrote an API key to $keys (tenant household): $key" >&2
    fi
    waited=0
    until [ -S "$SOCKET" ]; do  # the daemon's socket, on the shared volume
      if [ "$waited" -ge 120 ]; then
        echo "tiercache: no daemon socket at $SOCKET after 120 s" >&2
        exit 3
      fi
      sleep 1
      waited=$((waited + 1))
    done
    set -- api --socket "$SOCKET" --host "${TC_HOST:-0.0.0.0}" --port "${TC_PORT:-8000}" --api-keys "$keys" \
      --workers "${TC_WORKERS:-2}"
    if [ -n "${TC_MODEL:-}" ]; then
      set -- "$@" --model "$TC_MODEL"
    fi
    exec $TIERCACHE "$@"
    ;;
  *)
    exec "$@"
    ;;
esac
