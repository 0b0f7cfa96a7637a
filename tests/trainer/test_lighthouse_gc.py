"""The lighthouse process's garbage-collector pacing (ftjob.lighthouse.gc_pacing): the rule as pure logic, CPython's
freeze semantics it relies on (in a fresh interpreter), and a real lighthouse process running it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

import aiohttp
from ftjob import contract
from ftjob.lighthouse.gc_pacing import GcPacer

from tests.support.local_job import TOKEN, Lighthouse
from tests.support.polling import wait_for


class Collector:
    """Records what the pacer asks of the ``gc`` module (a stand-in for this pure-logic test)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def freeze(self) -> None:
        self.calls.append("freeze")

    def unfreeze(self) -> None:
        self.calls.append("unfreeze")

    def collect(self) -> int:
        self.calls.append("collect")
        return 0

    def take(self) -> list[str]:
        calls, self.calls = self.calls, []
        return calls


FULL = ["unfreeze", "collect", "freeze"]


def test_the_pacer_freezes_every_tick_and_collects_fully_only_when_memory_per_connection_grows_or_ages():
    gc, heap, conns, pauses, ticks = Collector(), [100], [0], [], []
    pacer = GcPacer(gc, full_growth=0.25, full_max_s=900, heap_size=lambda: heap[0], connections=lambda: conns[0],
                    on_full=pauses.append, on_tick=lambda: ticks.append(1))  # fmt: skip
    pacer.tick(0)
    assert gc.take() == FULL, "the first tick collects fully (and sets the baseline)"
    for t, (size, n) in enumerate([(150, 100), (300, 1000), (900, 12_500), (900, 12_500)], start=1):
        heap[0], conns[0] = size, n
        pacer.tick(t)
        assert gc.take() == ["freeze"], f"groups connecting grow the heap with live objects (tick {t}): no full"
    conns[0] = 9_000  # a quarter of the groups left: their connections' cycles are garbage now
    pacer.tick(10)
    assert gc.take() == FULL
    pacer.tick(11)
    assert gc.take() == ["freeze"], "the baseline moved to the memory per connection after that collection"
    heap[0] = 1_200  # memory grew 33% with no connection more: something leaked
    pacer.tick(12)
    assert gc.take() == FULL
    for t in (13, 500, 911):
        pacer.tick(t)
        assert gc.take() == ["freeze"]
    pacer.tick(912)
    assert gc.take() == FULL, "at least every full_max_s: cycles frozen before they became garbage are freed"
    assert len(pauses) == 4 and all(p >= 0 for p in pauses), "each full collection is reported (CPU seconds)"
    assert len(ticks) == 12, "every tick is reported"


# Run in a fresh interpreter: freezing is process-wide, and pytest's own objects are none of this test's business.
FREEZE_SEMANTICS = textwrap.dedent("""
    import gc, weakref
    from ftjob.lighthouse.gc_pacing import GcPacer

    class Node:
        pass

    conns = [1]
    pacer = GcPacer(heap_size=lambda: 1000, connections=lambda: conns[0])
    pacer.tick(0)
    plain, cyclic = Node(), Node()
    cyclic.me = cyclic
    plain_ref, cyclic_ref = weakref.ref(plain), weakref.ref(cyclic)
    pacer.tick(1)  # both frozen now
    assert gc.get_freeze_count() > 0
    del plain, cyclic
    assert plain_ref() is None, "a frozen object is still freed by reference counting"
    gc.collect()
    assert cyclic_ref() is not None, "a frozen cycle is not scanned, not even by a full gc.collect()"
    pacer.tick(2)
    assert cyclic_ref() is not None, "no growth and not aged: no full collection"
    conns[0] = 0  # its connection closed: memory per connection doubled
    pacer.tick(3)
    assert cyclic_ref() is None, "the pacer's full collection frees frozen cycles"
    assert gc.get_freeze_count() > 0, "and freezes what is alive again"
    print("ok")
""")


def test_frozen_objects_are_freed_by_reference_counting_and_frozen_cycles_by_the_next_full_collection():
    done = subprocess.run([sys.executable, "-c", FREEZE_SEMANTICS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


YOUNG_PACING = textwrap.dedent("""
    import asyncio, gc
    from ftjob.lighthouse.gc_pacing import YOUNG_THRESHOLD, GcPacer

    older = gc.get_threshold()[1:]
    ticked = asyncio.Event()

    async def main():
        pacing = asyncio.create_task(GcPacer(freeze_s=0.01, on_tick=ticked.set).run())
        await asyncio.wait_for(ticked.wait(), 60)
        pacing.cancel()

    asyncio.run(main())
    assert gc.get_threshold() == (YOUNG_THRESHOLD, *older), gc.get_threshold()
    assert YOUNG_THRESHOLD > 700 * 100, "a round's objects die before a young collection scans them"
    print("ok")
""")


def test_the_pacing_process_collects_its_young_generation_far_less_often_than_cpython_does():
    done = subprocess.run([sys.executable, "-c", YOUNG_PACING], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def metric(lh: Lighthouse, name: str) -> float:
    _code, text = lh.request("GET", contract.PATH_METRICS)
    lines = [line for line in str(text).splitlines() if line.startswith(name + " ")]
    return float(lines[0].split()[-1]) if lines else 0.0


def full_collections(lh: Lighthouse) -> float:
    return metric(lh, "ftjob_lighthouse_gc_full_seconds_count")


async def _open_then_close_watch_sockets(lh: Lighthouse, groups: int) -> None:
    """Opens the sockets, lets the pacer see them open (two ticks), then closes them all."""
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as session:
        sockets = []
        for g in range(groups):
            query = {"group": str(g), "incarnation": f"inc-{g}", "rank": "0"}
            sockets.append(await session.ws_connect(lh.url + contract.PATH_WATCH, params=query))
            await sockets[-1].receive_str(timeout=10)  # the hello: the lighthouse counts this socket open
        ticks = metric(lh, "ftjob_lighthouse_gc_ticks_total")
        # waited for in a thread: this event loop keeps the sockets open meanwhile
        await asyncio.to_thread(wait_for, lambda: metric(lh, "ftjob_lighthouse_gc_ticks_total") >= ticks + 2, 30,
                                "the pacer to tick twice while the sockets were open", 0.05)  # fmt: skip
        for ws in sockets:
            await ws.close()


def test_the_lighthouse_process_collects_fully_at_start_and_once_its_connections_closed(tmp_path: Path):
    lh = Lighthouse(tmp_path, "--min-replicas", "1", "--heartbeat-timeout", "30").start()
    try:
        wait_for(lambda: full_collections(lh) >= 1, 30, "the first full collection (the pacer's first tick)")
        before = full_collections(lh)
        asyncio.run(_open_then_close_watch_sockets(lh, 20))
        wait_for(lambda: full_collections(lh) > before, 30, "a full collection once 20 connections closed")
    finally:
        lh.kill()
