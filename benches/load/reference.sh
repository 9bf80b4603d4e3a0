# Sourced by the load scripts: creates the reference workflow and channel
# (../shared/bench/reference/) through a running server's admin API and
# activates both.
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
