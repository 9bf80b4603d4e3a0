# Sourced by the load scripts (from the repository root): where the
# reference workload is (REF, in ../shared/bench/reference/ unless
# SLUICE_SHARED_DIR says otherwise), and create_reference, which creates its
# workflow and channel through a running server's admin API and activates
# both.
SHARED="${SLUICE_SHARED_DIR:-$(cd .. && pwd)/shared}"
REF="$SHARED/bench/reference"
#
#   create_reference ADMIN_URL REF_DIR
create_reference() {
  local admin=$1 ref=$2
  _reference_call() { curl -sf -X "$1" "$admin$2" -H 'Content-Type: application/json' -d "$3" >/dev/null; }
  _reference_call POST /workflows "@$ref/workflow.json"
  _reference_call PATCH /workflows/bench-order-enrichment/status '{"status": "active"}'
  _reference_call POST /channels "@$ref/channel.json"
  _reference_call PATCH /channels/bench-orders/status '{"status": "active"}'
}
