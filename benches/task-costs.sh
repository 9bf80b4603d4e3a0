#!/usr/bin/env bash
# Instructions per execution of the in-process reference workload, task by
# task: the criterion bench binary runs the workflow cut to its first k
# tasks (SLUICE_BENCH_TASKS, k = 1..6) under callgrind, counting only
# `run_once`; each task's cost is the difference to the run before it. The
# first line (base) is the parse of the body, `parse_json`, the context and the
# serialization of the unchanged order.
#
#   bash benches/task-costs.sh            # N=1000 executions per count
set -euo pipefail
cd "$(dirname "$0")/.."
N="${N:-1000}"
command -v valgrind >/dev/null || { echo "valgrind is required: apt-get install -y valgrind" >&2; exit 2; }
bin=$(cargo bench --bench reference --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "reference" and m.get("executable"):
        print(m["executable"])')
names=(base totals pricing checks gate flags)
prev=0
for k in 1 2 3 4 5 6; do
  total=$(SLUICE_BENCH_TASKS=$k SLUICE_BENCH_PROFILE=$N valgrind --tool=callgrind \
    --toggle-collect='reference::run_once' --callgrind-out-file=/dev/null "$bin" 2>&1 \
    | awk '/Collected/ {gsub(",", "", $4); print $4}')
  per=$((total / (N + 1)))
  printf '%-8s %6d instructions (%d with the tasks before)\n' "${names[k-1]}" $((per - prev)) "$per"
  prev=$per
done
