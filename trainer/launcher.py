"""``ftjob-trainer launch``: a lighthouse plus N groups x M ranks as local processes on loopback, with faults.

The launcher restarts a dead group after ``--restart-delay`` and injects faults: ``--kill-at`` SIGKILLs a random
live group when the job's committed step reaches each given step (read from the lighthouse status API),
``--kill-every`` does so on a timer. It never kills below ``--min-replicas`` live groups (the kill waits), so the
job keeps committing. At the end it checks the groups' records (run dir) and writes ``--report`` / ``--timeline``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftjob.trainer import contract
from ftjob.trainer.launcher_procs import GroupProcs, free_port, start_group, start_lighthouse
from ftjob.trainer.launcher_report import LaunchEvents, build_report, rejoin_marks
from ftjob.trainer.launcher_status import LighthouseStatus, LiveProgress
from ftjob.trainer.model import PRESETS


@dataclass(frozen=True)
class LaunchConfig:
    replicas: int
    pods_per_replica: int
    min_replicas: int
    steps: int
    kill_at: list[int]
    kill_every: float | None
    restart_delay: float
    model: str
    batch_size: int
    run_dir: Path
    report: Path | None
    timeline: Path | None
    spares: int
    seed: int
    timeout: float
    checkpoint_every: int
    max_crashes: int
    min_step_seconds: float
    extra_train_args: list[str]


def add_launch_flags(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--replicas", type=int, default=3, help="replica groups that contribute (default 3)")
    a("--pods-per-replica", type=int, default=1, help="ranks per group; >1 shards the model with FSDP2 (default 1)")
    a("--min-replicas", type=int, default=None, help="groups needed to commit (default replicas-1, at least 1)")
    a("--steps", type=int, default=200, help="steps to train (default 200)")
    a("--kill-at", default="", help="SIGKILL a random group when the committed step reaches each STEP[,STEP...]")
    a("--kill-every", type=float, default=None, help="SIGKILL a random group every SECONDS")
    a("--restart-delay", type=float, default=1.0, help="seconds before a dead group is restarted (default 1)")
    a("--model", default="tiny", choices=sorted(PRESETS), help="model preset (default tiny)")
    a("--batch-size", type=int, default=128, help="samples per group per step (default 128)")
    a("--run-dir", type=Path, default=None, help="records, logs, checkpoints (default: a fresh ./ftjob-run-<time>)")
    a("--report", type=Path, default=None, help="write the JSON report here")
    a("--timeline", type=Path, default=None, help="write the timeline PNG here")
    a("--spares", type=int, default=0, help="extra live groups beyond --replicas that stand by (default 0)")
    a("--seed", type=int, default=0, help="seed of the victim choice (default 0)")
    a("--timeout", type=float, default=1800.0, help="give up after SECONDS (default 1800)")
    a("--checkpoint-every", type=int, default=0, help="durable checkpoint every N steps into <run-dir>/checkpoints")
    a("--min-step-seconds", type=float, default=0.0, help="pad each step to this long (stand-in for a bigger model)")
    a("--max-crashes", type=int, default=10, help="give up when one group exits unexpectedly this often (default 10)")
    a("--train-arg", action="append", default=[], help="extra flag passed to every `train` (repeatable)")


def config_from_args(a: argparse.Namespace) -> LaunchConfig:
    problems = []
    try:
        kill_at = sorted(int(s) for s in a.kill_at.split(",") if s.strip())
    except ValueError:
        kill_at = []
        problems.append(f"--kill-at {a.kill_at!r} must be comma-separated step numbers, e.g. 50,120")
    min_replicas = a.min_replicas if a.min_replicas is not None else max(1, a.replicas - 1)
    if a.replicas < 1 or a.pods_per_replica < 1 or a.steps < 1:
        problems.append("--replicas, --pods-per-replica and --steps must be >= 1")
    if not 1 <= min_replicas <= a.replicas:
        problems.append(f"--min-replicas {min_replicas} must be between 1 and --replicas {a.replicas}")
    if any(not 0 < s < a.steps for s in kill_at):
        problems.append(f"every --kill-at step must be between 1 and --steps-1 ({a.steps - 1}); got {kill_at}")
    if kill_at and min_replicas >= a.replicas + a.spares:
        problems.append(
            f"--kill-at needs --min-replicas ({min_replicas}) below the live groups "
            f"({a.replicas + a.spares}), or nothing could commit while a group is down"
        )
    if a.kill_every is not None and a.kill_every <= 0:
        problems.append("--kill-every must be a positive number of seconds")
    if a.batch_size % a.pods_per_replica:
        problems.append(f"--batch-size {a.batch_size} must be a multiple of --pods-per-replica {a.pods_per_replica}")
    if a.spares < 0 or a.restart_delay < 0:
        problems.append("--spares and --restart-delay must be >= 0")
    if problems:
        raise ValueError("invalid launch flags: " + "; ".join(problems))
    run_dir = a.run_dir or Path(f"ftjob-run-{time.strftime('%Y%m%d-%H%M%S')}")
    return LaunchConfig(
        replicas=a.replicas,
        pods_per_replica=a.pods_per_replica,
        min_replicas=min_replicas,
        steps=a.steps,
        kill_at=kill_at,
        kill_every=a.kill_every,
        restart_delay=a.restart_delay,
        model=a.model,
        batch_size=a.batch_size,
        run_dir=run_dir.resolve(),
        report=a.report,
        timeline=a.timeline,
        spares=a.spares,
        seed=a.seed,
        timeout=a.timeout,
        checkpoint_every=a.checkpoint_every,
        max_crashes=a.max_crashes,
        min_step_seconds=a.min_step_seconds,
        extra_train_args=list(a.train_arg),
    )


class Launcher:
    def __init__(self, cfg: LaunchConfig) -> None:
        self.cfg = cfg
        self.groups = [str(i) for i in range(cfg.replicas + cfg.spares)]
        self.token = secrets.token_hex(16)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.rng = random.Random(cfg.seed)
        self.running: dict[str, GroupProcs] = {}
        self.restart_at: dict[str, float] = {}
        self.finished: set[str] = set()
        self.generation = dict.fromkeys(self.groups, 0)
        self.events = LaunchEvents(t0=time.time(), restarts=dict.fromkeys(self.groups, 0))
        self.status = LighthouseStatus(self.url, self.token)
        self.progress = LiveProgress(cfg.run_dir)

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FTJOB_")}
        env.update(
            {
                contract.ENV_LIGHTHOUSE_URL: self.url,
                contract.ENV_TOKEN: self.token,
                contract.ENV_REPLICAS: str(self.cfg.replicas),
                contract.ENV_MIN_REPLICAS: str(self.cfg.min_replicas),
                contract.ENV_JOB_NAME: "local",
            }
        )
        return env

    def _train_args(self) -> list[str]:
        c = self.cfg
        args = [
            f"--model={c.model}",
            f"--steps={c.steps}",
            f"--batch-size={c.batch_size}",
            f"--run-dir={c.run_dir}",
            "--log-every=10",
            f"--min-step-seconds={c.min_step_seconds}",
        ]
        if c.checkpoint_every:
            args += [f"--checkpoint-dir={c.run_dir / 'checkpoints'}", f"--checkpoint-every={c.checkpoint_every}"]
        return args + c.extra_train_args

    def _start(self, group: str) -> None:
        c = self.cfg
        self.running[group] = start_group(
            group, self.generation[group], c.pods_per_replica, self._train_args(), self._env(), c.run_dir / "logs"
        )
        self.generation[group] += 1
        self.progress.mark_started(group)

    def _kill(self, group: str) -> None:
        self.running.pop(group).kill()
        self.events.kills.append((time.time(), group))
        self.restart_at[group] = time.monotonic() + self.cfg.restart_delay
        print(f"[launch] SIGKILL group {group}", flush=True)

    def _live(self) -> list[str]:
        return sorted(self.running)

    def _pick_victim(self) -> str | None:
        """A random running group, only if the rest still reach --min-replicas (else the kill waits)."""
        live = [g for g in self._live() if g not in self.finished]
        healthy = [g for g in live if self.progress.contributing_since_start(g)]
        if len(healthy) - 1 < self.cfg.min_replicas:
            return None
        return self.rng.choice(healthy)

    def _reap(self) -> None:
        for group, gp in list(self.running.items()):
            if gp.failed():
                codes = gp.exit_codes()
                gp.kill()
                del self.running[group]
                self.events.crashes.append((time.time(), group, codes))
                if sum(1 for _, g, _ in self.events.crashes if g == group) > self.cfg.max_crashes:
                    raise RuntimeError(
                        f"group {group} exited unexpectedly more than --max-crashes {self.cfg.max_crashes} times "
                        f"(last exit codes {codes}); see {self.cfg.run_dir / 'logs'}"
                    )
                self.restart_at[group] = time.monotonic() + self.cfg.restart_delay
                print(
                    f"[launch] group {group} exited unexpectedly {codes}; restarting in "
                    f"{self.cfg.restart_delay}s (see {self.cfg.run_dir / 'logs'})",
                    flush=True,
                )
            elif gp.all_exited():
                gp.close_logs()
                del self.running[group]
                self.finished.add(group)
                print(f"[launch] group {group} finished", flush=True)

    def _restart_due(self) -> None:
        for group, at in list(self.restart_at.items()):
            if time.monotonic() >= at:
                del self.restart_at[group]
                if self.finished and not self.running:
                    continue  # nobody left to heal from: a restart now could never rejoin
                self.events.restarts[group] += 1
                self._start(group)
                print(f"[launch] restarted group {group} (generation {self.generation[group] - 1})", flush=True)

    def _give_up_stranded(self) -> None:
        """Groups restarted too late: every other group finished and exited, so no quorum can ever form for them."""
        if not self.finished:
            return
        stranded = [g for g in self.running if not self.progress.contributing_since_start(g)]
        if len(self.finished) + len(stranded) == len(self.groups):
            for g in stranded:
                self.running.pop(g).kill()
                self.events.stranded.append(g)
                print(f"[launch] group {g} restarted after the others finished: nobody left to heal from", flush=True)

    def run(self) -> dict[str, Any]:
        c = self.cfg
        # SIGTERM (e.g. a test timeout) must still reach the finally below that kills every child.
        previous_sigterm = signal.signal(signal.SIGTERM, _raise_interrupt)
        c.run_dir.mkdir(parents=True, exist_ok=True)
        lh_env = {**self._env(), contract.ENV_LIGHTHOUSE_BIND: f"127.0.0.1:{self.port}"}
        lh_proc, lh_log = start_lighthouse(
            [f"--bind=127.0.0.1:{self.port}", f"--min-replicas={c.min_replicas}", f"--replicas={c.replicas}"],
            lh_env,
            c.run_dir / "logs" / "lighthouse.log",
        )
        pending_kills = list(c.kill_at)
        next_timed_kill = time.monotonic() + c.kill_every if c.kill_every else None
        deadline = time.monotonic() + c.timeout
        try:
            self.status.wait_healthy(deadline=time.monotonic() + 60, proc=lh_proc)
            for g in self.groups:
                self._start(g)
            print(
                f"[launch] lighthouse {self.url}; {len(self.groups)} groups x {c.pods_per_replica} ranks; "
                f"run dir {c.run_dir}",
                flush=True,
            )
            while len(self.finished) < len(self.groups):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"run did not finish within --timeout {c.timeout}s; logs in {c.run_dir}/logs")
                if lh_proc.poll() is not None:
                    raise RuntimeError(f"the lighthouse exited ({lh_proc.returncode}); see {c.run_dir}/logs")
                self._reap()
                self._restart_due()
                self._give_up_stranded()
                if not self.running and not self.restart_at:
                    break  # everyone that could finish has
                # Asked only while a kill waits for its step: polling the lighthouse's status every 50 ms costs CPU
                # that the groups' training shares on a small machine.
                step = self.status.committed_step(fallback=self.progress.max_step()) if pending_kills else 0
                while pending_kills and step >= pending_kills[0] and (victim := self._pick_victim()):
                    pending_kills.pop(0)
                    self._kill(victim)
                if next_timed_kill and time.monotonic() >= next_timed_kill and (victim := self._pick_victim()):
                    self._kill(victim)
                    next_timed_kill = time.monotonic() + (c.kill_every or 0)
                self.progress.maybe_print(c.steps)
                time.sleep(0.05)  # the poll interval of this supervision loop, not a synchronisation
        finally:
            # A second SIGTERM (e.g. `timeout` forwarding its own) must not cut this cleanup short.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            for gp in self.running.values():
                gp.kill()
            lh_proc.kill()
            lh_proc.wait()
            lh_log.close()
            signal.signal(signal.SIGTERM, previous_sigterm)  # the launcher may run inside a longer-lived process
        report = build_report(c.run_dir, self.events, self.groups, time.time())
        self._write_outputs(report)
        return report

    def _write_outputs(self, report: dict[str, Any]) -> None:
        c = self.cfg
        if c.report:
            c.report.parent.mkdir(parents=True, exist_ok=True)
            c.report.write_text(json.dumps(report, indent=2) + "\n")
            print(f"[launch] report: {c.report}", flush=True)
        if c.timeline:
            from ftjob.trainer.report import group_timeline, read_run_dir
            from ftjob.trainer.timeline import plot_timeline

            records = read_run_dir(c.run_dir)
            tls = [group_timeline(g, records.get(g, [])) for g in self.groups]
            plot_timeline(
                c.timeline,
                tls,
                self.events.t0,
                self.events.kills,
                rejoin_marks(report, self.events),
                title=f"{c.replicas} groups x {c.pods_per_replica} ranks, model {c.model}",
            )
            print(f"[launch] timeline: {c.timeline}", flush=True)


def _raise_interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def summary_ok(report: dict[str, Any]) -> bool:
    s = report["samples"]
    return bool(report["digests_equal"]) and s["dropped"] == 0 and s["duplicated"] == 0


def main(a: argparse.Namespace) -> int:
    cfg = config_from_args(a)
    report = Launcher(cfg).run()
    s = report["samples"]
    print(
        f"[launch] steps {report['steps_committed']}, digests equal: {report['digests_equal']}, samples "
        f"committed {s['committed']} dropped {s['dropped']} duplicated {s['duplicated']}, failures injected "
        f"{report['failures_injected']}, max survivor stall {report['survivor_stall_seconds_max']:.2f}s, "
        f"rejoin {report['rejoin_seconds']}",
        flush=True,
    )
    return 0 if summary_ok(report) else 1
