#!/usr/bin/env python3
"""Failover figures of the fault-tolerance core (a benchmark, not a test): a real lighthouse and 3 replica groups of a
tiny model (tests/support/manager_worker.py) on loopback; group "2" is the victim.

Measured, all in this run:
  * survivors' stall per SIGKILL of the victim at random points (>= --kills), each followed by a restart + rejoin;
  * survivors' stall after a silent cut-off (SIGSTOP) with the evict call, and without it (heartbeat timeout);
  * rejoin time (restarted process ready -> first committed step) and the survivors' stall while it rejoins;
  * the floor under that rejoin, after each kill while the victim is down: torch alone (hack/bench/torch_floor.py:
    import torch, the same model and Adam, one local step), and ftjob's rejoin above it;
  * with --torchft-rejoins N: torchft's groups (hack/bench/torchft_rejoin.py, same tiny model and loop; labelled
    with the torchft version installed) killed and restarted the same way, after ours; both sides' restarted process
    (and torch alone) broken down phase by phase (python start, imports, model + optimizer, Manager ready, quorum
    answered, healed, first commit, first contributing commit);
  * recovery throughput over plain HTTP (into the healer's own tensors, as the Manager heals, and into a fresh
    buffer) and over TLS (the job's certificates, verified), in rounds on the same snapshot interleaved with raw
    loopback TCP (one socket into a preallocated buffer; same machine, same run), each vs that.
Stall = the longest gap between two consecutive commits of a survivor around the event, minus its median step gap.

    python -m hack.bench.bench_failover [--kills 10] [--state-mb 256] [--recovery-only]
    python -m hack.bench.bench_failover --kills 5 --cuts 0 --stops 0 --no-recovery --torchft-rejoins 5   # rejoin only
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ftjob import contract

from hack.bench.torchft_rejoin import TorchftJob, torchft_label
from tests.support.local_job import Lighthouse, Worker
from tests.support.polling import wait_for

FLOOR = Path(__file__).resolve().parent / "torch_floor.py"

# A short pause per step leaves CPU for a restarting group's python + torch import on a 2-core machine.
WORKER_ARGS = ("--steps", "1000000", "--collective-timeout", "30", "--quorum-timeout", "120", "--width", "64")
WORKER_ARGS += ("--step-delay", "0.02")


def commit_times(w: Worker) -> list[float]:
    return [e["time"] for e in w.events("step") if e["committed"]]


def stall_around(w: Worker, start: float, end: float, median_gap: float) -> float:
    """Longest gap between consecutive commits that overlaps [start, end], minus the normal step gap."""
    times = commit_times(w)
    worst = 0.0
    for a, b in itertools.pairwise(times):
        if b >= start and a <= end:
            worst = max(worst, b - a)
    return max(0.0, worst - median_gap)


def median_gap(w: Worker, since: float) -> float:
    times = [t for t in commit_times(w) if t >= since]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return statistics.median(gaps) if gaps else 0.0


def commits_after(w: Worker, t: float, n: int = 3) -> bool:
    return sum(1 for x in commit_times(w) if x > t) >= n


class Run:
    def __init__(self, workdir: Path, heartbeat_timeout: float) -> None:
        self.workdir = workdir
        self.lh = Lighthouse(
            workdir, "--min-replicas", "1", "--join-timeout", "0.5", "--heartbeat-timeout", str(heartbeat_timeout)
        ).start()
        code, _ = self.lh.request("POST", contract.PATH_STARTING, {"groups": ["0", "1", "2"]})
        assert code == 200
        self.survivors = [Worker(workdir, self.lh.url, g, *WORKER_ARGS) for g in ("0", "1")]
        self.victim = Worker(workdir, self.lh.url, "2", *WORKER_ARGS)
        wait_for(lambda: all(commits_after(w, 0, 20) for w in self.all()), 180, "all groups training")

    def all(self) -> list[Worker]:
        return [*self.survivors, self.victim]

    def restart_victim(self) -> tuple[float, float, float]:
        """Restarts the victim; returns (spawn time, ready time, first commit time)."""
        spawned = time.time()
        self.victim = Worker(self.workdir, self.lh.url, "2", *WORKER_ARGS)
        ready = wait_for(lambda: self.victim.events("ready"), 120, "the victim to start")[0]["time"]
        first = wait_for(lambda: commit_times(self.victim), 120, "the victim's first commit")[0]
        return spawned, ready, first

    def close(self) -> None:
        for w in self.all():
            w.kill()
        self.lh.kill()


def timeline(w: Worker, spawned: float) -> dict[str, float]:
    """A restarted group's startup, phase by phase (seconds), from its own events (same clock as ``spawned``).
    Ours also says when its first quorum answered and its heal ended; torchft's (asynchronous quorum) does not."""
    wait_for(lambda: any(e["committed"] and e["contributing"] for e in w.events("step")), 120, "a contribution")
    boot = w.events("boot")[0]
    ready_event = w.events("ready")[0]
    ready = ready_event["time"]
    steps = w.events("step")
    commit = next(e["time"] for e in steps if e["committed"])
    phases = {
        "python start": boot["time"] - spawned,
        "imports": boot["imported"] - boot["time"],
        "model + optimizer": ready_event["built"] - boot["imported"],  # torch.optim imports torch._dynamo
        "Manager ready": ready - ready_event["built"],
    }
    first = steps[0]  # the heal step: its quorum answer and the heal end inside start_quorum()
    if "quorum_time" in first:
        answered = first["quorum_time"] - first["heal_seconds"]
        phases |= {"quorum answered": answered - ready, "healed": first["quorum_time"] - answered}
        ready = first["quorum_time"]
    contributing = next(e["time"] for e in steps if e["committed"] and e["contributing"])
    return phases | {"first commit": commit - ready, "first contributing commit": contributing - commit}


