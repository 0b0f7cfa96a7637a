"""SIGTERM: how a rank learns that its pod is going away (deleted, evicted by a drain, preempted) while the kubelet
still grants it the pod's grace period before SIGKILL.

While a Manager runs, SIGTERM only sets a flag: the rank finishes the step in flight, its group votes to leave with
the step's commit vote (so every rank of the group leaves at the same step boundary, whichever of them was
signalled), tells the lighthouse it is leaving (the survivors' next quorum forms at once without it), and the process
exits with ``contract.EXIT_TERMINATED`` (143). A rank waiting for a quorum leaves at once: that wait is a step
boundary too.

The handler is installed only where the process has none of its own: a handler the training script installed (or a
SIG_IGN it inherited, or one set outside Python) is left alone, and a handler installed after the Manager's replaces
it. Without a running Manager (before the first step, after the last) a SIGTERM does what it would do without
ftjob: the process ends at once with 143 -- also as PID 1 of a container, where the kernel would ignore the default
action. A second SIGTERM changes nothing: the grace period's SIGKILL is the deadline.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

from ftjob import contract


class SigtermWatch:
    """The process's SIGTERM flag and the handler that sets it. ``claim()`` while a Manager runs, ``release()`` when it
    stops; the handler is installed by the first claim (if the process has no handler of its own) and the previous
    one restored by the last release."""

    def __init__(self) -> None:
        self._requested = threading.Event()
        self._claims = 0
        self._lock = threading.Lock()
        self._previous: signal.Handlers | None = None  # what was installed before ours (SIG_DFL), while ours is

    @property
    def installed(self) -> bool:
        """Our handler is the process's SIGTERM handler now."""
        return signal.getsignal(signal.SIGTERM) == self._handler

    def requested(self) -> bool:
        """SIGTERM arrived while our handler was installed."""
        return self._requested.is_set()

    def claim(self) -> bool:
        """A Manager starts: installs the handler unless the process has its own (or this is not the main thread,
        where Python cannot install one). True when SIGTERM now reaches this watch."""
        with self._lock:
            self._claims += 1
            main = threading.current_thread() is threading.main_thread()
            if self._previous is None and main and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
                signal.signal(signal.SIGTERM, self._handler)
                self._previous = signal.SIG_DFL
            return self.installed

    def release(self) -> None:
        """A Manager stopped; after the last one, SIGTERM does its default again (where ours is still installed)."""
        with self._lock:
            self._claims = max(0, self._claims - 1)
            if self._claims or self._previous is None:
                return
            if threading.current_thread() is threading.main_thread() and self.installed:
                signal.signal(signal.SIGTERM, self._previous)
            # (left installed off the main thread, or replaced by the script's: with no claim it acts as the default)
            self._previous = None

    def _handler(self, signum: int, _frame: FrameType | None) -> None:
        if self._claims:
            self._requested.set()  # acted on at the next step boundary (logging here could deadlock)
            return
        # Nobody to leave a job: what SIGTERM would have done. PID 1 of a container ignores the default action.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        raise SystemExit(contract.EXIT_TERMINATED)


WATCH = SigtermWatch()  # the process's: every Manager claims it
