#!/usr/bin/env bash
# The load benchmark (docs/benchmarks.md): Sluice on the reference workload
# against a bare hyper echo server, measured alternately in one run with the
# same wrk settings; servers pinned to core 0, the generator to core 1. Then
# memory after at least 1,000,000 requests, and engine reloads with 1,000
# active workflows: their duration, and request latency while they run.
#
#   bash benches/load/run.sh            # 3 rounds of 10 s each, 1,000 workflows reloaded
#   ROUNDS=1 DURATION=5s RELOAD_WORKFLOWS=100 bash benches/load/run.sh
#   bash benches/load/run.sh --smoke    # CI: 1 round of 1 s, every response checked
#   PGO=1 bash benches/load/run.sh      # both servers built profile-guided first
#
# Needs wrk (installed with apt-get when missing), python3, curl and taskset.
# Fails if any request errors or answers non-2xx, or if the response differs
# from expected.json. The smoke mode also compares every response of the
# rounds byte for byte with the checked one, and runs the reload part with
# 20 workflows; without wrk (only if it cannot be installed) it says so and
# checks correctness with 200 plain requests instead.
set -euo pipefail
cd "$(dirname "$0")/../.."
. benches/load/reference.sh
SMOKE=0
[[ "${1:-}" == "--smoke" ]] && SMOKE=1
if ((SMOKE)); then
  ROUNDS="${ROUNDS:-1}" DURATION="${DURATION:-1s}" RELOAD_WORKFLOWS="${RELOAD_WORKFLOWS:-20}"
  MIN_REQUESTS=0
else
  ROUNDS="${ROUNDS:-3}" DURATION="${DURATION:-10s}" RELOAD_WORKFLOWS="${RELOAD_WORKFLOWS:-1000}"
  MIN_REQUESTS="${MIN_REQUESTS:-1000000}"
fi
CONNECTIONS="${CONNECTIONS:-64}"
SLUICE_PORT="${SLUICE_PORT:-18080}"
ECHO_PORT="${ECHO_PORT:-18081}"

# wrk from the distribution's packages, installed when missing.
have_wrk() { command -v wrk >/dev/null 2>&1; }
if ! have_wrk && command -v apt-get >/dev/null 2>&1; then
  sudo=""
  [[ "$(id -u)" == 0 ]] || sudo="sudo -n"
  echo "installing wrk (apt-get install wrk)"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get install -y -q wrk >/dev/null 2>&1 ||
    { $sudo apt-get update -q >/dev/null 2>&1 && $sudo apt-get install -y -q wrk >/dev/null 2>&1; } || true
fi
if ! have_wrk; then
  if ((SMOKE)); then
    echo "SKIPPING the wrk rounds: wrk is not installed and apt-get could not install it;" \
      "checking correctness with plain requests only" >&2
  else
    echo "wrk is required and could not be installed: apt-get install -y wrk" >&2
    exit 2
  fi
fi

# SLUICE_BIN and ECHO_BIN run given binaries instead (A/B comparisons);
# PGO=1 builds both profile-guided first (scripts/pgo-build.sh).
if [[ "${PGO:-0}" == 1 && -z "${SLUICE_BIN:-}" ]]; then
  # Its last two lines name the binaries; a failed build stops the run here
  # (it must not fall back to measuring the ordinary build).
  pgo_out="$(bash scripts/pgo-build.sh)"
  SLUICE_BIN="$(tail -n 2 <<< "$pgo_out" | head -n 1)" ECHO_BIN="$(tail -n 1 <<< "$pgo_out")"
fi
if [[ -z "${SLUICE_BIN:-}" || -z "${ECHO_BIN:-}" ]]; then
  cargo build --release -q --bin sluice --example echo