def fmt(xs: list[float]) -> str:
    if not xs:
        return "n/a"
    return f"max {max(xs):.3f}s  median {statistics.median(xs):.3f}s  (n={len(xs)})"


def torch_floor() -> dict[str, float]:
    """One run of hack/bench/torch_floor.py (torch alone: import, the worker's model + Adam, one local step), phase by
    phase as ``timeline`` names them, under the load a restarted worker meets (the survivors training)."""
    spawned = time.time()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as Worker gives ours
    width = WORKER_ARGS[WORKER_ARGS.index("--width") + 1]  # the restarted worker's model
    cmd = [sys.executable, str(FLOOR), width]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=True)
    t = json.loads(out.stdout.splitlines()[-1])
    return {
        "python start": t["boot"] - spawned,
        "imports": t["imported"] - t["boot"],
        "model + optimizer": t["built"] - t["imported"],
        "first commit": t["stepped"] - t["built"],  # one local step: no peers, nothing to commit to
    }


def bench_kills(run: Run, kills: int, rng: random.Random) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Kills and restarts the victim ``kills`` times; returns the restarted process's phases and, measured after each
    kill while the victim is down (the same load), torch alone's (``torch_floor``)."""
    stalls, rejoins, rejoin_stalls, spawn_to_commit, floors = [], [], [], [], []
    phases: dict[str, list[float]] = {}
    floor_phases: dict[str, list[float]] = {}
    for i in range(kills):
        time.sleep(rng.uniform(0.2, 1.0))  # a random point of the step cycle
        base = {w.group: median_gap(w, time.time() - 3) for w in run.survivors}
        killed_at = time.time()
        run.victim.signal(signal.SIGKILL)
        wait_for(lambda t=killed_at: all(commits_after(w, t) for w in run.survivors), 60, "survivors to go on")
        stalls.append(max(stall_around(w, killed_at, killed_at, base[w.group]) for w in run.survivors))
        run.victim.kill()
        floor = torch_floor()
        for phase, seconds in floor.items():
            floor_phases.setdefault(phase, []).append(seconds)
        floors.append(sum(floor.values()))
        spawned, ready, first = run.restart_victim()
        wait_for(lambda f=first: all(commits_after(w, f) for w in run.survivors), 60, "survivors after the rejoin")
        rejoins.append(first - ready)
        spawn_to_commit.append(first - spawned)
        rejoin_stalls.append(max(stall_around(w, ready, first, base[w.group]) for w in run.survivors))
        for phase, seconds in timeline(run.victim, spawned).items():
            phases.setdefault(phase, []).append(seconds)
        print(
            f"[kill {i + 1}/{kills}] survivor stall {stalls[-1]:.3f}s; rejoin {rejoins[-1]:.3f}s "
            f"(process start -> commit {spawn_to_commit[-1]:.2f}s; torch alone {floors[-1]:.2f}s); "
            f"survivor stall during rejoin {rejoin_stalls[-1]:.3f}s",
            flush=True,
        )
    print(f"SIGKILL: survivor stall          {fmt(stalls)}   target <= 0.5s max")
    print(f"rejoin (ready -> first commit): {fmt(rejoins)}   target <= 3s")
    print(f"rejoin incl. process start:     {fmt(spawn_to_commit)}   (python + torch import on this machine)")
    print(f"torch alone, process start -> one step: {fmt(floors)}   (hack/bench/torch_floor.py, same load)")
    above = [a - b for a, b in zip(spawn_to_commit, floors, strict=True)]
    print(f"ftjob's rejoin above torch alone, per kill: median {statistics.median(above):+.3f}s max {max(above):+.3f}s")
    print(f"survivor stall during rejoin:   {fmt(rejoin_stalls)}   target <= 0.05s")
    return phases, floor_phases


