#!/usr/bin/env python3
"""Lighthouse speed (a benchmark, not a test): one quorum round and the heartbeat rate at 1,000 and 12,500 simulated
replica groups, measured in this run.

  in-process: the quorum logic the server runs (QuorumCore): every group asks, the quorum forms, every answer is
              built and JSON-encoded -- the lighthouse's own work per round, without the network.
  HTTP:       a real lighthouse process on loopback; all groups long-poll POST /v1/quorum concurrently from one
              aiohttp client process; round = first request sent -> last answer received. Heartbeats: POST
              /v1/heartbeat with 128 in flight. (The client shares the machine's cores with the lighthouse.)

    python -m hack.bench.bench_lighthouse [--groups 1000 12500] [--http-groups 1000 12500] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from ftjob import contract
from ftjob.lighthouse.core.quorum import QuorumCore

from tests.support.local_job import Lighthouse


def request(group: int, step: int, quorum_id: int) -> dict:
    return {
        "group": str(group),
        "incarnation": f"inc-{group}",
        "step": step,
        "quorum_id": quorum_id,
        "address": f"10.0.{group // 250}.{group % 250}:29520",
        "store_address": f"10.0.{group // 250}.{group % 250}:29530",
        "world_size": 1,
        "timeout_s": 120.0,
    }


def in_process(n: int, rounds: int) -> None:
    core = QuorumCore(min_replicas=1, join_timeout_s=1.0, heartbeat_timeout_s=60.0)
    now = 0.0
    for g in range(n):
        core.heartbeat(str(g), f"inc-{g}", 0, now)
    times = []
    qid = -1
    for step in range(rounds):
        t0 = time.perf_counter()
        for g in range(n):
            core.request(request(g, step, qid), now)
        formed = core.poll(now)
        assert formed is not None and len(formed.groups) == n
        encoded = sum(len(json.dumps(body)) for body in formed.responses.values())
        times.append(time.perf_counter() - t0)
        qid = formed.quorum_id
    t0 = time.perf_counter()
    beats = 0
    while time.perf_counter() - t0 < 1.0:
        for g in range(0, n, 7):
            core.heartbeat(str(g), f"inc-{g}", rounds, now)
            beats += 1
    rate = beats / (time.perf_counter() - t0)
    print(
        f"in-process {n:>6} groups: quorum round median {statistics.median(times):.3f}s max {max(times):.3f}s "
        f"(target <= 0.5s; {encoded / n:.0f} B per answer); heartbeats {rate:,.0f}/s",
        flush=True,
    )


async def http_round(url: str, token: str, n: int, rounds: int) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(headers=headers, connector=conn) as session:
        for g in range(n):  # register everyone first so the first round waits for all (as in a real job)
            async with session.post(
                url + contract.PATH_HEARTBEAT, json={"group": str(g), "incarnation": f"inc-{g}", "step": 0}
            ) as r:
                assert r.status == 200

        async def ask(g: int, step: int, qid: int) -> float:
            async with session.post(url + contract.PATH_QUORUM, json=request(g, step, qid)) as r:
                body = await r.json()
                assert r.status == 200, body
                return time.perf_counter()

        times = []
        qid = -1
        for step in range(rounds):
            t0 = time.perf_counter()
            done = await asyncio.gather(*(ask(g, step, qid) for g in range(n)))
            times.append(max(done) - t0)
            qid = 1
        sem = asyncio.Semaphore(128)
        beats = 0

        async def beat(g: int) -> None:
            nonlocal beats
            async with (
                sem,
                session.post(
                    url + contract.PATH_HEARTBEAT, json={"group": str(g), "incarnation": f"inc-{g}", "step": rounds}
                ) as r,
            ):
                assert r.status == 200
                beats += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(beat(g % n) for g in range(min(n, 5000))))
        rate = beats / (time.perf_counter() - t0)
    print(
        f"HTTP       {n:>6} groups: quorum round median {statistics.median(times):.3f}s max {max(times):.3f}s "
        f"(all {n} long-polls answered); heartbeats {rate:,.0f}/s over loopback",
        flush=True,
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, nargs="*", default=[1000, 12500])
    p.add_argument("--http-groups", type=int, nargs="*", default=[1000, 12500])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # one socket per simulated group
    for n in args.groups:
        in_process(n, args.rounds)
    if args.http_groups:
        with tempfile.TemporaryDirectory(prefix="bench-lighthouse-") as tmp:
            lh = Lighthouse(Path(tmp), "--min-replicas", "1", "--join-timeout", "30", "--heartbeat-timeout", "600")
            lh.start()
            try:
                for n in args.http_groups:
                    asyncio.run(http_round(lh.url, lh.token, n, args.rounds))
                    lh.kill()  # a fresh lighthouse per size: the previous groups would count as live
                    lh.start()
            finally:
                lh.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
