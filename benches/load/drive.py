#!/usr/bin/env python3
"""Sends exactly N requests over keep-alive connections and checks each answer.

    drive.py URL BODY_FILE N [CONNECTIONS]

Used by benches/load/callgrind.sh (instructions per request) and by the
smoke mode's correctness checks; exits non-zero on any non-2xx answer.
"""
import http.client
import sys
import urllib.parse

url, body_file, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
conns = int(sys.argv[4]) if len(sys.argv) > 4 else 1
u = urllib.parse.urlsplit(url)
body = open(body_file, "rb").read()
pool = [http.client.HTTPConnection(u.hostname, u.port) for _ in range(conns)]
path = u.path + (("?" + u.query) if u.query else "")
headers = {"Content-Type": "application/json"}
for i in range(n):
    c = pool[i % conns]
    c.request("POST", path, body=body, headers=headers)
    r = c.getresponse()
    data = r.read()
    if r.status // 100 != 2:
        sys.exit(f"request {i}: status {r.status}: {data[:200]!r}")
