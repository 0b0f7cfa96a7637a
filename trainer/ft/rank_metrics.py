"""Prometheus metrics of one trainer process (one rank), in its own registry.

The Manager feeds them at the step protocol's moments (quorum, heal, commit, the phases it can time itself); a
training loop adds what only it knows (tokens, phases of its own) through ``ftjob.ft.trainer_metrics()`` or
``manager.trainer_metrics``. No job/group/rank labels: Prometheus takes those from the pod's labels (the chart's
PodMonitor). Every rank serves its own on ``FTJOB_METRICS_PORT`` (the operator sets ftjob.contract's
TRAINER_METRICS_PORT); unset or "0": no server unless ``serve(port)`` is called.

Only prometheus_client here (no torch): the cost of a hook is a few lock-protected float additions per step.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from ftjob import contract
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

log = logging.getLogger("ftjob.metrics")

STATES = ("contributing", "spare", "healing")
PHASES = ("quorum", "compute", "allreduce", "commit")  # what the Manager times itself; loops may add more
# Why a step did not commit (bounded label values; the free-text reason goes to the log and manager.last_error)
FAILURE_REASONS = ("collective", "process_group", "heal", "min_replicas", "peer", "guard")
# ftjob.contract.lighthouse_api.GuardKind, and the sketch check's refusals that name nobody (ftjob.ft.integrity.guard)
GUARD_KINDS = ("nonfinite", "norm_outlier", "norm_mismatch", "sketch_mismatch")
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
HEAL_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TOKEN_WINDOW_S = 1.0  # tokens/s is the rate over at least this long (one step's rate is too jittery)


class TrainerMetrics:
    """The trainer's metric families (names are a fixed interface: dashboards query them)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.committed_step = Gauge("ftjob_trainer_committed_step", "Step this rank's group has committed", registry=r)
        self.commits = Counter("ftjob_trainer_commits", "Steps committed", registry=r)
        self.commit_failures = Counter(
            "ftjob_trainer_commit_failures", "Steps that did not commit (trained again)", ["reason"], registry=r
        )
        self.step_seconds = Histogram(
            "ftjob_trainer_step_seconds", "Time from one commit to the next", buckets=STEP_BUCKETS, registry=r
        )
        self.phase_seconds = Histogram(
            "ftjob_trainer_phase_seconds", "Time of one phase of a step", ["phase"], buckets=STEP_BUCKETS, registry=r
        )
        self.tokens = Counter("ftjob_trainer_tokens", "Tokens trained by this rank in committed steps", registry=r)
        self.tokens_per_second = Gauge("ftjob_trainer_tokens_per_second", "Recent training throughput", registry=r)
        self.heals = Counter("ftjob_trainer_heals", "Live recoveries from a peer", registry=r)
        self.heal_seconds = Histogram(
            "ftjob_trainer_heal_seconds", "Duration of one live recovery", buckets=HEAL_BUCKETS, registry=r
        )
        self.heal_bytes = Counter("ftjob_trainer_heal_bytes", "State bytes copied from peers while healing", registry=r)
        self.state = Gauge("ftjob_trainer_state", "1 for this rank's role in the current quorum", ["state"], registry=r)
        self.quorum_size = Gauge("ftjob_trainer_quorum_size", "Groups in the current quorum", registry=r)
        self.quorum_id = Gauge("ftjob_trainer_quorum_id", "Id of the current quorum", registry=r)
        self.lighthouse_reconnects = Counter(
            "ftjob_trainer_lighthouse_reconnects", "Watch re-opened after a lost lighthouse", registry=r
        )
        self.guard_offences = Counter(
            "ftjob_trainer_guard_offences",
            "Groups' gradients the gradient guard refused, as this rank saw them (every group sees every offence)",
            ["kind"],
            registry=r,
        )
        self.digests = Counter("ftjob_trainer_digests", "State digests computed for the replicas' check", registry=r)
        # Label children resolved once: the per-step hooks then skip the label lookup.
        self._states = {s: self.state.labels(s) for s in STATES}
        self._phases: dict[str, Any] = {p: self.phase_seconds.labels(p) for p in PHASES}
        for reason in FAILURE_REASONS:
            self.commit_failures.labels(reason)  # every reason shows up as 0 before it first happens
        for kind in GUARD_KINDS:
            self.guard_offences.labels(kind)
        self._lock = threading.Lock()  # the token window (tokens may come from a data-loading thread)
        self._window_start: float | None = None
        self._window_tokens = 0
        self._state: str | None = None
        self._server: Any = None
        self.port: int | None = None  # where serve() listens

    # --- step protocol events (the Manager calls these) ----------------------------------------------------------
    def quorum_joined(self, quorum_id: int, size: int, state: str) -> None:
        """A quorum formed: its id, its size and this rank's role in it."""
        self.quorum_id.set(quorum_id)
        self.quorum_size.set(size)
        self.set_state(state)

    def set_state(self, state: str) -> None:
        """This rank's role now (one of STATES); ValueError for any other."""
        if state not in self._states:
            raise ValueError(f"state {state!r} is not one of {STATES}")
        if state == self._state:
            return  # the usual step: same role as the last one
        for name, child in self._states.items():
            child.set(1 if name == state else 0)
        self._state = state

    def healed(self, seconds: float, nbytes: int) -> None:
        """This rank healed from a peer: how long it took and how many state bytes it copied."""
        self.heals.inc()
        self.heal_seconds.observe(seconds)
        self.heal_bytes.inc(nbytes)

    def committed(
        self, step: int, step_seconds: float | None = None, phases: Mapping[str, float] | None = None
    ) -> None:
        """A step committed: the step reached, the step's duration and where its time went, when known."""
        self.commits.inc()
        self.committed_step.set(step)
        if step_seconds is not None:
            self.step_seconds.observe(step_seconds)
        if phases:
            for name, seconds in phases.items():
                self.observe_phase(name, seconds)

    def commit_failed(self, reason: str) -> None:
        """A step did not commit, for ``reason`` (one of FAILURE_REASONS)."""
        self.commit_failures.labels(reason).inc()

    def lighthouse_reconnected(self) -> None:
        """The watch socket re-opened after a lost lighthouse."""
        self.lighthouse_reconnects.inc()

    def guard_offence(self, kind: str) -> None:
        """The gradient guard refused a group's gradients (``kind``: the rule that refused it)."""
        self.guard_offences.labels(kind).inc()

    def digested(self) -> None:
        """This rank computed a state digest for the replicas' check."""
        self.digests.inc()

    # --- what a training loop adds -------------------------------------------------------------------------------
    def observe_phase(self, phase: str, seconds: float) -> None:
        """``seconds`` spent in the step phase ``phase`` (a new phase name gets its own series)."""
        child = self._phases.get(phase)
        if child is None:
            child = self._phases[phase] = self.phase_seconds.labels(phase)
        child.observe(seconds)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """``with metrics.phase("data"): ...`` times a phase of your own loop."""
        start = time.monotonic()
        try:
            yield
        finally:
            self.observe_phase(name, time.monotonic() - start)

    def add_tokens(self, n: int) -> None:
        """Tokens this rank trained in a committed step; also moves the tokens/s gauge."""
        self.tokens.inc(n)
        now = time.monotonic()
        with self._lock:
            if self._window_start is None:  # the first batch's tokens were trained before any window began
                self._window_start = now
                return
            self._window_tokens += n
            elapsed = now - self._window_start
            if elapsed >= TOKEN_WINDOW_S:
                self.tokens_per_second.set(self._window_tokens / elapsed)
                self._window_start, self._window_tokens = now, 0

    # --- exposition ----------------------------------------------------------------------------------------------
    def render(self) -> bytes:
        """The registry in Prometheus' text format (what /metrics serves)."""
        return generate_latest(self.registry)

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serves /metrics on ``port`` (idempotent: a second call returns the first port)."""
        if self._server is None:
            self._server, _thread = start_http_server(port, addr=addr, registry=self.registry)
            self.port = int(self._server.server_port)
        assert self.port is not None
        return self.port

    def serve_from_env(self, environ: Mapping[str, str] | None = None) -> int | None:
        """Serves on FTJOB_METRICS_PORT if set and nonzero; a port in use is logged, never fatal to training."""
        raw = (os.environ if environ is None else environ).get(contract.ENV_METRICS_PORT, "").strip()
        try:
            port = int(raw or 0)
        except ValueError:
            log.warning("%s=%r is not a port: no metrics server", contract.ENV_METRICS_PORT, raw)
            return None
        if port <= 0:
            return None
        try:
            return self.serve(port)
        except OSError as e:
            log.warning("trainer metrics not served on port %d: %s", port, e)
            return None

    def close(self) -> None:
        """Stops the /metrics server, if one runs."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server, self.port = None, None