fi
TARGET="${CARGO_TARGET_DIR:-target}"
SLUICE_BIN="${SLUICE_BIN:-$TARGET/release/sluice}"
ECHO_BIN="${ECHO_BIN:-$TARGET/release/examples/echo}"
work="$(mktemp -d)"
cleanup() {
  local rc=$?
  if ((rc != 0)) && [[ -s "$work/sluice.log" ]]; then
    echo "--- last lines of the service log:" >&2
    tail -n 20 "$work/sluice.log" >&2
  fi
  kill "${SLUICE_PID:-}" "${ECHO_PID:-}" "${LOOP_PID:-}" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

SERVICE_SERVER__PORT=$SLUICE_PORT SERVICE_STORAGE__URL="sqlite://$work/bench.db" \
  SERVICE_LOGGING__LEVEL=warn SERVICE_STORAGE__BACKUP_DIR="$work/backups" \
  taskset -c 0 "$SLUICE_BIN" serve > "$work/sluice.log" 2>&1 &
SLUICE_PID=$!
taskset -c 0 "$ECHO_BIN" "127.0.0.1:$ECHO_PORT" > "$work/echo.log" 2>&1 &
ECHO_PID=$!
for _ in $(seq 100); do curl -sf "127.0.0.1:$SLUICE_PORT/readyz" >/dev/null && break; sleep 0.1; done

admin="http://127.0.0.1:$SLUICE_PORT/api/v1/admin"
create_reference "$admin" "$REF"

SLUICE_URL="http://127.0.0.1:$SLUICE_PORT/api/v1/data/bench/orders/ord-7f3a9c"
ECHO_URL="http://127.0.0.1:$ECHO_PORT/"
curl -sf -X POST "$SLUICE_URL" -H 'Content-Type: application/json' --data-binary "@$REF/request.json" > "$work/response.json"
python3 benches/load/expected.py "$work/response.json" "$REF/expected.json" response
# The echo answers with the request body itself.
curl -sf -X POST "$ECHO_URL" -H 'Content-Type: application/json' --data-binary "@$REF/request.json" > "$work/echo.json"
cmp -s "$work/echo.json" "$REF/request.json" || { echo "the echo server does not echo the body" >&2; exit 1; }

if ! have_wrk; then
  python3 benches/load/drive.py "$SLUICE_URL" "$REF/request.json" 200 4
  echo "200 plain requests answered 2xx (wrk rounds skipped)"
  exit 0
fi

rss_kib() { awk "/$1/ {print \$2}" "/proc/$SLUICE_PID/status"; }

# utime and stime of a process in clock ticks (/proc/PID/stat fields 14, 15).
cpu_ticks() { awk '{print $14 "," $15}' "/proc/$1/stat"; }
TICK=$(getconf CLK_TCK)

run_wrk() { # name url [wrk duration]
  local script=benches/load/post.lua expect
  if ((SMOKE)); then
    script=benches/load/check.lua
    expect="$work/response.json"
    [[ "$1" == echo* ]] && expect="$REF/request.json"
  fi
  # The server's CPU time (all threads, user and kernel) over the round.
  local pid=$SLUICE_PID
  [[ "$1" == echo* ]] && pid=$ECHO_PID
  local before after
  before=$(cpu_ticks "$pid")
  SLUICE_REQUEST="$REF/request.json" SLUICE_EXPECT="${expect:-}" taskset -c 1 \
    wrk -t1 -c"$CONNECTIONS" -d"${3:-$DURATION}" --latency -s "$script" "$2" > "$work/$1.txt" 2>&1
  after=$(cpu_ticks "$pid")
  echo "cpu ${before} ${after}" >> "$work/$1.txt"
  python3 - "$work/$1.txt" "$1" >> "$work/results.tsv" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
def unit(v, u):
    return float(v) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[u]
rps = float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))
p50 = unit(*re.search(r"50%\s+([\d.]+)(us|ms|s)", text).groups())
p99 = unit(*re.search(r"99%\s+([\d.]+)(us|ms|s)", text).groups())
mx = unit(*re.search(r"Latency\s+\S+\s+\S+\s+([\d.]+)(us|ms|s)", text).groups())
errors = sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", text))
non2xx = int((re.search(r"Non-2xx or 3xx responses: (\d+)", text) or [0, 0])[1])
differ = re.search(r"checked (\d+) responses, (\d+) differ", text)
if differ:
    print(f"{sys.argv[2]}: checked {differ[1]} responses, {differ[2]} differ", file=sys.stderr)
    errors += int(differ[2])
total = int(re.search(r"(\d+) requests in", text).group(1))
u0, s0, u1, s1 = (int(x) for x in re.search(r"cpu (\d+),(\d+) (\d+),(\d+)", text).groups())
print(f"{sys.argv[2]}\t{rps}\t{p50}\t{p99}\t{mx}\t{errors + non2xx}\t{total}\t{u1 - u0}\t{s1 - s0}")
PY
}

: > "$work/results.tsv"
for round in $(seq "$ROUNDS"); do
  run_wrk sluice "$SLUICE_URL"
  [[ $round == 1 ]] && rss_warm=$(rss_kib VmRSS)
  run_wrk echo "$ECHO_URL"
done
# Memory after at least MIN_REQUESTS requests: top up with more load if the
# rounds served fewer (not part of the throughput figures).
served=$(awk -F'\t' '$1 == "sluice" {n += $7} END {print n + 0}' "$work/results.tsv")
if ((served < MIN_REQUESTS)); then
  rate=$(awk -F'\t' '$1 == "sluice" {r = $2} END {print int(r) + 1}' "$work/results.tsv")
  secs=$(( (MIN_REQUESTS - served) * 12 / 10 / rate + 1 ))
  run_wrk sluice-topup "$SLUICE_URL" "${secs}s"
  served=$(awk -F'\t' '$1 ~ /^sluice/ {n += $7} END {print n + 0}' "$work/results.tsv")
