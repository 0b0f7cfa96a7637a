#!/usr/bin/env python3
"""The lighthouse at scale (a benchmark, not a test): a real lighthouse process pinned to one core, and several
load-generator processes (pinned to the other cores) that open the sockets the trainer opens: one watch WebSocket
per replica group (rank 0's: the other ranks learn aborts through their group), heartbeats on it (as the client: one
after every period in which the group sent nothing, a quorum request counting as one), the link ping the client sends
(as aiohttp's client: after every max(2 s, 3 heartbeat periods) in which its socket received nothing), and one quorum
request per group per step with the trainer's own body (QuorumRequest as the Manager builds it, addresses sized by
--ranks). Between rounds a group fails -- alternately evicted by the operator's POST /v1/membership/evict and its
watch socket closed (a dead process) -- and joins again with a new incarnation.

  round:    first quorum request of the round sent -> last answer received (all processes, one monotonic clock);
            also the lighthouse's own CPU seconds in that round (what the round costs it, whatever the generators do),
            the generators' CPU in it (all on the other core(s): when near the round time, they bound it) and the
            heartbeats and link pings sent during it
  abort:    eviction (POST sent / socket closed) -> the abort signal received on every other group's watch socket
            (a rank > 0 gets it relayed by its rank 0 through the group: add well under a millisecond)
  heartbeats/s the lighthouse counted in a quiet window (and the link pings/s: no answers come then), its CPU
            (fraction of its one core) and max RSS (VmHWM)

--quorum-over http: POST /v1/quorum on a keep-alive connection per group (the trainer's client today: 2 sockets per
group, so at most ~9,000 groups fit the lighthouse's 20,000-descriptor limit here); ws: the request as a frame on
the group's watch socket (one connection per group). --profile FILE runs the lighthouse under cProfile.

    flock /var/tmp/ftjob-bench.lock python -m hack.bench.bench_controlplane --groups 12500 --ranks 8 --rounds 10
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import gc
import heapq
import json
import multiprocessing as mp
import os
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from ftjob import contract
from ftjob.contract.lighthouse_api import QuorumRequest
from ftjob.ft.links.watch_link import link_timing

from hack.bench.ws_lite import LiteSocket
from tests.support.polling import StopWaiting, wait_for

TOKEN = "bench-token"
OPERATOR_TOKEN = "bench-operator-token"  # the membership API's (the bench's evictions play the operator)
STEP_MARK, QID_MARK = 7_777_777_777_777, 8_888_888_888_888  # placeholders in a group's body template
# cProfile on CPU time (not wall time: on a shared machine the time the lighthouse waits for its core is no cost)
PROFILE = (
    "import cProfile,sys,time;from ftjob.lighthouse.cli import main;p=cProfile.Profile(time.process_time);"
    "p.runcall(main,sys.argv[2:]);p.dump_stats(sys.argv[1])"
)


def quorum_body(g: int, inc: str, step: int, qid: int, ranks: int) -> str:
    """The body the trainer's Manager sends (its _quorum_request, as LighthouseClient encodes it)."""
    host = f"10.{g // 62500}.{g // 250 % 250}.{g % 250}"
    addrs = [f"{host}:{29520 + r}" for r in range(ranks)]
    stores = [f"{host}:{29620 + r}" for r in range(ranks)]
    req = QuorumRequest(group=str(g), incarnation=inc, step=step, quorum_id=qid, address=addrs[0],
                        store_address=stores[0], addresses=addrs, store_addresses=stores, world_size=ranks,
                        timeout_s=120.0)  # fmt: skip
    return req.model_dump_json(exclude_none=True)