class DisabledTrainerMetrics(TrainerMetrics):
    """Records nothing (FTJOB_METRICS_DISABLED=1): the baseline hack/bench/bench_trainer.py measures the hooks
    against. The families still exist, empty, so a loop's own calls need no guard."""

    def quorum_joined(self, quorum_id: int, size: int, state: str) -> None:
        """Records nothing."""
        pass

    def healed(self, seconds: float, nbytes: int) -> None:
        """Records nothing."""
        pass

    def committed(
        self, step: int, step_seconds: float | None = None, phases: Mapping[str, float] | None = None
    ) -> None:
        """Records nothing."""
        pass

    def commit_failed(self, reason: str) -> None:
        """Records nothing."""
        pass

    def lighthouse_reconnected(self) -> None:
        """Records nothing."""
        pass

    def guard_offence(self, kind: str) -> None:
        """Records nothing."""
        pass

    def digested(self) -> None:
        """Records nothing."""
        pass

    def observe_phase(self, phase: str, seconds: float) -> None:
        """Records nothing."""
        pass

    def add_tokens(self, n: int) -> None:
        """Records nothing."""
        pass

    def serve_from_env(self, environ: Mapping[str, str] | None = None) -> int | None:
        """Serves nothing: returns None."""
        return None


_default: TrainerMetrics | None = None
_default_lock = threading.Lock()


def trainer_metrics() -> TrainerMetrics:
    """This process's TrainerMetrics (the one the Manager feeds unless it was given another)."""
    global _default
    with _default_lock:
        if _default is None:
            off = os.environ.get(contract.ENV_METRICS_DISABLED, "").strip().lower() in ("1", "true", "yes")
            _default = DisabledTrainerMetrics() if off else TrainerMetrics()
        return _default
