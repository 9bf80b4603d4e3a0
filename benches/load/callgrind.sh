#!/usr/bin/env bash
# Instructions per request of the service on the reference workload, counted
# by callgrind (deterministic, unlike wall-clock on a shared machine).
#
#   bash benches/load/callgrind.sh [BINARY]     # default: the release build
#   N=2000 bash benches/load/callgrind.sh
#   WRK=10 bash benches/load/callgrind.sh   # under wrk, 64 connections, 10 s
#
# Starts the binary under callgrind with instrumentation off, loads the
# reference workflow and channel, warms up with 200 requests, then counts N
# requests and prints instructions per request (the callgrind.out file is
# kept for callgrind_annotate).
set -euo pipefail
cd "$(dirname "$0")/../.."
. benches/load/reference.sh
N="${N:-2000}"
PORT="${PORT:-18090}"
TARGET="${CARGO_TARGET_DIR:-target}"
BIN="${1:-$TARGET/release/sluice}"
OUT="${OUT:-$(mktemp -d)}"
command -v valgrind >/dev/null || { echo "valgrind is required: apt-get install -y valgrind" >&2; exit 2; }
work="$(mktemp -d)"
cleanup() { kill "${PID:-}" 2>/dev/null || true; wait "${PID:-}" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

SERVICE_SERVER__PORT=$PORT SERVICE_STORAGE__URL="sqlite://$work/bench.db" \
  SERVICE_LOGGING__LEVEL="${LEVEL:-warn}" SERVICE_STORAGE__BACKUP_DIR="$work/backups" \
  valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$OUT/callgrind.out" \
  "$BIN" serve > "$work/sluice.log" 2>&1 &
PID=$!
for _ in $(seq 600); do curl -sf "127.0.0.1:$PORT/readyz" >/dev/null && break; sleep 0.2; done
admin="http://127.0.0.1:$PORT/api/v1/admin"
create_reference "$admin" "$REF"
URL="http://127.0.0.1:$PORT/api/v1/data/bench/orders/ord-7f3a9c"
python3 benches/load/drive.py "$URL" "$REF/request.json" 200 4
callgrind_control -i on "$PID" >/dev/null
if [[ -n "${WRK:-}" ]]; then
  # Under the load benchmark's own generator (64 connections for WRK
  # seconds): requests arrive in batches as they do in the real runs, so
  # the per-request share of the runtime's and the kernel interface's work
  # is the loaded one. N becomes the number of requests wrk completed.
  SLUICE_REQUEST="$REF/request.json" wrk -t1 -c64 -d"${WRK}s" -s benches/load/post.lua "$URL" > "$OUT/wrk.txt"
  N=$(grep -oE '^ *[0-9]+ requests in' "$OUT/wrk.txt" | awk '{print $1}')
else
  python3 benches/load/drive.py "$URL" "$REF/request.json" "$N" 4
fi
callgrind_control -i off "$PID" >/dev/null
callgrind_control -d "$PID" >/dev/null
sleep 1
total=$(cat "$OUT"/callgrind.out* | awk '/^totals:/ {t += $2} END {print t}')
echo "callgrind: $total instructions for $N requests = $((total / N)) per request ($OUT)"