class Group:
    def __init__(self, g: int) -> None:
        self.g, self.inc, self.gen = g, f"inc-{g}-0", 0
        self.ws: LiteSocket | None = None
        self.abort_below, self.abort_at, self.step, self.qid = 0, 0.0, 0, -1
        self.told = 0.0  # when it last sent the lighthouse a frame that counts as a heartbeat
        self._template: tuple[str, str] | None = None  # (incarnation, its body with placeholders)
        self.answer: asyncio.Future[str] | None = None
        self.stream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    def body(self, ranks: int) -> str:
        """The trainer's quorum body (quorum_body), built by pydantic once per incarnation: only step and quorum id
        change between rounds (string replaces here, so the generators' core goes to the sockets)."""
        if self._template is None or self._template[0] != self.inc:
            self._template = (self.inc, quorum_body(self.g, self.inc, STEP_MARK, QID_MARK, ranks))
        return self._template[1].replace(str(STEP_MARK), str(self.step)).replace(str(QID_MARK), str(self.qid))


class Generator:
    """One load-generator process: its share of the groups, driven by the master's commands over a pipe."""

    def __init__(self, url: str, groups: list[int], ranks: int, src: str, mode: str, hb_default: float,
                 ping: float) -> None:  # fmt: skip
        self.url, self.ranks, self.src, self.mode, self.ping = url, ranks, src, mode, ping
        self.host, self.port = url.removeprefix("http://").split(":")
        self.groups = {g: Group(g) for g in groups}
        self.interval = hb_default
        self.beats = self.pings_sent = 0

    async def open(self, grp: Group) -> None:
        """The group's watch socket (hack/bench/ws_lite.py); its first frame (the hello) sets the pace."""
        query = {"group": str(grp.g), "incarnation": grp.inc, "rank": "0"}
        hello = asyncio.get_running_loop().create_future()

        def on_text(text: str) -> None:
            if text.startswith('{"kind":"quorum"'):
                if grp.answer is not None and not grp.answer.done():
                    grp.answer.set_result(text)
                return
            signal = json.loads(text)
            if not hello.done():
                hello.set_result(None)
            elif signal["abort_below"] > grp.abort_below:  # (a closed socket's transport reads nothing more)
                grp.abort_at = time.monotonic()
            grp.abort_below = max(grp.abort_below, signal["abort_below"])
            self.interval = signal.get("heartbeat_interval_s", self.interval)

        ws = await LiteSocket.connect(self.host, int(self.port), contract.PATH_WATCH, query, TOKEN, on_text, self.src)
        grp.ws = ws
        await asyncio.wait({hello, ws.ended}, return_when=asyncio.FIRST_COMPLETED)
        if not hello.done():
            raise ConnectionError(f"group {grp.g}: watch socket closed before its first frame")
        ws.ended.add_done_callback(lambda _: self.lost(grp, ws))

    def lost(self, grp: Group, ws: LiteSocket) -> None:
        if grp.ws is ws and grp.answer is not None and not grp.answer.done():
            grp.answer.set_exception(ConnectionError("watch socket closed"))

    async def pings(self) -> None:
        """The link ping on every open socket that received nothing for a whole period (aiohttp's client restarts
        its ping timer on every frame it receives), sockets visited spread over the period: the client's period (it
        follows the heartbeat pace) unless --link-ping says."""
        tick, order, start = 0.02, list(self.groups.values()), 0
        while True:
            await asyncio.sleep(tick)
            period = self.ping if self.ping > 0 else link_timing(self.interval)[0]
            per_tick, now = max(1, round(len(order) * tick / period)), time.monotonic()
            for grp in order[start : start + per_tick]:
                if grp.ws is not None and now - grp.ws.heard >= period:
                    grp.ws.ping()
                    self.pings_sent += 1
            start = (start + per_tick) % len(order)

    async def heartbeats(self) -> None:
        """Each group's heartbeat after every interval it told the lighthouse nothing (LighthouseClient's rule: a
        quorum request counts as one), first ones spread evenly over the interval as independent clients are."""
        tick, now = 0.02, time.monotonic()
        due = [(now + self.interval * i / len(self.groups), g) for i, g in enumerate(self.groups)]
        heapq.heapify(due)
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            while due and due[0][0] <= now:
                _, g = heapq.heappop(due)
                grp = self.groups[g]
                if now - grp.told < self.interval:  # it asked since: the next beat is one interval after that
                    heapq.heappush(due, (grp.told + self.interval, g))
                    continue
                grp.told = now
                heapq.heappush(due, (now + self.interval, g))
                if grp.ws is not None:  # a closed socket, or one whose lighthouse is far behind, skips the beat
                    frame = f'{{"step":{grp.step},"progress":{grp.step * 4},"waiting":false}}'
                    self.beats += grp.ws.send_text(frame, may_skip=True)

    async def ask(self, grp: Group, body: str) -> str:
        grp.told = time.monotonic()
        if self.mode == "ws":
            assert grp.ws is not None
            grp.answer = asyncio.get_running_loop().create_future()
            if not grp.ws.send_text('{"kind":"quorum","request":' + body + "}"):
                raise ConnectionError("watch socket closed")
            return await grp.answer
        if grp.stream is None:
            grp.stream = await asyncio.open_connection(self.host, int(self.port), local_addr=(self.src, 0))
        try:
            return await self._post(grp, body)
        except (OSError, asyncio.IncompleteReadError):
            grp.stream = None  # reconnect next round
            raise

    async def _post(self, grp: Group, body: str) -> str:
        assert grp.stream is not None
        reader, writer = grp.stream
        head = (f"POST {contract.PATH_QUORUM} HTTP/1.1\r\nHost: {self.host}\r\nAuthorization: Bearer {TOKEN}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
        writer.write(head.encode() + body.encode())
        headers = await reader.readuntil(b"\r\n\r\n")
        length = int(re.search(rb"(?i)content-length: *(\d+)", headers).group(1))  # type: ignore[union-attr]
        data = (await reader.readexactly(length)).decode()
        if not headers.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"group {grp.g}: {headers[:12]!r} {data}")
        return data

    async def round(self, step: int) -> tuple[float, float, int, list[str], float, int, int]:
        cpu, beats, pings = time.process_time(), self.beats, self.pings_sent
        bodies = [(grp, grp.body(self.ranks)) for grp in self.groups.values()]
        first = time.monotonic()
        answers = await asyncio.gather(*(self.ask(grp, body) for grp, body in bodies), return_exceptions=True)
        last = time.monotonic()
        qid, errors = -1, []
        for (grp, _), text in zip(bodies, answers, strict=True):
            answer = json.loads(text) if isinstance(text, str) else None
            answer = answer.get("quorum", answer) if answer is not None else None
            if answer is None or "quorum_id" not in answer:
                errors.append(f"group {grp.g}: {text}"[:200])
                continue
            grp.qid, grp.step, qid = answer["quorum_id"], answer["max_step"] + 1, answer["quorum_id"]
        return first, last, qid, errors, time.process_time() - cpu, self.beats - beats, self.pings_sent - pings

    async def fail(self, g: int) -> float:
        grp = self.groups[g]
        assert grp.ws is not None
        t0 = time.monotonic()
        grp.ws.close()  # a dead process: the lighthouse drops the group and aborts the quorum in flight
        return t0

    async def rejoin(self, g: int) -> None:
        grp = self.groups[g]
        if grp.ws is not None:
            grp.ws.close()
        grp.gen += 1
        grp.inc, grp.step, grp.qid = f"inc-{g}-{grp.gen}", 0, -1  # a new process: it heals at its first quorum
        if grp.stream is not None:
            grp.stream[1].close()
            grp.stream = None
        await self.open(grp)

    async def abort_seen(self, target: int, skip: int) -> tuple[float, int]:
        """When the last of this process's groups (but ``skip``) saw abort_below >= target; missing ones counted."""
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            late = [grp for grp in self.groups.values() if grp.g != skip and grp.abort_below < target]
            if not late:
                break
            await asyncio.sleep(0.01)
        seen = [grp.abort_at for grp in self.groups.values() if grp.g != skip and grp.abort_below >= target]
        return max(seen, default=None), len(self.groups) - (skip in self.groups) - len(seen)

    async def serve(self, conn: mp.connection.Connection) -> None:
        loop = asyncio.get_running_loop()
        sem = asyncio.Semaphore(64)

        async def bounded_open(grp: Group) -> None:
            async with sem:
                await self.open(grp)

        beating = asyncio.ensure_future(self.heartbeats())  # the first groups beat while the others connect
        await asyncio.gather(*(bounded_open(grp) for grp in self.groups.values()))
        pinging = asyncio.ensure_future(self.pings()) if self.ping != 0 else None
        conn.send(("ready", self.interval))
        while True:
            # Each simulated group stands for a process of its own, with a small heap: frozen, this process's
            # thousands of sockets are never scanned by its garbage collector, whose pauses would count as the
            # lighthouse's latency (reference counting frees them as before).
            gc.freeze()
            cmd, arg = await loop.run_in_executor(None, conn.recv)
            if cmd == "stop":
                break
            handler = {"round": self.round, "fail": self.fail, "rejoin": self.rejoin}.get(cmd)
            if cmd == "abort":
                conn.send(await self.abort_seen(*arg))
            elif cmd == "beats":
                conn.send((self.beats, self.interval, self.pings_sent))
            else:
                assert handler is not None, cmd
                conn.send(await handler(arg))
        beating.cancel()
        if pinging is not None:
            pinging.cancel()
        for grp in self.groups.values():
            if grp.ws is not None:
                grp.ws.close()


