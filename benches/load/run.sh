#!/usr/bin/env bash
# The load benchmark (docs/benchmarks.md): Sluice on the reference workload
# against a bare hyper echo server, measured alternately in one run with the
# same wrk settings; server pinned to core 0, generator to core 1.
#
#   bash benches/load/run.sh            # 3 rounds of 10 s each
#   ROUNDS=1 DURATION=5s bash benches/load/run.sh
#
# Needs wrk (apt-get install wrk), python3 and taskset. Fails if any request
# errors or answers non-2xx, or if the response differs from expected.json.
set -euo pipefail
cd "$(dirname "$0")/../.."
SHARED="${SLUICE_SHARED_DIR:-$(cd .. && pwd)/shared}"
REF="$SHARED/bench/reference"
ROUNDS="${ROUNDS:-3}"
DURATION="${DURATION:-10s}"
CONNECTIONS="${CONNECTIONS:-64}"
SLUICE_PORT=18080
ECHO_PORT=18081
command -v wrk >/dev/null || { echo "wrk is required: apt-get install -y wrk" >&2; exit 2; }

cargo build --release -q --bin sluice --example echo
TARGET="${CARGO_TARGET_DIR:-target}"
work="$(mktemp -d)"
cleanup() { kill "${SLUICE_PID:-}" "${ECHO_PID:-}" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

SERVICE_SERVER__PORT=$SLUICE_PORT SERVICE_STORAGE__URL="sqlite://$work/bench.db" \
  SERVICE_LOGGING__LEVEL=warn SERVICE_STORAGE__BACKUP_DIR="$work/backups" \
  taskset -c 0 "$TARGET/release/sluice" serve > "$work/sluice.log" 2>&1 &
SLUICE_PID=$!
taskset -c 0 "$TARGET/release/examples/echo" "127.0.0.1:$ECHO_PORT" > "$work/echo.log" 2>&1 &
ECHO_PID=$!
for _ in $(seq 100); do curl -sf "127.0.0.1:$SLUICE_PORT/readyz" >/dev/null && break; sleep 0.1; done

admin="http://127.0.0.1:$SLUICE_PORT/api/v1/admin"
post() { curl -sf -X "$1" "$admin$2" -H 'Content-Type: application/json' -d "$3" >/dev/null; }
post POST /workflows "@$REF/workflow.json"
post PATCH /workflows/bench-order-enrichment/status '{"status": "active"}'
post POST /channels "@$REF/channel.json"
post PATCH /channels/bench-orders/status '{"status": "active"}'

SLUICE_URL="http://127.0.0.1:$SLUICE_PORT/api/v1/data/bench/orders/ord-7f3a9c"
ECHO_URL="http://127.0.0.1:$ECHO_PORT/"
curl -sf -X POST "$SLUICE_URL" -H 'Content-Type: application/json' -d "@$REF/request.json" > "$work/response.json"
python3 - "$work/response.json" "$REF/expected.json" <<'PY'
import json, sys
got = json.load(open(sys.argv[1]))["data"]["order"]
want = json.load(open(sys.argv[2]))
def holds(w, g):
    if isinstance(w, dict):
        return isinstance(g, dict) and all(k in g and holds(v, g[k]) for k, v in w.items())
    if isinstance(w, (int, float)) and not isinstance(w, bool):
        return isinstance(g, (int, float)) and abs(w - g) < 1e-6
    return w == g
bad = [k for k, v in want.items() if not holds(v, got.get(k))]
if bad:
    sys.exit(f"response differs from expected.json on: {bad}")
print("response matches expected.json")
PY

run_wrk() { # name url
  SLUICE_REQUEST="$REF/request.json" taskset -c 1 wrk -t1 -c"$CONNECTIONS" -d"$DURATION" --latency \
    -s benches/load/post.lua "$2" > "$work/$1.txt" 2>&1
  python3 - "$work/$1.txt" "$1" >> "$work/results.tsv" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
def unit(v, u):
    return float(v) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[u]
rps = float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))
p50 = unit(*re.search(r"50%\s+([\d.]+)(us|ms|s)", text).groups())
p99 = unit(*re.search(r"99%\s+([\d.]+)(us|ms|s)", text).groups())
errors = sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", text))
non2xx = int((re.search(r"Non-2xx or 3xx responses: (\d+)", text) or [0, 0])[1])
total = int(re.search(r"(\d+) requests in", text).group(1))
print(f"{sys.argv[2]}\t{rps}\t{p50}\t{p99}\t{errors + non2xx}\t{total}")
PY
}

: > "$work/results.tsv"
for round in $(seq "$ROUNDS"); do
  run_wrk sluice "$SLUICE_URL"
  run_wrk echo "$ECHO_URL"
done
peak=$(awk '/VmHWM/ {print $2}' "/proc/$SLUICE_PID/status")
rss=$(awk '/VmRSS/ {print $2}' "/proc/$SLUICE_PID/status")

python3 - "$work/results.tsv" "$peak" "$rss" <<'PY'
import statistics, sys
rows = [l.split("\t") for l in open(sys.argv[1]).read().splitlines()]
by = {"sluice": [], "echo": []}
for name, rps, p50, p99, errors, total in rows:
    by[name].append((float(rps), float(p50), float(p99), int(errors), int(total)))
print(f"{'server':8} {'round':>5} {'req/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6}")
for name in ("sluice", "echo"):
    for i, (rps, p50, p99, errors, _) in enumerate(by[name], 1):
        print(f"{name:8} {i:>5} {rps:>10.0f} {p50:>8.3f} {p99:>8.3f} {errors:>6}")
med = {n: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v), statistics.median(r[2] for r in v)) for n, v in by.items()}
print(f"median   sluice {med['sluice'][0]:.0f} req/s p50 {med['sluice'][1]:.3f} ms p99 {med['sluice'][2]:.3f} ms")
print(f"median   echo   {med['echo'][0]:.0f} req/s p50 {med['echo'][1]:.3f} ms p99 {med['echo'][2]:.3f} ms")
print(f"ratio sluice/echo: throughput {med['sluice'][0] / med['echo'][0]:.3f}, p99 {med['sluice'][2] / med['echo'][2]:.2f}x")
served = sum(r[4] for r in by["sluice"])
print(f"sluice RSS: peak {int(sys.argv[2]) / 1024:.1f} MiB, now {int(sys.argv[3]) / 1024:.1f} MiB after {served} requests")
errors = sum(r[3] for v in by.values() for r in v)
if errors:
    sys.exit(f"{errors} requests errored or answered non-2xx: the run is invalid")
PY
