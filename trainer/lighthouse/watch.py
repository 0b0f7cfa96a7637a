"""The watch sockets at scale: the heartbeat period the lighthouse asks its groups for, and writing one frame to
thousands of sockets without a task per socket.

Heartbeat pace: every rank 0 beats on its watch socket; at 12,500 groups the client's default 0.1 s would be 125,000
frames/s, several times what one Python lighthouse core receives. The lighthouse therefore tells the groups (in the
hello frame, and again when it changes) to beat every ``interval(groups)``: MIN_INTERVAL_S for a small job (as
before), doubled while the total rate would exceed HEARTBEATS_PER_S, but never longer than a 1/TIMEOUT_BEATS of the
heartbeat timeout (liveness first: a group is still heard TIMEOUT_BEATS times per timeout). Powers of two and a
hysteresis keep pushes (O(groups) each) rare while groups come and go.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Generator
from typing import Any

from aiohttp import WSMsgType, web

log = logging.getLogger("ftjob.lighthouse")

MIN_INTERVAL_S = 0.1  # LighthouseClient's default: a job of up to HEARTBEATS_PER_S / 10 groups beats as before
# The total rank-0 heartbeat rate a lighthouse asks for: hack/bench/bench_controlplane.py measured ~30 us of its
# core per heartbeat frame (aiohttp's frame handling is most of it), so 10,000/s take about a third of the core
# and leave the rest to quorum rounds (21,000/s took 63% and the rounds missed their goal).
HEARTBEATS_PER_S = 10_000
# heartbeats per heartbeat timeout, at least: three lost or late in a row never drop a group (and every quorum
# request, once per step, refreshes a group's liveness too)
TIMEOUT_BEATS = 4


class HeartbeatPace:
    """The heartbeat interval for a number of live groups (see the module doc)."""

    def __init__(self, timeout_s: float, per_s: float = HEARTBEATS_PER_S, floor_s: float = MIN_INTERVAL_S) -> None:
        self.per_s, self.floor_s = per_s, floor_s
        self.cap_s = max(floor_s, timeout_s / TIMEOUT_BEATS)
        self._current = floor_s

    def interval(self, groups: int) -> float:
        need = groups / self.per_s  # the shortest interval that keeps the total rate within per_s
        step = self._current
        while step < need:
            step *= 2
        while step > self.floor_s and need < step * 0.4:  # shrink only well below: no flapping at a boundary
            step /= 2
        self._current = max(self.floor_s, step)
        return min(self._current, self.cap_s)


_sending: set[asyncio.Future[None]] = set()  # writes that wait for a full socket buffer (kept referenced)


def send_now(ws: web.WebSocketResponse, frame: bytes) -> None:
    """Writes a text frame to the socket now; only when its buffer is full (a slow reader) does a task wait for it to
    drain, so a push to 12,500 sockets creates no task for the others. A closed or closing socket is skipped."""
    if ws.closed:
        return
    coro = ws.send_frame(frame, WSMsgType.TEXT)
    try:
        waiting = coro.send(None)  # an uncompressed frame is written synchronously; it yields only to drain
    except StopIteration:
        return
    except Exception as e:  # the peer went away meanwhile: its watch handler cleans up
        log.debug("watch frame not sent: %s", e)
        return
    task = asyncio.ensure_future(_finish(coro, waiting))
    _sending.add(task)
    task.add_done_callback(_sending.discard)


async def _finish(coro: Generator[Any, None, None] | Any, waiting: Any) -> None:
    """Drives a send suspended on ``waiting`` (the drain future) to its end, as its task would have."""
    while True:
        if isinstance(waiting, asyncio.Future):
            await asyncio.wait([waiting])
        else:
            await asyncio.sleep(0)
        try:
            waiting = coro.send(None)
        except StopIteration:
            return
        except Exception as e:
            log.debug("watch frame not sent: %s", e)
            return
