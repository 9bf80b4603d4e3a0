#!/usr/bin/env bash
# Architecture invariant: the compiler and runtime crates do no I/O. They must
# not depend (normal dependencies, any depth) on an async runtime's networking,
# an HTTP stack, a database driver or a client crate. Fails listing offenders.
set -euo pipefail
cd "$(dirname "$0")/.."
forbidden='^(tokio|hyper|hyper-util|h2|mio|socket2|sqlx|sqlx-core|reqwest|rdkafka|redis|mongodb|tonic|axum)$'
status=0
for crate in sluice-compiler sluice-runtime; do
  deps=$(cargo tree -q -p "$crate" -e normal --prefix none --format '{p}' | awk '{print $1}' | sort -u)
  bad=$(grep -E "$forbidden" <<<"$deps" || true)
  if [ -n "$bad" ]; then
    echo "check-core-deps: $crate depends on forbidden crates: $(tr '\n' ' ' <<<"$bad")" >&2
    status=1
  else
    echo "check-core-deps: $crate ok ($(wc -l <<<"$deps") crates, none forbidden)"
  fi
done
exit $status
