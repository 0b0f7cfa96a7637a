"""The lighthouse's persisted state: the last quorum id and committed step survive a lighthouse restart, so quorum
ids keep increasing and a quorum never starts below a step that was already committed."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class PersistedState:
    quorum_id: int = 0
    committed_step: int = 0


def load_state(path: str | None) -> PersistedState:
    if not path or not os.path.exists(path):
        return PersistedState()
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        return PersistedState(quorum_id=int(raw["quorum_id"]), committed_step=int(raw["committed_step"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"lighthouse state file {path} is unreadable ({e}); fix or delete it (ids then restart from the managers')"
        ) from e


def save_state(path: str, state: PersistedState) -> None:
    """Atomic replace: a crash mid-write leaves the previous state, never a torn file."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"quorum_id": state.quorum_id, "committed_step": state.committed_step}, f)
    os.replace(tmp, path)