def crash_line(w: Worker) -> str:
    """A dead worker's exception and where it was raised (the last lines of its traceback), for the report."""
    lines = w.log.read_text(errors="replace").splitlines()
    where = [ln.strip() for ln in lines if ln.startswith('  File "')]
    errors = [ln for ln in lines if ln and not ln.startswith(("{", " "))]
    if not errors:
        return f"exit {w.proc.returncode}, no output"
    return errors[-1][:160] + (f" at {where[-1].removeprefix('File ')[-120:]}" if where else "")


def bench_torchft_rejoins(workdir: Path, rejoins: int, rng: random.Random) -> dict[str, list[float]]:
    """The same kill + restart of group "2" and the same timeline on torchft's groups (hack/bench/torchft_rejoin.py).
    A kill that lands inside torchft's gradient all-reduce can crash its survivors (torchft 0.2.0: an AssertionError
    in torchft/ddp.py's comm hook). Such a kill is counted and reported with the survivors' exception, the job is
    started afresh and the kill tried again, so the rejoin figure still gets its ``rejoins`` samples."""
    phases: dict[str, list[float]] = {}
    kills = crashes = 0
    job: TorchftJob | None = None
    try:
        while len(phases.get("first commit", [])) < rejoins and kills < 3 * rejoins:
            if job is None:
                job = TorchftJob(workdir, ["0", "1", "2"])
                wait_for(lambda j=job: all(commits_after(w, 0, 20) for w in j.groups.values()), 180, "torchft training")
                print("[bench] torchft: 3 groups training; group 2 is the victim", flush=True)
            survivors = [job.groups["0"], job.groups["1"]]
            time.sleep(rng.uniform(0.2, 1.0))
            killed_at = time.time()
            job.groups["2"].kill()
            kills += 1
            try:  # every survivor commits on, or one of them died (then at once)
                wait_for(lambda t=killed_at, s=survivors: all(commits_after(w, t) for w in s)
                      or any(w.proc.poll() is not None for w in s), 60, "torchft survivors")  # fmt: skip
            except AssertionError:
                pass  # stuck: reported below
            dead = [w for w in survivors if w.proc.poll() is not None]
            if dead or not all(commits_after(w, killed_at) for w in survivors):
                crashes += 1
                why = "; ".join(f"group {w.group}: {crash_line(w)}" for w in dead) or "alive but not committing"
                print(f"[torchft kill {kills}] survivors crashed or stuck ({why}); a fresh job, then again", flush=True)
                job.close()
                job = None
                continue
            spawned = time.time()
            job.groups["2"] = job.start("2")
            for phase, seconds in timeline(job.groups["2"], spawned).items():
                phases.setdefault(phase, []).append(seconds)
            print(f"[torchft kill {kills}] process start -> commit "
                  f"{commit_times(job.groups['2'])[0] - spawned:.2f}s", flush=True)  # fmt: skip
    finally:
        if job is not None:
            job.close()
    print(
        f"{torchft_label()} survivors crashed or stuck after {crashes} of {kills} kills of a peer (ftjob: every "
        "survivor of every kill above committed on)",
        flush=True,
    )
    return phases


