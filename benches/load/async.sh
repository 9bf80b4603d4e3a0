#!/usr/bin/env bash
# Async throughput (docs/benchmarks.md): the reference workflow behind an
# async channel on the embedded SQLite default. wrk submits the reference
# request for DURATION with CONNECTIONS connections (service pinned to core
# 0, wrk to core 1); then the script waits until every accepted trace has
# finished. It prints the submissions accepted per second, the traces
# finished during the load and after it, and the sustained rate (all
# traces over the time until the last one finished), with the service's
# CPU time per trace. Fails if any trace failed or an answer was not 202,
# or if a trace's result differs from expected.json.
#
#   bash benches/load/async.sh                      # 10 s, 64 connections
#   DURATION=5s SLUICE_BIN=path bash benches/load/async.sh
#   bash benches/load/async.sh --smoke              # CI: 1 s, the same checks
#   STORAGE_URL=postgres://postgres@127.0.0.1:5432/bench bash benches/load/async.sh
#                                                   # another database (its traces are counted
#                                                   # from the run's start; use an empty one)
set -euo pipefail
cd "$(dirname "$0")/../.."
. benches/load/reference.sh
SMOKE=0
[[ "${1:-}" == "--smoke" ]] && SMOKE=1
((SMOKE)) && DURATION="${DURATION:-1s}"
DURATION="${DURATION:-10s}"
CONNECTIONS="${CONNECTIONS:-64}"
PORT="${PORT:-18090}"
DRAIN_LIMIT_SECS="${DRAIN_LIMIT_SECS:-600}"
if ! command -v wrk >/dev/null; then
  # run.sh installs it; in smoke mode (CI) its absence is said, not failed.
  if ((SMOKE)); then
    echo "SKIPPING the async smoke: wrk is not installed" >&2
    exit 0
  fi
  echo "wrk is required: apt-get install -y wrk" >&2
  exit 2
fi
if [[ -z "${SLUICE_BIN:-}" ]]; then
  # As run.sh builds it (the same features, so the same binary: CI runs
  # both, and a build of the binary alone would be a second one).
  cargo build --release -q --bin sluice --example echo
  SLUICE_BIN="${CARGO_TARGET_DIR:-target}/release/sluice"
fi
work="$(mktemp -d)"
cleanup() {
  local rc=$?
  if ((rc != 0)) && [[ -s "$work/sluice.log" ]]; then
    echo "--- last lines of the service log:" >&2
    tail -n 20 "$work/sluice.log" >&2
  fi
  kill "${SLUICE_PID:-}" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

SERVICE_SERVER__PORT=$PORT SERVICE_STORAGE__URL="${STORAGE_URL:-sqlite://$work/bench.db}" \
  SERVICE_LOGGING__LEVEL=warn SERVICE_STORAGE__BACKUP_DIR="$work/backups" \
  taskset -c 0 "$SLUICE_BIN" serve > "$work/sluice.log" 2>&1 &
SLUICE_PID=$!
for _ in $(seq 100); do curl -sf "127.0.0.1:$PORT/readyz" >/dev/null && break; sleep 0.1; done
base="http://127.0.0.1:$PORT/api/v1"
create_reference "$base/admin" "$REF"
python3 - "$REF/channel.json" > "$work/channel.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c.update(channel_id="bench-async", name="bench-async", channel_type="async",
         route_pattern="/bench/async/{order_id}")
print(json.dumps(c))
PY
curl -sf -X POST "$base/admin/channels" -H 'Content-Type: application/json' -d "@$work/channel.json" >/dev/null
curl -sf -X PATCH "$base/admin/channels/bench-async/status" -H 'Content-Type: application/json' \
  -d '{"status": "active"}' >/dev/null
URL="$base/data/bench/async/ord-7f3a9c"

# One trace first: its result must match expected.json.
trace=$(curl -sf -X POST "$URL" -H 'Content-Type: application/json' --data-binary "@$REF/request.json" |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["trace_id"])')
python3 - "$base/data/traces/$trace" > "$work/trace.json" <<'PY'
import json, sys, time, urllib.request
for _ in range(200):
    t = json.load(urllib.request.urlopen(sys.argv[1]))["data"]
    if t["status"] in ("completed", "failed"):
        break
    time.sleep(0.05)
if t["status"] != "completed":
    sys.exit(f"the first trace did not complete: {t['status']} {t.get('errors')}")
print(json.dumps({"data": t["data"]}))
PY
python3 benches/load/expected.py "$work/trace.json" "$REF/expected.json" "trace result"

# How many traces have a status ("" for all).
count() {
  curl -sf "$base/data/traces?limit=1${1:+&status=$1}" |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["total"])'
}
cpu() { awk '{print $14 + $15}' "/proc/$SLUICE_PID/stat"; }
TICK=$(getconf CLK_TCK)
before_total=$(count "")
cpu0=$(cpu)
t0=$(date +%s.%N)
cat > "$work/status.lua" <<'LUA'
local bad = 0
response = function(status)
  if status ~= 202 then bad = bad + 1 end
end
done = function()
  io.stderr:write(string.format("non-202 answers: %d\n", bad))
end
LUA
cat benches/load/post.lua "$work/status.lua" > "$work/wrk.lua"
SLUICE_REQUEST="$REF/request.json" taskset -c 1 wrk -t1 -c"$CONNECTIONS" -d"$DURATION" --latency \
  -s "$work/wrk.lua" "$URL" > "$work/wrk.txt" 2> "$work/wrk.err"
t1=$(date +%s.%N)
done_at_end=$(count completed)
grep -q '^non-202 answers: 0$' "$work/wrk.err" || { cat "$work/wrk.err" >&2; exit 1; }
if grep -q 'Non-2xx\|Socket errors' "$work/wrk.txt"; then cat "$work/wrk.txt" >&2; exit 1; fi
accepted=$(($(count "") - before_total))
while :; do
  open=$(($(count pending) + $(count running)))
  ((open == 0)) && break
  if (($(date +%s) - ${t1%.*} > DRAIN_LIMIT_SECS)); then
    echo "$open traces still open after ${DRAIN_LIMIT_SECS} s" >&2
    exit 1
  fi
  sleep 0.2
done
t2=$(date +%s.%N)
cpu1=$(cpu)
failed=$(count failed)
((failed == 0)) || { echo "$failed traces failed" >&2; exit 1; }
python3 - "$work/wrk.txt" "$accepted" "$done_at_end" "$before_total" "$t0" "$t1" "$t2" "$cpu0" "$cpu1" "$TICK" <<'PY'
import re, sys
wrk, accepted, done_end, before, t0, t1, t2, c0, c1, tick = sys.argv[1:]
text = open(wrk).read()
rps = float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))
p99 = re.search(r"99%\s+(\S+)", text).group(1)
accepted, done_end, before = int(accepted), int(done_end), int(before)
load, drain = float(t1) - float(t0), float(t2) - float(t1)
during = done_end - before
cpu_us = (int(c1) - int(c0)) / int(tick) / accepted * 1e6
print(f"accepted {accepted} submissions in {load:.1f} s: {rps:,.0f}/s (p99 {p99})")
print(f"finished during the load: {during} ({during / load:,.0f}/s); "
      f"the other {accepted - during} in {drain:.1f} s after it ({(accepted - during) / max(drain, 1e-9):,.0f}/s)")
print(f"sustained: {accepted / (load + drain):,.0f} traces/s; service CPU {cpu_us:.0f} us per trace")
PY