fi
peak=$(rss_kib VmHWM)
rss=$(rss_kib VmRSS)

# The smoke mode also sends the profile-guided build's training mix
# (scripts/pgo-build.sh), so a change of the API that the mix no longer
# matches fails here and not only in a PGO build.
if ((SMOKE)); then
  "$SLUICE_BIN" apply --server "http://127.0.0.1:$SLUICE_PORT" examples/composition-canary > /dev/null
  python3 benches/load/train.py "http://127.0.0.1:$SLUICE_PORT" "$REF" 2
fi

# Reloads: RELOAD_WORKFLOWS more active workflows and channels, the time of
# a reload (nothing changed, and after a lifecycle change), then the
# reference load again while both kinds of reload run back to back.
reload_report=""
if ((RELOAD_WORKFLOWS > 0)); then
  python3 benches/load/reload.py setup "$admin" "$REF" "$RELOAD_WORKFLOWS"
  reload_report=$(python3 benches/load/reload.py time "$admin" 5)
  secs=$(python3 -c "import re,sys; v,u=re.fullmatch(r'([\d.]+)(ms|s|m)','$DURATION').groups(); print(float(v)*{'ms':0.001,'s':1,'m':60}[u])")
  python3 benches/load/reload.py loop "$admin" "$secs" "$work/loop.txt" &
  LOOP_PID=$!
  run_wrk sluice-reloading "$SLUICE_URL"
  wait "$LOOP_PID"
  LOOP_PID=""
fi

python3 - "$work/results.tsv" "$peak" "$rss" "${rss_warm:-0}" "$served" "$reload_report" "$work/loop.txt" "$TICK" <<'PY'
import os, statistics, sys
rows = [l.split("\t") for l in open(sys.argv[1]).read().splitlines()]
by = {}
cpu = {}
for name, rps, p50, p99, mx, errors, total, user, kernel in rows:
    by.setdefault(name, []).append((float(rps), float(p50), float(p99), float(mx), int(errors), int(total)))
    c = cpu.setdefault(name, [0, 0, 0])
    c[0] += int(user); c[1] += int(kernel); c[2] += int(total)
print(f"{'server':8} {'round':>5} {'req/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'errors':>6}")
for name in ("sluice", "echo"):
    for i, (rps, p50, p99, mx, errors, _) in enumerate(by[name], 1):
        print(f"{name:8} {i:>5} {rps:>10.0f} {p50:>8.3f} {p99:>8.3f} {mx:>8.2f} {errors:>6}")
med = {n: tuple(statistics.median(r[i] for r in by[n]) for i in range(3)) for n in ("sluice", "echo")}
for n in ("sluice", "echo"):
    print(f"median   {n:6} {med[n][0]:.0f} req/s p50 {med[n][1]:.3f} ms p99 {med[n][2]:.3f} ms")
print(f"ratio sluice/echo: throughput {med['sluice'][0] / med['echo'][0]:.3f}, p99 {med['sluice'][2] / med['echo'][2]:.2f}x")
# Where each server's time goes: its own code (user) and the kernel's work
# for its sockets (system), per request, over all its rounds (clock ticks,
# so about ±1 % at these durations).
tick = int(sys.argv[8])
for n in ("sluice", "echo"):
    user, kernel, total = cpu[n]
    if total:
        us = lambda t: t / tick / total * 1e6
        print(f"{n} CPU per request: user {us(user):.2f} us, kernel {us(kernel):.2f} us")
mib = lambda kib: int(kib) / 1024
print(f"sluice RSS: peak {mib(sys.argv[2]):.1f} MiB; {mib(sys.argv[4]):.1f} MiB after the first round, "
      f"{mib(sys.argv[3]):.1f} MiB after {int(sys.argv[5]):,} requests")
if sys.argv[6]:
    print(sys.argv[6])
    rps, p50, p99, mx, _, total = by["sluice-reloading"][0]
    count, median_ms, max_ms = open(sys.argv[7]).read().split()
    normal = med["sluice"][2]
    print(f"under load while reloading ({count} reloads, {median_ms} ms each, median): {rps:.0f} req/s, "
          f"p99 {p99:.3f} ms, max {mx:.2f} ms = {mx / normal:.2f}x the normal p99 ({normal:.3f} ms)")
errors = sum(r[4] for v in by.values() for r in v)
if errors:
    sys.exit(f"{errors} requests errored, answered non-2xx or differed: the run is invalid")
PY