def print_breakdown(sides: dict[str, dict[str, list[float]]]) -> None:
    """Median per phase of each side's restarted process, and the cumulative time since its spawn."""
    print("rejoin breakdown, process start -> first contributing commit (median per phase / cumulative):")
    names = list(dict.fromkeys(phase for phases in sides.values() for phase in phases))
    print(f"  {'phase':<27}" + "".join(f"{side:>22}" for side in sides))
    totals = dict.fromkeys(sides, 0.0)
    for phase in names:
        row = f"  {phase:<27}"
        for side, phases in sides.items():
            if phase in phases:
                totals[side] += statistics.median(phases[phase])
                row += f"{f'+{statistics.median(phases[phase]):.3f} / {totals[side]:.3f}s':>22}"
            else:
                row += f"{'-':>22}"
        print(row)
    for side, phases in sides.items():
        runs = [dict(zip(phases, values, strict=True)) for values in zip(*phases.values(), strict=True)]
        commit = [sum(v for k, v in r.items() if k != "first contributing commit") for r in runs]
        print(f"{side:<14} process start -> first commit:              {fmt(commit)}")
        if "first contributing commit" in phases:  # not torch alone's: its one step has no peers
            print(f"{side:<14} process start -> first contributing commit: {fmt([sum(r.values()) for r in runs])}")


def bench_silent_cut(run: Run, evict: bool, rounds: int) -> list[float]:
    stalls = []
    for _ in range(rounds):
        time.sleep(0.5)
        base = {w.group: median_gap(w, time.time() - 3) for w in run.survivors}
        cut_at = time.time()
        run.victim.signal(signal.SIGSTOP)  # no reset: sockets stay open, heartbeats just stop
        if evict:
            code, body = run.lh.request("POST", contract.PATH_EVICT, {"groups": ["2"], "reason": "bench cut-off"})
            assert code == 200, body
        wait_for(lambda t=cut_at: all(commits_after(w, t) for w in run.survivors), 120, "survivors to go on")
        stalls.append(max(stall_around(w, cut_at, cut_at, base[w.group]) for w in run.survivors))
        run.victim.kill()
        run.restart_victim()
        print(f"[SIGSTOP{' + evict' if evict else ''}] survivor stall {stalls[-1]:.3f}s", flush=True)
    return stalls


def soak(run: Run, minutes: float, hogs: int) -> None:
    """No failure at all for ``minutes`` while ``hogs`` busy-loop processes load every core: the stall rule (and the
    heartbeat timeout) must evict nobody. Prints the drops and the step-gap spread the rule had to tolerate."""
    loaders = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
    start = time.time()
    try:
        while time.time() - start < minutes * 60:
            time.sleep(min(30.0, max(0.0, start + minutes * 60 - time.time())))
            alive = [w.group for w in run.all() if w.proc.poll() is None]
            print(f"[soak {(time.time() - start) / 60:.1f}/{minutes:g} min] groups alive {alive}; lighthouse drops: "
                  f"{stall_evictions(run)}", flush=True)  # fmt: skip
    finally:
        for p in loaders:
            p.kill()
    gaps = sorted(b - a for w in run.all() for a, b in itertools.pairwise(commit_times(w)) if a >= start)
    p99 = gaps[int(0.99 * (len(gaps) - 1))] if gaps else 0.0
    print(f"soak: {minutes:g} min under {hogs} CPU hogs, {len(gaps)} step gaps: median {statistics.median(gaps):.3f}s "
          f"p99 {p99:.3f}s max {gaps[-1]:.3f}s; lighthouse drops: {stall_evictions(run)}   target: none")  # fmt: skip


