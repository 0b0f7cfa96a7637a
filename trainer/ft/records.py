"""Run records: the contract between a training process and the local launcher's report.

Each group's rank 0 appends one JSON line per event to ``<run_dir>/group-<g>.jsonl`` (one file per group across
restarts), when a run directory is given (``FTJOB_RUN_DIR``; the local launcher sets it):

* StartRecord     -- a process came up: its incarnation and the step it starts from.
* CommitRecord    -- a step committed: the step reached, the step's global sample range (``cursor``,
  ``step_samples``), this group's share of it, contributors, whether this step healed, and the loss if known.
* FinishedRecord  -- the last step is done: the digest of the final parameters.

Lines are flushed as written, so a SIGKILLed group leaves every line it completed; a torn last line is skipped.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Literal, TextIO

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError


class Record(BaseModel):
    """What every run record carries: its wall time and the process incarnation that wrote it."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    t: float = Field(default_factory=time.time)  # wall time
    incarnation: str = ""  # one per process start


class StartRecord(Record):
    """A process came up: its group, the step it starts from, and what it trains."""

    event: Literal["start"] = "start"
    group: str = ""
    step: int = 0  # the step this process starts from (a resumed checkpoint's)
    pid: int | None = None
    params: int | None = None  # model size
    corpus_digest: str | None = None  # the reference trainer's data identity


class CommitRecord(Record):
    """A step committed: the step reached, its global sample range, this group's share of it, and how it went."""

    event: Literal["commit"] = "commit"
    group: str = ""
    step: int  # the step reached by this commit
    cursor: int  # the step's global sample range: [cursor, cursor + step_samples)
    step_samples: int
    num_contributors: int
    participants: int = 0  # groups in the quorum, contributing or not
    contributing: bool = False
    shard: int = -1  # this group's contributor rank
    shard_start: int = -1  # this group's share: [shard_start, shard_start + shard_count)
    shard_count: int = 0
    healed: bool = False
    loss: float | None = None
    tokens: int = 0
    phases: dict[str, float] | None = None  # where the step's time went (the reference trainer)


class FinishedRecord(Record):
    """The group trained its last step: the digest of its final parameters."""

    event: Literal["finished"] = "finished"
    group: str = ""
    step: int
    param_digest: str


RunRecord = Annotated[StartRecord | CommitRecord | FinishedRecord, Field(discriminator="event")]
_RECORD = TypeAdapter(RunRecord)


def group_log_path(run_dir: Path, group: str) -> Path:
    """Where ``group``'s records go under ``run_dir``."""
    return run_dir / f"group-{group}.jsonl"


class GroupLog:
    """Append-only writer of one group's records (only the group's rank 0 writes)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f: TextIO = open(path, "a", encoding="utf-8")  # noqa: SIM115 -- held open for the process's life

    def write(self, record: StartRecord | CommitRecord | FinishedRecord) -> None:
        """Appends one record as a JSON line and flushes it (a killed process leaves every line it wrote)."""
        self._f.write(record.model_dump_json(exclude_none=True) + "\n")
        self._f.flush()

    def close(self) -> None:
        """Closes the file."""
        self._f.close()


def parse_record(line: str | bytes) -> StartRecord | CommitRecord | FinishedRecord | None:
    """One line as a record; None for a torn or foreign line."""
    try:
        return _RECORD.validate_json(line)
    except ValidationError:
        return None


def read_group_log(path: Path) -> list[StartRecord | CommitRecord | FinishedRecord]:
    """Every complete record in ``path`` (a missing file reads as none; a torn line from a kill is skipped)."""
    if not path.exists():
        return []
    parsed = (parse_record(line) for line in path.read_text(encoding="utf-8").splitlines())
    return [r for r in parsed if r is not None]


def read_run_dir(run_dir: Path) -> dict[str, list[StartRecord | CommitRecord | FinishedRecord]]:
    """Group id -> its records, for every ``group-*.jsonl`` in ``run_dir``."""
    return {p.stem.removeprefix("group-"): read_group_log(p) for p in sorted(run_dir.glob("group-*.jsonl"))}
