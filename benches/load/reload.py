#!/usr/bin/env python3
"""The reload part of the load benchmark (docs/benchmarks.md).

    reload.py setup ADMIN_URL REF_DIR N   create N workflows (copies of the reference
                                          workflow) and N channels, activate all
    reload.py time ADMIN_URL ROUNDS       time POST /engine/reload (the median engine
                                          build and request time, ms), then a lifecycle
                                          change (a channel paused and resumed)
    reload.py loop ADMIN_URL SECONDS OUT  reload back to back for SECONDS (100 ms
                                          apart), in turn POST /engine/reload and a
                                          lifecycle change (a channel paused or
                                          resumed); writes "count median_ms max_ms" to OUT
    reload.py cpu ADMIN_URL PID N         N reloads back to back (after 5 to warm up);
                                          prints the CPU time per reload of each of the
                                          server's threads by name (/proc, Linux)
"""
import http.client
import json
import statistics
import sys
import time
import urllib.parse


def connect(admin):
    u = urllib.parse.urlsplit(admin)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=120), u.path


def call(conn, method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    text = r.read()
    if r.status // 100 != 2:
        sys.exit(f"{method} {path}: {r.status} {text[:300]!r}")
    return json.loads(text) if text else None


def setup(admin, ref, n):
    conn, base = connect(admin)
    workflow = json.load(open(f"{ref}/workflow.json"))
    channel = json.load(open(f"{ref}/channel.json"))
    wids = [f"reload-wf-{i:04d}" for i in range(n)]
    cids = [f"reload-ch-{i:04d}" for i in range(n)]
    flows = [dict(workflow, workflow_id=w, name=f"{workflow['name']} {i}") for i, w in enumerate(wids)]
    chans = [
        dict(channel, channel_id=c, name=c, workflow_id=w, route_pattern=f"/reload/{i:04d}/{{order_id}}")
        for i, (c, w) in enumerate(zip(cids, wids))
    ]
    started = time.monotonic()
    for kind, items in (("workflows", flows), ("channels", chans)):
        for at in range(0, len(items), 100):  # under the 1 MiB body limit
            out = call(conn, "POST", f"{base}/{kind}/import", items[at : at + 100])["data"]
            if out["failed"]:
                sys.exit(f"import of {kind} failed: {out['failed'][:3]}")
    # Each activation reloads the engine (reusing every unchanged plan).
    for kind, ids in (("workflows", wids), ("channels", cids)):
        for i in ids:
            call(conn, "PATCH", f"{base}/{kind}/{i}/status", {"status": "active"})
    print(f"created and activated {n} workflows and {n} channels in {time.monotonic() - started:.1f} s")


def reload_once(conn, base):
    t = time.monotonic()
    report = call(conn, "POST", f"{base}/engine/reload")["data"]
    return report, (time.monotonic() - t) * 1000


def time_reloads(admin, rounds):
    conn, base = connect(admin)
    builds, walls, report = [], [], None
    for _ in range(rounds):
        report, wall = reload_once(conn, base)
        builds.append(report["duration_ms"])
        walls.append(wall)
    print(
        f"reload of {report['active_workflows']} active workflows, {report['channels']} channels, nothing changed: "
        f"engine build {statistics.median(builds):.1f} ms, admin request {statistics.median(walls):.1f} ms "
        f"(medians of {rounds}; {report['compiled']} compiled, the rest reused)"
    )
    # A lifecycle change: pause and resume one channel; each answer comes
    # after the engine has been rebuilt around the changed row.
    changes = []
    for i in range(rounds):
        for status in ("paused", "active"):
            t = time.monotonic()
            call(conn, "PATCH", f"{base}/channels/reload-ch-0000/status", {"status": status})
            changes.append((time.monotonic() - t) * 1000)
    print(
        f"reload after a lifecycle change (one of the channels paused, then resumed): "
        f"admin request {statistics.median(changes):.1f} ms (median of {len(changes)}), "
        f"write and rebuilt engine included"
    )


def loop(admin, seconds, out):
    """Reloads of both kinds in turn: POST /engine/reload (nothing changed),
    then a lifecycle change (one channel paused or resumed, which rebuilds
    the engine around it)."""
    conn, base = connect(admin)
    end = time.monotonic() + seconds
    walls = []
    status = "paused"
    while time.monotonic() < end:
        if len(walls) % 2 == 0:
            walls.append(reload_once(conn, base)[1])
        else:
            t = time.monotonic()
            call(conn, "PATCH", f"{base}/channels/reload-ch-0001/status", {"status": status})
            walls.append((time.monotonic() - t) * 1000)
            status = "active" if status == "paused" else "paused"
        time.sleep(0.1)
    with open(out, "w") as f:
        f.write(f"{len(walls)} {statistics.median(walls):.1f} {max(walls):.1f}\n")


def thread_cpu(pid):
    """CPU ticks (user + system) per thread name of process `pid`; threads
    at background priority (SCHED_IDLE) are counted apart, as "name (idle)"."""
    import collections
    import os

    out = collections.Counter()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = open(f"/proc/{pid}/task/{tid}/stat").read()
        except FileNotFoundError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")].rstrip("0123456789-")
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[38] == "5":  # policy: SCHED_IDLE
            name += " (idle)"
        out[name] += int(fields[11]) + int(fields[12])
    return out


def cpu(admin, pid, n):
    import os

    conn, base = connect(admin)
    for _ in range(5):
        reload_once(conn, base)
    before = thread_cpu(pid)
    walls = [reload_once(conn, base)[1] for _ in range(n)]
    after = thread_cpu(pid)
    tick = os.sysconf("SC_CLK_TCK")
    print(f"{n} reloads, {statistics.median(walls):.1f} ms each (median); CPU per reload by thread"
          " (threads that ended, such as sluice-free, are not counted):")
    for name in sorted(set(before) | set(after)):
        ms = (after[name] - before[name]) * 1000 / tick / n
        if ms:
            print(f"  {name:24} {ms:7.2f} ms")


if __name__ == "__main__":
    cmd, admin = sys.argv[1], sys.argv[2]
    if cmd == "setup":
        setup(admin, sys.argv[3], int(sys.argv[4]))
    elif cmd == "time":
        time_reloads(admin, int(sys.argv[3]))
    elif cmd == "loop":
        loop(admin, float(sys.argv[3]), sys.argv[4])
    elif cmd == "cpu":
        cpu(admin, int(sys.argv[3]), int(sys.argv[4]))
    else:
        sys.exit(__doc__)