def stall_evictions(run: Run) -> str:
    """How the lighthouse dropped groups in this run, by reason (the stall rule's say "evicted: stalled")."""
    code, body = run.lh.request("GET", contract.PATH_STATUS)
    assert code == 200, body
    reasons = [":".join(e["reason"].split(":")[:2]) for e in body["history"] if e.get("event") == "dropped"]
    return ", ".join(f"{r} x{reasons.count(r)}" for r in sorted(set(reasons))) or "none"


def bench_recovery_throughput(state_mb: int, rounds: int = 5) -> None:
    import torch
    from ftjob.contract import pki
    from ftjob.contract.tls import TlsConfig, worker_server_name
    from ftjob.ft.recovery.transport import RecoveryServer, fetch_state

    n = state_mb * 1024 * 1024 // 4
    state = {"model": {"w": torch.randn(n // 2)}, "optim": {"m": torch.randn(n - n // 2)}}
    # the healer's own state of the same shapes, as the Manager passes it (template=): bytes land in it in place
    mine = {"model": {"w": torch.zeros(n // 2)}, "optim": {"m": torch.zeros(n - n // 2)}}
    cases = {  # name -> (server, client TLS, template)
        "plain": ("plain", None, mine),
        "plain, no template": ("plain", None, None),
        "TLS": ("tls", "tls", mine),
    }
    with tempfile.TemporaryDirectory(prefix="bench-tls-") as tmp:
        files = pki.write_files(Path(tmp), pki.issue_job("bench", "default", ["localhost"]))
        name = worker_server_name("bench", "default")
        server_tls = TlsConfig(str(files[pki.CA_CERT]), str(files[pki.WORKER_CERT]), str(files[pki.WORKER_KEY]), name)
        tls = {None: None, "tls": TlsConfig(str(files[pki.CA_CERT]), worker_name=name)}
        servers = {
            "plain": RecoveryServer("bench", "127.0.0.1", 0),
            "tls": RecoveryServer("bench", "127.0.0.1", 0, tls=server_tls),
        }
        t0 = time.perf_counter()
        servers["plain"].publish(1, state)
        publish_s = time.perf_counter() - t0
        servers["tls"].publish(1, state)
        for srv, client, template in cases.values():  # warm-up (waits for each snapshot's checksums)
            got, _ = fetch_state(servers[srv].address, 1, "bench", template=template, tls=tls[client])
        assert torch.equal(got["optim"]["m"], state["optim"]["m"]), "the fetched state differs from the published one"
        seconds: dict[str, list[float]] = {case: [] for case in [*cases, "raw"]}
        # interleaved with the raw TCP baseline, rotating which goes first: drifts in machine load hit all
        for r in range(rounds):
            order = [*cases, "raw"][r % 4 :] + [*cases, "raw"][: r % 4]
            for case in order:
                if case == "raw":
                    seconds["raw"].append(raw_tcp_seconds(n * 4))
                    continue
                srv, client, template = cases[case]
                t0 = time.perf_counter()
                fetch_state(servers[srv].address, 1, "bench", template=template, parallel=4, tls=tls[client])
                seconds[case].append(time.perf_counter() - t0)
        for server in servers.values():
            server.close()
    nbytes = n * 4
    raw = seconds.pop("raw")
    raw_mib_s, raw_best = nbytes / statistics.median(raw) / 2**20, nbytes / min(raw) / 2**20  # rounds: best of 3
    print(f"recovery: {nbytes / 2**20:.0f} MiB snapshot copied in {publish_s:.3f}s at the step boundary")
    mib_s = {case: nbytes / statistics.median(s) / 2**20 for case, s in seconds.items()}
    for case in cases:
        best = nbytes / min(seconds[case]) / 2**20
        print(
            f"recovery fetch over {case}: median {mib_s[case]:.0f} MiB/s (best {best:.0f}) over {rounds} rounds, "
            f"{nbytes / 2**20:.0f} MiB, parallel 4 (max: CPUs); raw loopback TCP (median of rounds' best of 3) "
            f"{raw_mib_s:.0f} MiB/s -> ratio {mib_s[case] / raw_mib_s:.2f}; best/best {best / raw_best:.2f}"
        )
    print(f"recovery TLS / plain throughput: {mib_s['TLS'] / mib_s['plain']:.2f}")


def raw_tcp_seconds(nbytes: int) -> float:
    """One socket, one sender thread, receiving into a preallocated buffer: the wire's best case here."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    payload = memoryview(bytearray(4 * 1024 * 1024))

    def send() -> None:
        conn, _ = srv.accept()
        left = nbytes
        while left:
            k = conn.send(payload[: min(len(payload), left)])
            left -= k
        conn.close()

    best = float("inf")
    for _ in range(3):
        t = threading.Thread(target=send)
        t.start()
        cli = socket.create_connection(srv.getsockname())
        buf = memoryview(bytearray(nbytes))
        t0 = time.perf_counter()
        got = 0
        while got < nbytes:
            got += cli.recv_into(buf[got:])
        best = min(best, time.perf_counter() - t0)
        cli.close()
        t.join()
    srv.close()
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--cuts", type=int, default=3, help="silent cut-offs with evict")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0, help="the example job's (seconds)")
    p.add_argument("--stops", type=int, default=3, help="silent cut-offs without evict (the stall rule's case)")
    p.add_argument("--soak-min", type=float, default=0, help="only: a failure-free run this long under CPU hogs")
    p.add_argument("--hogs", type=int, default=4, help="busy-loop processes during --soak-min")
    p.add_argument("--state-mb", type=int, default=256)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--recovery-only", action="store_true", help="only the recovery throughput figures")
    p.add_argument("--no-recovery", action="store_true", help="skip the recovery throughput figures")
    p.add_argument("--torchft-rejoins", type=int, default=0, help="also kill + restart a torchft group this often")
    args = p.parse_args()
    if args.torchft_rejoins and importlib.util.find_spec("torchft") is None:  # before minutes of our own figures
        p.error("--torchft-rejoins needs torchft: the optional `bench` extra (README.md, Benchmarks)")
    rng = random.Random(args.seed)
    if not args.no_recovery:
        bench_recovery_throughput(args.state_mb)
    if args.recovery_only:
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-failover-") as tmp:
        run = Run(Path(tmp), args.heartbeat_timeout)
        try:
            if args.soak_min:
                soak(run, args.soak_min, args.hogs)
                return 0
            print("[bench] 3 groups training; group 2 is the victim", flush=True)
            sides = {}
            if args.kills:
                sides["ftjob"], sides["torch alone"] = bench_kills(run, args.kills, rng)
            with_evict = bench_silent_cut(run, evict=True, rounds=args.cuts)
            without = bench_silent_cut(run, evict=False, rounds=args.stops)
            if args.cuts:
                print(f"SIGSTOP + evict: survivor stall  {fmt(with_evict)}   target <= 1.5s max")
            if args.stops:
                print(
                    f"SIGSTOP, no evict: survivor stall {fmt(without)}   target <= 1.5s max (progress-based stall "
                    f"rule; --heartbeat-timeout {args.heartbeat_timeout}s would bound it otherwise)"
                )
            print(f"lighthouse evictions: {stall_evictions(run)}")
        finally:
            run.close()
        if args.torchft_rejoins:  # after ours closed: each side has the machine to itself
            sides[torchft_label()] = bench_torchft_rejoins(Path(tmp), args.torchft_rejoins, rng)
        if sides:
            print_breakdown(sides)
    return 0


if __name__ == "__main__":
    sys.exit(main())
