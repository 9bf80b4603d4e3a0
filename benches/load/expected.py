"""Checks an answer's `data.order` against the reference's expected.json
(floating-point values to 1e-6), for the load scripts:

    python3 benches/load/expected.py ANSWER.json EXPECTED.json WHAT

ANSWER.json holds `{"data": {"order": ...}}`; WHAT names it in the message.
"""
import json
import sys


def holds(want, got):
    if isinstance(want, dict):
        return isinstance(got, dict) and all(k in got and holds(v, got[k]) for k, v in want.items())
    if isinstance(want, (int, float)) and not isinstance(want, bool):
        return isinstance(got, (int, float)) and abs(want - got) < 1e-6
    return want == got


answer, expected, what = sys.argv[1:4]
got = json.load(open(answer))["data"]["order"]
want = json.load(open(expected))
bad = [k for k, v in want.items() if not holds(v, got.get(k))]
if bad:
    sys.exit(f"{what} differs from expected.json on: {bad}")
print(f"{what} matches expected.json")
