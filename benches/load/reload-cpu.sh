#!/usr/bin/env bash
# CPU time a reload costs the server's threads, per thread, for one or more
# binaries on the same database (docs/benchmarks.md): deterministic enough to
# compare builds on a noisy machine, where latency under load is not.
#
#   bash benches/load/reload-cpu.sh OLD_BIN NEW_BIN [OLD_BIN NEW_BIN ...]
#
# The database (RELOAD_WORKFLOWS = 1,000 copies of the reference workflow and
# channel, all active, on SQLite) is created with the first binary, so list
# the oldest first (a newer binary migrates a copy of it). Each binary runs
# pinned to core 0 and answers RELOADS (40) back-to-back engine reloads.
set -euo pipefail
cd "$(dirname "$0")/../.."
(($# > 0)) || { sed -n 2,12p "$0"; exit 2; }
SHARED="${SLUICE_SHARED_DIR:-$(cd .. && pwd)/shared}"
REF="$SHARED/bench/reference"
N="${RELOAD_WORKFLOWS:-1000}"
RELOADS="${RELOADS:-40}"
PORT="${SLUICE_PORT:-18085}"
work="$(mktemp -d)"
cleanup() { kill "${PID:-}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
serve() { # bin db
  SERVICE_SERVER__PORT=$PORT SERVICE_STORAGE__URL="sqlite://$2" SERVICE_LOGGING__LEVEL=warn \
    SERVICE_STORAGE__BACKUP_DIR="$work/backups" taskset -c 0 "$1" serve > "$work/sluice.log" 2>&1 &
  PID=$!
  for _ in $(seq 300); do curl -sf "127.0.0.1:$PORT/readyz" >/dev/null && return; sleep 0.1; done
  echo "the service did not become ready" >&2; tail "$work/sluice.log" >&2; exit 1
}
admin="http://127.0.0.1:$PORT/api/v1/admin"
serve "$1" "$work/base.db"
python3 benches/load/reload.py setup "$admin" "$REF" "$N"
kill "$PID"; wait "$PID" || true
for bin in "$@"; do
  rm -f "$work"/run.db*
  for suffix in "" -wal -shm; do
    [[ -e "$work/base.db$suffix" ]] && cp "$work/base.db$suffix" "$work/run.db$suffix"
  done
  serve "$bin" "$work/run.db"
  echo "== $bin"
  python3 benches/load/reload.py cpu "$admin" "$PID" "$RELOADS"
  kill "$PID"; wait "$PID" || true
done
