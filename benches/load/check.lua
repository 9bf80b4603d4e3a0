-- wrk script for the smoke mode: POST the reference request body and check
-- every response body against the expected one (SLUICE_EXPECT: a file with
-- the exact bytes a correct answer has, request ids aside). done() prints the counts; run.sh
-- fails the run if any response differs.
local req = assert(io.open(os.getenv("SLUICE_REQUEST") or "request.json", "r"))
wrk.method = "POST"
wrk.body = req:read("*a")
req:close()
wrk.headers["Content-Type"] = "application/json"
local exp = assert(io.open(os.getenv("SLUICE_EXPECT"), "r"))
-- A response names its request id (a fresh UUID each time): compared
-- with the id blanked out.
local uuid = string.rep("%x", 8) .. "%-" .. string.rep("%x", 4) .. "%-" .. string.rep("%x", 4)
  .. "%-" .. string.rep("%x", 4) .. "%-" .. string.rep("%x", 12)
local function normal(body)
  return (string.gsub(body, uuid, "<uuid>"))
end
local expected = normal(exp:read("*a"))
exp:close()

local threads = {}
function setup(thread)
  table.insert(threads, thread)
end

function init(args)
  checked = 0
  differ = 0
end

function response(status, headers, body)
  checked = checked + 1
  if status ~= 200 or normal(body) ~= expected then
    differ = differ + 1
  end
end

function done(summary, latency, requests)
  local c, d = 0, 0
  for _, t in ipairs(threads) do
    c = c + t:get("checked")
    d = d + t:get("differ")
  end
  io.write(string.format("checked %d responses, %d differ\n", c, d))
end
