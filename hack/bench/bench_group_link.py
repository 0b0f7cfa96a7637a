#!/usr/bin/env python3
"""The abort latency the group link adds for ranks > 0 (a benchmark, not a test): rank 0's end of the link
(ftjob.ft.links.group_link.LinkServer) in this process, each other rank's end (LinkClient) in its own process, on
loopback.

Relay latency = from rank 0's lighthouse client thread forwarding an abort (LinkServer.forward, called the moment the
watch socket delivers it) to the rank's on_abort callback (which wakes its pending collective), both read from
CLOCK_MONOTONIC (one clock for every process of a machine). Measured for a group of 2 and of 8 ranks.

    python -m hack.bench.bench_group_link [--relays 100] [--ranks 2 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from ftjob.ft.links.group_link import LinkServer

TOKEN = "bench-token"

CHILD = """
import json, sys, threading, time
from ftjob.ft.links.group_link import LinkClient
address, rank, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
seen, done = {}, threading.Event()
def on_abort(below):
    seen[below] = time.monotonic_ns()
    if below == last:
        done.set()
link = LinkClient(address, sys.argv[4], rank, on_abort, lambda why: done.set())
print("ready", flush=True)
done.wait(120)
link.close()
print(json.dumps(seen), flush=True)
"""


def run(ranks: int, relays: int) -> list[float]:
    server = LinkServer(TOKEN, "127.0.0.1", ranks, lambda _p, _w: None, lambda why: print("lost:", why))
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, server.address, str(r), str(relays), TOKEN],
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(1, ranks)
    ]
    for c in children:
        assert c.stdout is not None and c.stdout.readline().strip() == "ready"
    server.wait_connected()
    sent: dict[int, int] = {}
    for i in range(1, relays + 1):
        sent[i] = time.monotonic_ns()
        server.forward(i)
        time.sleep(0.005)  # pacing between relays (a benchmark: each relay is measured alone)
    latencies_us: list[float] = []
    for c in children:
        out, _ = c.communicate(timeout=120)
        seen = json.loads(out.strip().splitlines()[-1])
        latencies_us += [(seen[str(i)] - sent[i]) / 1000 for i in range(1, relays + 1)]
    server.close()
    return latencies_us


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--relays", type=int, default=100)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 8])
    args = p.parse_args()
    print(f"abort relay rank 0 -> rank r>0 over the group link (loopback), {args.relays} relays per group size")
    for ranks in args.ranks:
        lat = sorted(run(ranks, args.relays))
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        print(
            f"group of {ranks} ranks: {len(lat)} deliveries: median {statistics.median(lat):.0f} us, "
            f"p99 {p99:.0f} us, max {lat[-1]:.0f} us"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
