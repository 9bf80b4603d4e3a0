#!/usr/bin/env bash
# Alternating A/B of several builds under the load benchmark's settings:
# every binary is started (pinned to core 0; Sluice binaries on SQLite with
# the reference workflow and channel, a binary named echo* as the echo
# server), then wrk (core 1, 64 connections) runs ROUNDS rounds of SECS
# seconds over them in turn. Each line is one round: requests/s, p99 and the
# server's CPU time (user + kernel) per request, per binary. Side-by-side
# rounds are the way to compare builds on a shared, noisy machine.
#
#   bash benches/load/ab.sh ROUNDS SECS BIN [BIN ...]
#   bash benches/load/ab.sh 4 5 old/sluice new/sluice target/release/examples/echo
set -euo pipefail
cd "$(dirname "$0")/../.."
. benches/load/reference.sh
(($# >= 3)) || { echo "usage: ab.sh ROUNDS SECS BIN [BIN ...]" >&2; exit 2; }
ROUNDS=$1 SECS=$2
shift 2
PORT="${PORT:-18200}"
TICK=$(getconf CLK_TCK)
work="$(mktemp -d)"
pids=() urls=()
cleanup() {
  kill "${pids[@]}" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

i=0
for bin in "$@"; do
  port=$((PORT + i))
  if [[ "$(basename "$bin")" == echo* ]]; then
    taskset -c 0 "$bin" "127.0.0.1:$port" > /dev/null 2>&1 &
    pids+=($!)
    urls+=("http://127.0.0.1:$port/")
  else
    SERVICE_SERVER__PORT=$port SERVICE_STORAGE__URL="sqlite://$work/$i.db" SERVICE_LOGGING__LEVEL=warn \
      SERVICE_STORAGE__BACKUP_DIR="$work/backups-$i" taskset -c 0 "$bin" serve > "$work/$i.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 100); do curl -sf "127.0.0.1:$port/readyz" >/dev/null && break; sleep 0.1; done
    admin="http://127.0.0.1:$port/api/v1/admin"
    create_reference "$admin" "$REF"
    urls+=("http://127.0.0.1:$port/api/v1/data/bench/orders/ord-7f3a9c")
  fi
  echo "[$i] $bin"
  i=$((i + 1))
done
for _ in $(seq 50); do curl -s -o /dev/null "${urls[0]}" && break; sleep 0.1; done

cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
user() { awk '{print $14}' "/proc/$1/stat"; }
for round in $(seq "$ROUNDS"); do
  line="round $round:"
  for j in "${!urls[@]}"; do
    before=$(cpu "${pids[$j]}") ubefore=$(user "${pids[$j]}")
    out=$(SLUICE_REQUEST="$REF/request.json" taskset -c 1 wrk -t1 -c64 -d"${SECS}s" --latency \
      -s benches/load/post.lua "${urls[$j]}")
    after=$(cpu "${pids[$j]}") uafter=$(user "${pids[$j]}")
    rps=$(awk '/Requests\/sec/ {printf "%d", $2}' <<< "$out")
    p99=$(awk '$1 == "99%" {print $2}' <<< "$out")
    n=$(grep -oE '^ *[0-9]+ requests in' <<< "$out" | awk '{print $1}')
    if grep -qE "Non-2xx|Socket errors" <<< "$out"; then
      echo "$out" >&2
      echo "[$j] answered errors: the run is invalid" >&2
      exit 1
    fi
    us=$(awk -v t="$((after - before))" -v n="$n" -v tick="$TICK" 'BEGIN {printf "%.2f", t / tick / n * 1e6}')
    uus=$(awk -v t="$((uafter - ubefore))" -v n="$n" -v tick="$TICK" 'BEGIN {printf "%.2f", t / tick / n * 1e6}')
    line="$line  [$j] $rps req/s p99 $p99 cpu ${us} us (user ${uus})"
  done
  echo "$line"
done
