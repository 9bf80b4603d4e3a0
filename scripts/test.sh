#!/usr/bin/env bash
# The whole test suite, as the README gives it and .ci/run runs it. Starts
# (idempotently) whatever servers the tests need, then runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
# Servers for storage and connector tests are started here as those tests
# arrive (see ../shared/services/README.md); the engine core needs none.
# Storage tests run against real PostgreSQL and MariaDB and fail without them.
bash ../shared/services/postgres.sh
bash ../shared/services/mariadb.sh
cargo test --workspace --all-targets
cargo test --workspace --doc
