"""Fixtures of the trainer tests (no cluster)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def procs() -> Iterator[list[Any]]:
    """Processes a test starts (lighthouses, workers: anything with kill()); all killed when it ends."""
    started: list[Any] = []
    yield started
    for p in started:
        p.kill()
