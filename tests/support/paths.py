"""Where the checkout is, and how a child Python imports `tests.support` and `hack.bench` from it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def importable_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (by default this process's environment) with the repo root first on PYTHONPATH, so that a child
    started as ``python -m tests.support.<module>`` or ``python -m hack.bench.<module>`` finds them in this checkout
    whatever its working directory."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env
