"""The lighthouse's persisted state: the last quorum id and committed step survive a lighthouse restart, so quorum
ids keep increasing and a quorum never starts below a step that was already committed."""

from __future__ import annotations

import os
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class PersistedState(BaseModel):
    """The state file's content: ``{"quorum_id": N, "committed_step": M}``."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    quorum_id: Annotated[int, Field(ge=0)] = 0
    committed_step: Annotated[int, Field(ge=0)] = 0


def load_state(path: str | None) -> PersistedState:
    if not path or not os.path.exists(path):
        return PersistedState()
    try:
        with open(path, "rb") as f:
            return PersistedState.model_validate_json(f.read())
    except (OSError, ValidationError) as e:
        raise ValueError(
            f"lighthouse state file {path} is unreadable ({e}); fix or delete it (ids then restart from the managers')"
        ) from e


def save_state(path: str, state: PersistedState) -> None:
    """Atomic replace: a crash mid-write leaves the previous state, never a torn file."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(state.model_dump_json())
    os.replace(tmp, path)
