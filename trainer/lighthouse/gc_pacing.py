"""The lighthouse process's cyclic garbage collector, paced for a large heap of long-lived objects.

At the scale the lighthouse is built for (12,500 groups) it holds a very large number of GC-tracked objects that live
as long as their connection, and every round adds a few per group that live about one round (the pending request, its
waiter). Those survive two young collections, so CPython promotes them to its oldest generation, and its rule then
runs a full collection each time that generation grew by a quarter: every few rounds, each one scanning every
connection's objects on the lighthouse's one core -- a pause inside a round, long enough to cost the round or abort
it. Yet those objects are freed by reference counting: only reference cycles need the collector, and the lighthouse
makes few.

So the lighthouse process freezes what is alive every FREEZE_S (``gc.freeze``: the collector stops scanning it,
reference counting still frees it), which keeps the collector's own generations small. Frozen cycles that become
garbage (a closed connection's objects) wait for a full collection over everything (unfreeze, collect, freeze),
which runs when the memory per open connection grew by FULL_GROWTH over its lowest since the last one -- connections
closed, or something leaked -- or FULL_MAX_S passed. Memory per connection, not the heap alone: while the groups
connect, the heap grows with live connections and no full collection is needed (a rule on the heap alone, as
CPython's, would run full collections over and over while the groups connect). Memory is the process's peak resident
memory (getrusage: one cheap system call; counting the frozen objects would visit every one of them).

Young collections are paced too: a quorum request's objects (its validated model, its waiter) live until the round
ends, so with CPython's default threshold (a collection every 700 allocations) each would be scanned by several young
collections before the next freeze. With YOUNG_THRESHOLD a collection runs about once a round and most of a round's
objects are freed by reference counting before it, while the young generation stays bounded (YOUNG_THRESHOLD
allocations). hack/bench/bench_controlplane.py measures the effect.

Only the lighthouse's own process runs this (ftjob.lighthouse.cli): a server built inside another program leaves
that program's collector alone.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import resource
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("ftjob.lighthouse")
FREEZE_S = 1.0  # how often what is alive is frozen (gc.freeze is O(1): it moves lists, it scans nothing)
FULL_GROWTH = 0.25  # a full collection once the memory per open connection grew by this fraction over its lowest
FULL_MAX_S = 900.0  # and at least this often: frozen cycles that became garbage are freed at the latest then
YOUNG_THRESHOLD = 100_000  # allocations between young collections (CPython's default: 700)


class GcPacer:
    """Freezes the heap every ``freeze_s`` and collects it fully on growth or age (see the module doc). ``collector``
    is the ``gc`` module, ``heap_size`` the process's memory and ``connections`` how many are open (a unit test passes
    stand-ins); ``on_full(seconds)`` reports each full collection's CPU seconds, ``on_tick()`` each tick."""

    def __init__(
        self,
        collector: Any = gc,
        freeze_s: float = FREEZE_S,
        full_growth: float = FULL_GROWTH,
        full_max_s: float = FULL_MAX_S,
        heap_size: Callable[[], int] = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        connections: Callable[[], int] = lambda: 0,
        on_full: Callable[[float], None] | None = None,
        on_tick: Callable[[], None] | None = None,
    ) -> None:
        self._gc, self.freeze_s, self.full_growth, self.full_max_s = collector, freeze_s, full_growth, full_max_s
        self._heap_size, self._connections, self._on_full, self._on_tick = heap_size, connections, on_full, on_tick
        self._lowest = float("inf")  # the lowest memory per connection since the last full collection
        self._next_full = -float("inf")  # the first tick collects

    def tick(self, now: float) -> None:
        """Freezes what is alive now; first collects everything if the memory per connection grew enough or the
        last full collection is ``full_max_s`` old."""
        per_connection = self._per_connection()
        self._lowest = min(self._lowest, per_connection)
        if now >= self._next_full or per_connection > self._lowest * (1 + self.full_growth):
            self._collect_fully(now)
        else:
            self._gc.freeze()
        if self._on_tick is not None:
            self._on_tick()

    def _collect_fully(self, now: float) -> None:
        started = time.process_time()
        self._gc.unfreeze()
        freed = self._gc.collect()
        self._gc.freeze()
        seconds = time.process_time() - started
        self._lowest, self._next_full = self._per_connection(), now + self.full_max_s
        log.info("full garbage collection: %d objects unreachable, %d connections open, %.0f ms of CPU",
                 freed, self._connections(), seconds * 1e3)  # fmt: skip
        if self._on_full is not None:
            self._on_full(seconds)

    def _per_connection(self) -> float:
        return self._heap_size() / (1 + self._connections())

    async def run(self) -> None:
        """Ticks every ``freeze_s`` until cancelled (a failed tick is logged: the lighthouse serves on)."""
        loop = asyncio.get_running_loop()
        self._gc.set_threshold(YOUNG_THRESHOLD)  # the older generations' thresholds stay CPython's
        while True:
            await asyncio.sleep(self.freeze_s)
            try:
                self.tick(loop.time())
            except Exception:
                log.exception("garbage collector pacing failed")
