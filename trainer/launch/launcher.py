"""``ftjob-trainer launch``: a lighthouse plus N groups x M ranks as local processes on loopback, with faults.

Every rank runs the training command (the reference GPT trainer unless one follows ``--``) with the environment the
operator gives pods (ftjob.contract), plus ``FTJOB_RUN_DIR`` for its run records. The launcher restarts a dead group
after ``--restart-delay`` and injects faults: ``--kill-at`` SIGKILLs a random live group when the job's committed step
(the lighthouse's status) reaches each given step, ``--kill-every`` does so on a timer. It never kills below
``--min-replicas`` live groups (the kill waits), so the job keeps committing. ``--inject-fault`` makes one group
misbehave (FTJOB_FAULT_INJECTION, ftjob.ft.integrity.fault_injection; each start of a group gets FTJOB_GENERATION 0, 1,
..., and only generation 0 injects); a group the lighthouse evicts exits and is restarted like any other (the report
says why in ``evictions``, with the lighthouse's final integrity counts and audit records). At the end it checks the
groups' records (equal final parameters, every sample trained once) and writes ``--report`` / ``--timeline``.
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import signal
import time
from pathlib import Path
from typing import Any

from ftjob import contract
from ftjob.contract import pki
from ftjob.contract.tls import client_context
from ftjob.ft.records import read_run_dir
from ftjob.launch.config import LaunchConfig, config_from_args, reference_trainer_command
from ftjob.launch.procs import GroupProcs, free_port, start_group, start_lighthouse
from ftjob.launch.report import LaunchEvents, LaunchReport, build_report, rejoin_marks
from ftjob.launch.run_records import group_timeline
from ftjob.launch.status import LighthouseStatus, LiveProgress


class LaunchFailure(RuntimeError):
    """The launcher gives the run up: restarting cannot help. The report is still written, with this as its failure;
    ``details`` (e.g. a failing rank's last lines) are printed, not reported."""

    def __init__(self, message: str, details: list[str] | None = None) -> None:
        super().__init__(message)
        self.details = details or []


class Launcher:
    """Runs one local job to the end; ``run()`` returns its report."""

    def __init__(self, cfg: LaunchConfig) -> None:
        self.cfg = cfg
        self.groups = [str(i) for i in range(cfg.replicas + cfg.spares)]
        self.token = secrets.token_hex(16)
        # the launcher plays the operator: its own token, given to the lighthouse only (never to a group's process),
        # as the operator's Secret is mounted in the lighthouse pod only
        self.operator_token = secrets.token_hex(16)
        self.port = free_port()
        self.url = f"{'https' if cfg.tls else 'http'}://127.0.0.1:{self.port}"
        self.tls_files = self._issue_tls() if cfg.tls else {}
        self.rng = random.Random(cfg.seed)
        self.running: dict[str, GroupProcs] = {}
        self.restart_at: dict[str, float] = {}
        self.finished: set[str] = set()
        self.generation = dict.fromkeys(self.groups, 0)
        self.events = LaunchEvents(t0=time.time(), restarts=dict.fromkeys(self.groups, 0))
        ca = self.tls_files.get(pki.CA_CERT)
        self.status = LighthouseStatus(self.url, self.operator_token, client_context(str(ca)) if ca else None)
        self.progress = LiveProgress(cfg.run_dir)
        self.failed_before_any_commit: dict[str, list[str]] = {}  # group -> its failing rank's last lines
        self.killed: set[str] = set()  # groups whose last death was an injected kill (not a crash of their own)

    def _issue_tls(self) -> dict[str, Path]:
        """A throwaway CA for this run: the lighthouse's certificate names loopback, the workers' the job's worker
        name (job "local", namespace "default": the contract's defaults)."""
        files = pki.issue_job("local", "default", ["localhost"], ["127.0.0.1"])
        return pki.write_files(self.cfg.run_dir / "tls", files)

    def _env(self) -> dict[str, str]:
        c = self.cfg
        env = {k: v for k, v in os.environ.items() if not k.startswith("FTJOB_")}
        env.update(
            {
                contract.ENV_LIGHTHOUSE_URL: self.url,
                contract.ENV_TOKEN: self.token,
                contract.ENV_REPLICAS: str(c.replicas),
                contract.ENV_MIN_REPLICAS: str(c.min_replicas),
                contract.ENV_JOB_NAME: "local",
                contract.ENV_RUN_DIR: str(c.run_dir),
                contract.ENV_MIN_STEP_SECONDS: str(c.min_step_seconds),
            }
        )
        if self.tls_files:
            env[contract.ENV_TLS_CA_FILE] = str(self.tls_files[pki.CA_CERT])
            env[contract.ENV_TLS_CERT_FILE] = str(self.tls_files[pki.WORKER_CERT])
            env[contract.ENV_TLS_KEY_FILE] = str(self.tls_files[pki.WORKER_KEY])
        if c.inject_fault:
            env[contract.ENV_FAULT_INJECTION] = c.inject_fault
        if c.digest_every is not None:
            env[contract.ENV_DIGEST_EVERY] = str(c.digest_every)
        if c.checkpoint_every and c.command:  # the reference trainer gets them as flags
            env[contract.ENV_CHECKPOINT_DIR] = str(c.run_dir / "checkpoints")
            env[contract.ENV_CHECKPOINT_EVERY] = str(c.checkpoint_every)
        return env

    def _lighthouse(self) -> tuple[list[str], dict[str, str]]:
        """The lighthouse's flags and environment, as the operator gives its pod: the groups' env plus the operator's
        token (which no group's process gets) and the group ids it runs (any other is refused)."""
        c = self.cfg
        args = [f"--bind=127.0.0.1:{self.port}", f"--min-replicas={c.min_replicas}", f"--replicas={c.replicas}",
                f"--groups={len(self.groups)}"]  # fmt: skip
        env = {
            **self._env(),
            contract.ENV_LIGHTHOUSE_BIND: f"127.0.0.1:{self.port}",
            contract.ENV_OPERATOR_TOKEN: self.operator_token,
        }
        if self.tls_files:  # the lighthouse presents its own certificate, not the workers'
            env[contract.ENV_TLS_CERT_FILE] = str(self.tls_files[pki.LIGHTHOUSE_CERT])
            env[contract.ENV_TLS_KEY_FILE] = str(self.tls_files[pki.LIGHTHOUSE_KEY])
        return args, env

    @property
    def group_env(self) -> dict[str, str]:
        """The environment every group's ranks start with (a fresh copy: changing it changes no launch)."""
        return self._env()

    @property
    def lighthouse_launch(self) -> tuple[list[str], dict[str, str]]:
        """The lighthouse's flags and environment, as the launcher starts it (fresh copies)."""
        return self._lighthouse()

    def _start(self, group: str) -> None:
        c = self.cfg
        command = c.command or reference_trainer_command(c)
        self.running[group] = start_group(
            group, self.generation[group], c.pods_per_replica, command, self._env(), c.run_dir / "logs"
        )
        self.generation[group] += 1
        self.progress.mark_started(group)

    def _kill(self, group: str) -> None:
        self.running.pop(group).kill()
        self.killed.add(group)
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
                self.killed.discard(group)
                evicted = self.status.eviction_since(group, self.progress.last_start.get(group, 0.0))
                if evicted is not None:  # the lighthouse dropped it and its process exited on the 410
                    self.events.evictions.append((time.time(), group, evicted))
                    print(f"[launch] group {group} was evicted by the lighthouse: {evicted}", flush=True)
                self._give_up_if_every_group_fails_alike(group, gp)
                if sum(1 for _, g, _ in self.events.crashes if g == group) > self.cfg.max_crashes:
                    raise LaunchFailure(
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

    def _give_up_if_every_group_fails_alike(self, group: str, gp: GroupProcs) -> None:
        """Before the job's first commit, every group exited ending with the same line: a broken script or
        environment, which no restart fixes (a rank's last line, e.g. the exception, says what is wrong)."""
        if self.progress.max_step() > 0:
            return  # the job trained: a crash now is a fault, not the setup
        tails = self.failed_before_any_commit
        tails[group] = gp.error_tail()
        if set(tails) != set(self.groups) or len({tuple(t[-1:]) for t in tails.values()}) != 1:
            return
        tail = tails[self.groups[0]]
        raise LaunchFailure(
            f"every group failed the same way before the first step: {tail[-1] if tail else '(no output)'}",
            [f"group {self.groups[0]}'s last lines:", *(f"    {line}" for line in tail)],
        )

    def _restart_due(self) -> None:
        for group, at in list(self.restart_at.items()):
            if time.monotonic() >= at:
                del self.restart_at[group]
                if self.finished and not self.running:  # nobody left to heal from: a restart could never rejoin
                    self._leave_out(group, "not restarted: every other group has finished")
                    continue
                self.events.restarts[group] += 1
                self._start(group)
                print(f"[launch] restarted group {group} (generation {self.generation[group] - 1})", flush=True)

    def _give_up_stranded(self) -> None:
        """Groups restarted too late: every other group finished and exited, so no quorum can ever form for them; the
        job is done without them."""
        if not self.finished:
            return
        stranded = [g for g in self.running if not self.progress.contributing_since_start(g)]
        if len(self.finished) + len(stranded) == len(self.groups):
            for g in stranded:
                self.running.pop(g).kill()
                self._leave_out(g, "stopped: it restarted after the others finished")

    def _leave_out(self, group: str, what: str) -> None:
        """The run ends without ``group``: not needed if the launcher killed it, a failure if it crashed itself."""
        if group in self.killed:
            self.events.not_needed.append(group)
        print(f"[launch] group {group} {what} ({'not needed' if group in self.killed else 'it did not finish'})",
              flush=True)  # fmt: skip

    def run(self) -> LaunchReport:
        c = self.cfg
        # SIGTERM (e.g. a test timeout) must still reach the finally below that kills every child.
        previous_sigterm = signal.signal(signal.SIGTERM, _raise_interrupt)
        c.run_dir.mkdir(parents=True, exist_ok=True)
        lh_proc, lh_log = start_lighthouse(*self._lighthouse(), c.run_dir / "logs" / "lighthouse.log")
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
                    raise LaunchFailure(f"the lighthouse exited ({lh_proc.returncode}); see {c.run_dir}/logs")
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
            self.events.lighthouse = self.status.status()  # its integrity counts and audit, for the report
        except LaunchFailure as e:
            self.events.failure = str(e)
            print("\n".join([f"[launch] giving up: {e}", *e.details]), flush=True)
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

    def _write_outputs(self, report: LaunchReport) -> None:
        c = self.cfg
        if c.report:
            c.report.parent.mkdir(parents=True, exist_ok=True)
            c.report.write_text(report.model_dump_json(indent=2) + "\n")
            print(f"[launch] report: {c.report}", flush=True)
        if c.timeline:
            from ftjob.launch.timeline import plot_timeline  # matplotlib: only when a plot is asked for

            records = read_run_dir(c.run_dir)
            tls = [group_timeline(g, records.get(g, [])) for g in self.groups]
            plot_timeline(
                c.timeline,
                tls,
                self.events.t0,
                self.events.kills,
                rejoin_marks(report, self.events),
                title=c.title,
            )
            print(f"[launch] timeline: {c.timeline}", flush=True)


def _raise_interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(a: argparse.Namespace, command: list[str]) -> int:
    cfg = config_from_args(a, command)
    report = Launcher(cfg).run()
    s = report.samples
    print(
        f"[launch] steps {report.steps_committed}, digests equal: {report.digests_equal}, samples "
        f"committed {s.committed} dropped {s.dropped} duplicated {s.duplicated}, failures injected "
        f"{report.failures_injected}, max survivor stall {report.survivor_stall_seconds_max:.2f}s, "
        f"rejoin {report.rejoin_seconds}",
        flush=True,
    )
    if report.not_needed_groups:
        print(f"[launch] finished without groups {report.not_needed_groups}: killed, and back only after the others "
              "had finished (a longer run gives them time to rejoin)", flush=True)  # fmt: skip
    print(f"[launch] {'OK' if report.ok else 'FAILED: ' + '; '.join(report.problems)}", flush=True)
    return 0 if report.ok else 1
