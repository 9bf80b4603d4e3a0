#!/usr/bin/env bash
# The profile-guided (PGO) build of the service, for deployments and for the
# load benchmark (docs/benchmarks.md, docs/deployment.md):
#
#   bash scripts/pgo-build.sh     # prints the two binaries' paths at the end
#
# 1. builds the service and the echo helper (examples/echo.rs) instrumented
#    (`-Cprofile-generate`) in their own target directory (RUSTFLAGS differ,
#    so the ordinary build's cache is left alone);
# 2. trains them: the service on SQLite with the reference workflow and the
#    composition example, a mix of other traffic (benches/load/train.py:
#    other orders, refusals, admin reads) and then wrk on the reference
#    order; the echo with wrk on the same body. Each server is stopped with
#    SIGTERM, which writes its profile;
# 3. merges the profiles with llvm-profdata of rustc's own LLVM version
#    (Debian's `llvm-N`, installed with apt-get when missing) and builds both
#    again with `-Cprofile-use`.
#
# Both binaries are built the same way, so the benchmark still compares like
# with like. Needs what run.sh needs (wrk, python3, curl, taskset).
set -euo pipefail
cd "$(dirname "$0")/.."
. benches/load/reference.sh
TARGET="${CARGO_TARGET_DIR:-target}"
PROFILE="${PGO_CARGO_PROFILE:-release}"
TRAIN_SECS="${PGO_TRAIN_SECS:-5}"
PORT="${PGO_PORT:-18097}"
ECHO_PORT=$((PORT + 1))

llvm=$(rustc -vV | sed -n 's/^LLVM version: \([0-9]*\).*/\1/p')
sudo=""
[[ "$(id -u)" == 0 ]] || sudo="sudo -n"
export DEBIAN_FRONTEND=noninteractive
profdata="$(command -v "llvm-profdata-$llvm" || true)"
if [[ -z "$profdata" ]]; then
  echo "installing llvm-$llvm for llvm-profdata (apt-get install llvm-$llvm)"
  $sudo apt-get install -y -q "llvm-$llvm" >/dev/null 2>&1 ||
    { $sudo apt-get update -q >/dev/null 2>&1 && $sudo apt-get install -y -q "llvm-$llvm" >/dev/null; }
  profdata="$(command -v "llvm-profdata-$llvm")"
fi
command -v wrk >/dev/null || { echo "wrk is required: apt-get install -y wrk" >&2; exit 2; }

work="$(mktemp -d)"
cleanup() {
  kill "${SLUICE_PID:-}" "${ECHO_PID:-}" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
mkdir -p "$work/raw" "$work/cli"

echo "== instrumented build ($PROFILE, $TARGET/pgo-gen)"
# The flag's directory is fixed, so a second run reuses this build; where the
# profiles go is set per run (LLVM_PROFILE_FILE).
mkdir -p "$TARGET/pgo-gen"
RUSTFLAGS="${RUSTFLAGS:-} -Cprofile-generate=$(cd "$TARGET/pgo-gen" && pwd)/profiles" \
  cargo build -q --profile "$PROFILE" --target-dir "$TARGET/pgo-gen" --bin sluice --example echo
dir="$PROFILE"
[[ "$PROFILE" == dev ]] && dir=debug
gen="$TARGET/pgo-gen/$dir"

# load URL: wrk on the reference body; a profile of errors is a wrong
# profile, so any error or non-2xx answer fails the build.
load() {
  local out
  out="$(SLUICE_REQUEST="$REF/request.json" taskset -c 1 wrk -t1 -c64 -d"${TRAIN_SECS}s" \
    -s benches/load/post.lua "$1")"
  grep -E "requests in" <<< "$out"
  if grep -qE "Non-2xx|Socket errors" <<< "$out"; then
    echo "$out" >&2
    echo "training load on $1 answered errors" >&2
    return 1
  fi
}

# train SLUICE ECHO: the servers on the training traffic, then SIGTERM (an
# instrumented binary writes its profile when it exits).
train() {
  local sluice=$1 echo=$2 db
  db="$(mktemp -d -p "$work")"
  LLVM_PROFILE_FILE="$work/raw/sluice-%p-%m.profraw" SERVICE_SERVER__PORT=$PORT \
    SERVICE_STORAGE__URL="sqlite://$db/train.db" SERVICE_LOGGING__LEVEL=error \
    SERVICE_STORAGE__BACKUP_DIR="$db/backups" taskset -c 0 "$sluice" serve > "$db/sluice.log" 2>&1 &
  SLUICE_PID=$!
  LLVM_PROFILE_FILE="$work/raw/echo-%p-%m.profraw" taskset -c 0 "$echo" "127.0.0.1:$ECHO_PORT" > /dev/null 2>&1 &
  ECHO_PID=$!
  for _ in $(seq 100); do curl -sf "127.0.0.1:$PORT/readyz" >/dev/null && break; sleep 0.1; done
  local admin="http://127.0.0.1:$PORT/api/v1/admin"
  create_reference "$admin" "$REF"
  # The command line's own profile is not the service's: kept apart.
  LLVM_PROFILE_FILE="$work/cli/apply-%p.profraw" "$gen/sluice" apply \
    --server "http://127.0.0.1:$PORT" examples/composition-canary > /dev/null
  python3 benches/load/train.py "http://127.0.0.1:$PORT" "$REF" 200
  load "http://127.0.0.1:$PORT/api/v1/data/bench/orders/ord-7f3a9c"
  load "http://127.0.0.1:$ECHO_PORT/"
  kill -TERM "$SLUICE_PID" "$ECHO_PID"
  wait "$SLUICE_PID" "$ECHO_PID" || true
  SLUICE_PID="" ECHO_PID=""
}

echo "== training"
train "$gen/sluice" "$gen/examples/echo"
ls "$work"/raw/sluice-*.profraw "$work"/raw/echo-*.profraw > /dev/null ||
  { echo "a trained server wrote no profile" >&2; exit 1; }
"$profdata" merge -o "$work/merged.profdata" "$work"/raw/*.profraw

echo "== optimised build ($PROFILE, $TARGET/pgo)"
# Named by its digest: a new profile changes the flags, so cargo rebuilds
# every crate with it (the flags are all cargo compares).
mkdir -p "$TARGET/pgo/profiles"
profile="$(cd "$TARGET/pgo/profiles" && pwd)/$(sha256sum "$work/merged.profdata" | cut -c1-16).profdata"
cp "$work/merged.profdata" "$profile"
RUSTFLAGS="${RUSTFLAGS:-} -Cprofile-use=$profile" \
  cargo build -q --profile "$PROFILE" --target-dir "$TARGET/pgo" --bin sluice --example echo
echo "$TARGET/pgo/$dir/sluice"
echo "$TARGET/pgo/$dir/examples/echo"
