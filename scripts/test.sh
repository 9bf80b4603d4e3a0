#!/usr/bin/env bash
# The whole test suite, as the README gives it and .ci/run runs it. Starts
# (idempotently) whatever servers the tests need, then runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
# The suite builds the benchmarks (to prove they compile) and runs the load
# script's 1 s smoke mode, neither of which measures anything: build them
# without LTO and debug info, in more codegen units (a shorter optimised
# build on a cold CI run). `cargo bench` and
# `bash benches/load/run.sh` outside this script use the real profile.
export CARGO_PROFILE_RELEASE_LTO="${CARGO_PROFILE_RELEASE_LTO:-false}"
export CARGO_PROFILE_RELEASE_CODEGEN_UNITS="${CARGO_PROFILE_RELEASE_CODEGEN_UNITS:-16}"
export CARGO_PROFILE_RELEASE_DEBUG="${CARGO_PROFILE_RELEASE_DEBUG:-false}"
# Servers for storage and connector tests are started here as those tests
# arrive (see ../shared/services/README.md); the engine core needs none.
# Storage tests run against real PostgreSQL and MariaDB and fail without them.
bash ../shared/services/postgres.sh
bash ../shared/services/mariadb.sh
# Connector client tests: Redis (cache), a MongoDB-compatible server and a
# Kafka-compatible broker (publish_kafka, Kafka channels).
bash ../shared/services/redis.sh
bash ../shared/services/mongodb.sh
bash ../shared/services/kafka.sh
# Each storage and service test makes its own database (and SQLite file);
# the service tests leave theirs behind. Those made more than six hours ago
# are dropped here, before this run makes more (a run going on beside this
# one on the same servers keeps its own): on a machine that runs the suite
# again and again they filled the disk (1,100 databases, 8.6 GB in
# PostgreSQL). A drop that fails is said and passed over.
if command -v psql >/dev/null; then
  psql -h 127.0.0.1 -U postgres -Atc "SELECT datname FROM pg_database WHERE datname LIKE 'sluice\_t%'
      AND (pg_stat_file('base/' || oid || '/PG_VERSION')).modification < now() - interval '6 hours'" test |
    while read -r db; do
      psql -h 127.0.0.1 -U postgres -qc "DROP DATABASE IF EXISTS \"$db\"" test || true
    done
fi
if command -v mysql >/dev/null; then
  mysql -h 127.0.0.1 -u root -N -e "SELECT table_schema FROM information_schema.tables
      WHERE table_schema LIKE 'sluice\_t%' GROUP BY table_schema
      HAVING MIN(create_time) < NOW() - INTERVAL 6 HOUR" |
    while read -r db; do
      mysql -h 127.0.0.1 -u root -e "DROP DATABASE IF EXISTS \`$db\`" || true
    done
fi
find "${TMPDIR:-/tmp}/sluice-tests" -maxdepth 1 -type f -mmin +360 -delete 2>/dev/null || true
cargo test --workspace --all-targets
# Every worked example's test file, through the real binary.
cargo run -q --bin sluice -- test examples/
# The JSONLogic conformance counts, printed (they are asserted above too).
cargo test -q -p sluice-compiler --test jsonlogic_conformance -- --nocapture --test-threads 1 2>&1 | grep -E "passed$"
cargo test --workspace --doc
# Benchmarks always compile; the load benchmark runs in its smoke mode (1 s,
# every response checked against the reference's expected.json).
cargo bench --workspace --no-run
bash benches/load/run.sh --smoke
# The async benchmark's smoke (1 s of submissions on SQLite; every answer
# 202, every trace completed, one result checked).
bash benches/load/async.sh --smoke
