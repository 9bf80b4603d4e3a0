-- wrk script: POST the reference request body as JSON.
local f = assert(io.open(os.getenv("SLUICE_REQUEST") or "request.json", "r"))
wrk.method = "POST"
wrk.body = f:read("*a")
f:close()
wrk.headers["Content-Type"] = "application/json"
