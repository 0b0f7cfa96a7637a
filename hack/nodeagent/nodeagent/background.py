"""Fire-and-forget tasks that are kept referenced until they finish (asyncio only holds weak references)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger("nodeagent")
_running: set[asyncio.Task] = set()


def _done(task: asyncio.Task) -> None:
    _running.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.error("background task %s failed: %r", task.get_name(), task.exception())


def background(coro: Coroutine[Any, Any, Any], name: str = "") -> asyncio.Task:
    task = asyncio.create_task(coro, name=name or None)
    _running.add(task)
    task.add_done_callback(_done)
    return task
