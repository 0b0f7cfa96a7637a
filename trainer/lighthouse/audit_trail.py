"""The lighthouse's audit trail: one JSON object per line (an ``AuditRecord``: seq, time, wall_time, kind, group,
actor, reason, outcome) for every membership change, refused request and integrity verdict.

Lines go to the logger ``ftjob.audit`` (``configure_audit_logging``: stderr, the bare JSON whatever the normal log
format) and, with a file path, are appended to that file too. ``seq`` increases from 1 in this lighthouse's life;
``time`` is the lighthouse's clock (that of the status history), ``wall_time`` unix time.

Folding, so a flood of refused requests floods neither the log nor the status:
  * log: the first refusal of a kind (its outcome, e.g. "refused 401") from a peer address is written at once and
    opens a ``FOLD_WINDOW_S`` window; further ones from that peer within it are only counted, and when the window
    ends one line says how many there were ("refused 401 (x37 more from 10.0.0.9 in the last 5s)", the last one's
    reason) and opens the next window; a peer that stopped gets no more lines. Beyond ``MAX_FOLDS`` peers at once,
    new peers share one fold per kind ("many peers").
  * status: the ring (``ring()``, the newest ``RING_LEN`` job-level records, oldest first) takes every guard,
    divergence and evict record, and at most one refusal line per kind per ``RING_REFUSAL_INTERVAL_S``.
The ``audit_records`` counter counts every audited event, folded refusals one by one.
"""

from __future__ import annotations

import collections
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

from ftjob.contract.lighthouse_api import AuditKind, AuditRecord
from prometheus_client import Counter

AUDIT_LOGGER = "ftjob.audit"
FOLD_WINDOW_S = 5.0
MAX_FOLDS = 4096
RING_LEN = 100
RING_REFUSAL_INTERVAL_S = 60.0
JOB_LEVEL: frozenset[str] = frozenset({"guard", "divergence", "evict"})

log = logging.getLogger("ftjob.lighthouse")


def configure_audit_logging(stream: IO[str] | None = None) -> logging.Logger:
    """The audit logger writes the bare JSON line to stderr and not through the root logger's format (idempotent)."""
    logger = logging.getLogger(AUDIT_LOGGER)
    if not any(getattr(h, "_ftjob_audit", False) for h in logger.handlers):
        handler = logging.StreamHandler(stream or sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler._ftjob_audit = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger


@dataclass
class _Fold:
    until: float  # the window ends then
    count: int = 0  # refusals since the last line
    last: tuple[str | None, str, str] = (None, "", "")  # the newest one's group, actor, reason


class AuditTrail:
    def __init__(
        self,
        path: str | None = None,
        counter: Counter | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._logger = logging.getLogger(AUDIT_LOGGER)
        self._file = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115 (open for the lighthouse's life)
        self._file_failed = False
        self._counter = counter
        self._wall_clock = wall_clock
        self._seq = 0
        self._ring: collections.deque[AuditRecord] = collections.deque(maxlen=RING_LEN)
        self._ring_refused_at: dict[str, float] = {}  # refusal kind -> when one last entered the ring
        self._folds: collections.OrderedDict[tuple[str, str], _Fold] = collections.OrderedDict()  # by window end

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def ring(self) -> list[AuditRecord]:
        return list(self._ring)

    def record(
        self, now: float, kind: AuditKind, actor: str, reason: str, outcome: str, group: str | None = None
    ) -> AuditRecord:
        """Writes one record at once (membership changes and verdicts are never folded)."""
        self._count(kind)
        record = self._write(now, kind, actor, reason, outcome, group)
        if kind in JOB_LEVEL:
            self._ring.append(record)
        return record

    def refused(self, now: float, peer: str, outcome: str, actor: str, reason: str, group: str | None = None) -> None:
        """A refused (or ignored) request from ``peer``; ``outcome`` names the kind ("refused 401"). Folded."""
        self._count("refused")
        self.flush(now)
        key = (peer, outcome)
        if key not in self._folds and len(self._folds) >= MAX_FOLDS:
            key = ("many peers", outcome)
        fold = self._folds.get(key)
        if fold is not None:
            fold.count += 1
            fold.last = (group, actor, reason)
            return
        self._folds[key] = _Fold(until=now + FOLD_WINDOW_S)
        self._refusal_line(now, outcome, actor, reason, group)

    def flush(self, now: float) -> None:
        """Ends the fold windows that are over: one line for each that counted refusals (cheap when none is due)."""
        while self._folds:
            key, fold = next(iter(self._folds.items()))
            if fold.until > now:
                return
            del self._folds[key]
            if fold.count:
                group, actor, reason = fold.last
                outcome = f"{key[1]} (x{fold.count} more from {key[0]} in the last {FOLD_WINDOW_S:g}s)"
                self._refusal_line(now, outcome, actor, reason, group)
                self._folds[key] = _Fold(until=now + FOLD_WINDOW_S)  # a flood goes on: one line per window

    # --- internals -----------------------------------------------------------------------------------------------
    def _refusal_line(self, now: float, outcome: str, actor: str, reason: str, group: str | None) -> None:
        record = self._write(now, "refused", actor, reason, outcome, group)
        kind = outcome.split(" (x", 1)[0]
        last = self._ring_refused_at.get(kind)
        if last is None or now - last >= RING_REFUSAL_INTERVAL_S:
            self._ring_refused_at[kind] = now
            self._ring.append(record)

    def _count(self, kind: str) -> None:
        if self._counter is not None:
            self._counter.labels(kind).inc()

    def _write(
        self, now: float, kind: AuditKind, actor: str, reason: str, outcome: str, group: str | None
    ) -> AuditRecord:
        self._seq += 1
        record = AuditRecord(
            seq=self._seq,
            time=round(now, 6),
            wall_time=round(self._wall_clock(), 6),
            kind=kind,
            group=group,
            actor=actor,
            reason=reason[:1024],
            outcome=outcome,
        )
        line = record.model_dump_json()
        self._logger.info(line)
        if self._file is not None:
            try:
                self._file.write(line + "\n")
                self._file.flush()
            except OSError as e:  # keep serving: the trail still goes to stderr
                if not self._file_failed:
                    log.warning("cannot append to the audit file (%s); audit lines go to stderr only", e)
                self._file_failed = True
        return record
