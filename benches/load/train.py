#!/usr/bin/env python3
"""Training traffic for the profile-guided build (scripts/pgo-build.sh).

    train.py BASE_URL REFERENCE_DIR ROUNDS

Sends ROUNDS passes of a mix of requests a deployment sees besides the
reference order: other orders (gold and intl customers, a test order the
gate halts, one that fails validation, compact and pretty bodies, caller
request ids, query strings), the composition example (channel_call,
rollout keys), refused requests (malformed JSON, wrong media type, unknown
route, wrong method) and admin reads and validations. Every answer must have
the status listed for it; the run fails otherwise (a profile trained on
errors the mix did not mean to send would be a wrong profile).
"""
import copy
import http.client
import json
import sys
import urllib.parse

base, ref_dir, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
u = urllib.parse.urlsplit(base)
conn = http.client.HTTPConnection(u.hostname, u.port)

reference = json.load(open(f"{ref_dir}/request.json"))


def order(**changes):
    body = copy.deepcopy(reference)
    o = body["data"]
    for path, value in changes.items():
        *parents, last = path.split("__")
        target = o
        for p in parents:
            target = target[p]
        if value is None:
            del target[last]
        else:
            target[last] = value
    return body


JSON = {"Content-Type": "application/json"}
bench = "/api/v1/data/bench/orders/"
mix = [
    ("POST", bench + "ord-1", order(), JSON, 200),
    ("POST", bench + "ord-2", order(customer__lifetime_value=25000), JSON, 200),
    ("POST", bench + "ord-3", order(shipping__country="US"), JSON, 200),
    ("POST", bench + "ord-4", order(shipping__country="JP", customer__lifetime_value=50), JSON, 200),
    ("POST", bench + "ord-5?profile=0&src=web", order(test=True), JSON, 200),
    # A failed validation rule is an item of the answer's `errors` (200).
    ("POST", bench + "ord-6", order(customer__email=None), JSON, 200),
    ("POST", bench + "ord-7", order(items=[]), JSON, 200),
    (
        "POST",
        bench + "ord-8",
        order(items=[{"sku": f"S{i}", "name": "part", "price": 1.5 * i + 0.25, "qty": i % 4 + 1} for i in range(40)]),
        dict(JSON, **{"x-request-id": "0b6c3f0e-8d8e-4c5e-9a57-2f1f6d1f7c11"}),
        200,
    ),
    ("POST", bench + "ord-9", "compact", JSON, 200),
    ("POST", "/api/v1/data/checkout", {"data": {"customer": "c-1", "basket": {"items": [{"sku": "a", "price": 30, "qty": 2}]}}}, dict(JSON, **{"x-rollout-key": "a"}), 200),
    ("POST", "/api/v1/data/checkout", {"data": {"customer": "c-2", "basket": {"items": [{"sku": "b", "price": 12.5, "qty": 1}]}}}, dict(JSON, **{"x-rollout-key": "b"}), 200),
    ("POST", "/api/v1/data/pricing", {"data": {"items": [{"sku": "b", "price": 12.5, "qty": 3}]}}, JSON, 200),
    ("POST", bench + "bad", b'{"data": {"id": ', JSON, 400),
    ("POST", bench + "bad", b"<order/>", {"Content-Type": "application/xml"}, 415),
    ("GET", bench + "ord-1", None, {}, 405),
    ("POST", "/api/v1/data/no/such/route", order(), JSON, 404),
    ("GET", "/api/v1/admin/workflows", None, {}, 200),
    ("GET", "/api/v1/admin/workflows/bench-order-enrichment", None, {}, 200),
    ("GET", "/api/v1/admin/channels", None, {}, 200),
    ("POST", "/api/v1/admin/workflows/validate", {"tasks": [{"id": "a", "function": {"name": "http_call", "input": {"method": "FETCH"}}}]}, JSON, 400),
    ("GET", "/health", None, {}, 200),
    ("GET", "/metrics", None, {}, 200),
]

for r in range(rounds):
    for method, path, body, headers, want in mix:
        if body == "compact":
            data = json.dumps(reference, separators=(",", ":")).encode()
        elif isinstance(body, (dict, list)):
            data = json.dumps(body).encode()
        else:
            data = body
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        text = resp.read()
        # A wrong method may be answered 404 (no route for it) or 405.
        ok = resp.status == want or (want == 405 and resp.status == 404)
        if not ok:
            sys.exit(f"{method} {path}: {resp.status}, expected {want}: {text[:300]!r}")
print(f"training mix: {rounds} rounds of {len(mix)} requests answered as expected")