def generator(conn: mp.connection.Connection, cpus: set[int], *args: object) -> None:
    os.sched_setaffinity(0, cpus)
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    asyncio.run(Generator(*args).serve(conn))  # type: ignore[arg-type]


def proc_stats(pid: int) -> tuple[float, int]:
    """CPU seconds (user + system) and max RSS in bytes of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    hwm = re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    return cpu, int(hwm.group(1)) * 1024 if hwm else 0


def post(url: str, path: str, body: dict) -> dict:
    """A call of the operator's membership API."""
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST")
    req.add_header("Authorization", f"Bearer {OPERATOR_TOKEN}")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def heartbeats_counted(url: str) -> float | None:
    req = urllib.request.Request(url + contract.PATH_METRICS, headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        m = re.search(rb"^ftjob_lighthouse_heartbeats_total (\S+)$", resp.read(), re.M)
    return float(m.group(1)) if m else None


def drops_counted(url: str) -> dict[str, float]:
    req = urllib.request.Request(url + contract.PATH_METRICS, headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        found = re.findall(rb'^ftjob_lighthouse_evictions_total\{reason="([^"]+)"\} (\S+)$', resp.read(), re.M)
    return {k.decode(): float(v) for k, v in found}


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=12500)
    p.add_argument("--ranks", type=int, default=8, help="ranks per group (sizes the per-rank address lists)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--evictions", type=int, default=10, help="failures (one after each of the first rounds)")
    p.add_argument("--procs", type=int, default=4, help="load-generator processes")
    p.add_argument("--quorum-over", choices=("http", "ws"), default="ws")
    p.add_argument("--hb-interval", type=float, default=0.1, help="heartbeat interval unless the lighthouse says")
    p.add_argument("--link-ping", type=float, default=-1.0, help="ws ping period (default: the client's, "
                   "ftjob.ft.links.watch_link.link_timing of the pushed heartbeat period; 0: none)")  # fmt: skip
    p.add_argument("--quiet-s", type=float, default=5.0, help="window to measure the heartbeat rate held")
    p.add_argument("--lighthouse-cpu", type=int, default=0)
    p.add_argument("--profile", help="run the lighthouse under cProfile, stats to this file")
    p.add_argument("--lighthouse-path", help="first on the lighthouse's PYTHONPATH: another ftjob to compare with")
    args = p.parse_args()
    others = (os.sched_getaffinity(0) - {args.lighthouse_cpu}) or {args.lighthouse_cpu}
    with tempfile.TemporaryDirectory(prefix="bench-cp-") as tmp:
        log = Path(tmp) / "lighthouse.log"
        code = ["-c", PROFILE, args.profile] if args.profile else ["-m", "ftjob.lighthouse"]
        cmd = [sys.executable, *code, "--bind", "127.0.0.1:0", "--min-replicas", "1", "--join-timeout", "10"]
        lh = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                              env={**os.environ, "FTJOB_TOKEN": TOKEN, "FTJOB_OPERATOR_TOKEN": OPERATOR_TOKEN,
                                   "PYTHONPATH": args.lighthouse_path or ""},
                              preexec_fn=lambda: os.sched_setaffinity(0, {args.lighthouse_cpu}))  # fmt: skip
        atexit.register(lambda: lh.poll() is None and (lh.terminate(), lh.wait(30)))  # also when the bench fails

        def listening() -> re.Match[str] | None:
            if lh.poll() is not None:
                raise StopWaiting(f"the lighthouse exited {lh.returncode}: {log.read_text()}")
            return re.search(r"listening on 127\.0\.0\.1:(\d+)", log.read_text())

        m = wait_for(listening, 60, "the lighthouse to listen", interval=0.1)
        url = f"http://127.0.0.1:{m.group(1)}"
        ctx = mp.get_context("spawn")
        pipes, procs = [], []
        for i in range(args.procs):
            mine = list(range(i, args.groups, args.procs))
            a, b = ctx.Pipe()
            gen = (
                url,
                mine,
                args.ranks,
                f"127.0.0.{10 + i}",
                args.quorum_over,
                args.hb_interval,
                args.link_ping,
            )
            procs.append(ctx.Process(target=generator, args=(b, others, *gen), daemon=True))
            procs[-1].start()
            pipes.append(a)
        owner = {g: pipes[g % args.procs] for g in range(args.groups)}
        t_start = time.monotonic()
        ready = [c.recv() for c in pipes]
        print(f"{args.groups} groups x {args.ranks} ranks connected in {time.monotonic() - t_start:.1f}s by "
              f"{args.procs} generator processes on cpus {sorted(others)} (lighthouse alone on cpu "
              f"{args.lighthouse_cpu}); heartbeat interval {ready[0][1]:g}s; quorum over {args.quorum_over}",
              flush=True)  # fmt: skip

        def call(conn: mp.connection.Connection, cmd: str, arg: object) -> object:
            conn.send((cmd, arg))
            return conn.recv()

        rounds, lh_cpu, gen_cpu, round_beats, round_pings, aborts, missing = [], [], [], [], [], [], 0
        rng = random.Random(11)
        t_run, cpu_run = time.monotonic(), proc_stats(lh.pid)[0]
        for r in range(args.rounds):
            c0 = proc_stats(lh.pid)[0]
            for c in pipes:
                c.send(("round", r))
            got = [c.recv() for c in pipes]
            rounds.append(max(x[1] for x in got) - min(x[0] for x in got))
            lh_cpu.append(proc_stats(lh.pid)[0] - c0)
            gen_cpu.append(sum(x[4] for x in got))
            round_beats.append(sum(x[5] for x in got))
            round_pings.append(sum(x[6] for x in got))
            qid = max(x[2] for x in got)
            errors = [e for x in got for e in x[3]]
            if errors:
                print(f"round {r}: {len(errors)} groups got no quorum, e.g. {errors[0]}", flush=True)
            if r < args.evictions:
                victim = rng.randrange(args.groups)
                if r % 2 == 0:
                    t0 = time.monotonic()
                    post(url, contract.PATH_EVICT, {"groups": [str(victim)], "reason": "bench"})
                else:
                    t0 = call(owner[victim], "fail", victim)
                for c in pipes:
                    c.send(("abort", (qid + 1, victim)))
                seen = [c.recv() for c in pipes]
                if any(s[0] is not None for s in seen):
                    aborts.append(max(s[0] for s in seen if s[0] is not None) - t0)
                missing += sum(s[1] for s in seen)
                call(owner[victim], "rejoin", victim)
        run_s, run_cpu = time.monotonic() - t_run, proc_stats(lh.pid)[0] - cpu_run
        n0, c0, t0 = heartbeats_counted(url), proc_stats(lh.pid)[0], time.monotonic()
        before = [call(c, "beats", None) for c in pipes]
        time.sleep(args.quiet_s)
        n1, (c1, rss), t1 = heartbeats_counted(url), proc_stats(lh.pid), time.monotonic()
        after = [call(c, "beats", None) for c in pipes]
        sent = sum(a[0] - b[0] for a, b in zip(after, before, strict=True)) / (t1 - t0)
        pinged = sum(a[2] - b[2] for a, b in zip(after, before, strict=True)) / (t1 - t0)
        drops = drops_counted(url)
        for c in pipes:
            c.send(("stop", None))
        for proc in procs:
            proc.join(10)
        lh.terminate()
        lh.wait(30)
        # the lighthouse's own share of the abort latency: writing the signal to every socket (the rest is the
        # generators reading 12,500 sockets on their one shared core)
        pushes = [float(ms) for ms in re.findall(r'pushed \{"quorum_id":\d+,"abort_below":\d+[^}]*\} to \d+ watch '
                                                  r"sockets in ([\d.]+) ms", log.read_text())]  # fmt: skip
        if args.profile:
            print(f"cProfile stats of the lighthouse: {args.profile}")
        counted = f"{(n1 - n0) / (t1 - t0):,.0f}/s counted by the lighthouse" if n0 is not None else "not counted"
        print(f"quorum round: median {statistics.median(rounds):.3f}s p99 {pct(rounds, 0.99):.3f}s over "
              f"{len(rounds)} rounds (goal <= 0.5s); lighthouse CPU per round median "
              f"{statistics.median(lh_cpu):.3f}s max {max(lh_cpu):.3f}s; the generators' CPU per round (all "
              f"of them, on {len(others)} core(s)) median {statistics.median(gen_cpu):.3f}s; heartbeats sent "
              f"during a round median {statistics.median(round_beats):,.0f}, link pings "
              f"{statistics.median(round_pings):,.0f}")  # fmt: skip
        if aborts:
            print(f"eviction -> abort on every watch socket: median {statistics.median(aborts) * 1000:.0f}ms p99 "
                  f"{pct(aborts, 0.99) * 1000:.0f}ms over {len(aborts)} failures (goal p99 <= 200ms); sockets "
                  f"that never saw it: {missing}; ranks > 0 hear it from their rank 0 (+ well under 1ms)")  # fmt: skip
            print(f"  each failure in turn (evicted, closed, ...), ms: {[round(a * 1000) for a in aborts]}")
        if pushes:
            print(f"  of which the lighthouse writing a signal to every socket: median "
                  f"{statistics.median(pushes):.0f}ms max {max(pushes):.0f}ms over {len(pushes)} pushes")  # fmt: skip
        print(f"heartbeats (quiet {args.quiet_s:g}s): {sent:,.0f}/s sent, {counted}; link pings {pinged:,.0f}/s; "
              f"lighthouse CPU "
              f"{(c1 - c0) / (t1 - t0):.0%} of its core while quiet, {run_cpu / run_s:.0%} over the rounds; "
              f"max RSS {rss / 2**20:.0f} MiB")  # fmt: skip
        print(f"groups dropped by the lighthouse, by reason: {drops or 'none'} (the bench evicted/closed "
              f"{len(aborts)}; any other drop means it was overloaded)")  # fmt: skip
        print(f"load {os.getloadavg()[0]:.2f} (1-min) on {os.cpu_count()} cpus", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
