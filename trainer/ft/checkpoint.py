"""Durable checkpoints for whole-job restarts: asynchronous DCP saves, a manifest written last, integrity on load.

Layout: ``<root>/group-<g>/step-<NNNNNNNN>/`` holds the files ``torch.distributed.checkpoint`` writes plus
``manifest.json`` (step + sha256 of every file), written atomically after the save completed. A directory without a
manifest is a torn save and is never loaded; one whose files do not match their hashes is reported and skipped in
favour of the next older one.

Each group writes to its own ``group-<g>`` folder. Why not only one writer group: that writer could be the group
that dies, and picking it needs agreement; per-group folders need no coordination, work whether or not the volume is
shared between pods, and a restarted job picks the newest intact checkpoint of any group (groups at the same step hold
identical state). The cost is one copy per group, fine for the model sizes here.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, ValidationError

# dcp warns on every single-process save/load; that is the intended mode for one-rank groups.
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")

MANIFEST = "manifest.json"


class CheckpointManifest(BaseModel):
    """``manifest.json``, written last: the step and the sha256 of every other file of the checkpoint."""

    model_config = ConfigDict(extra="forbid", strict=True)
    step: int
    files: dict[str, str]  # path relative to the checkpoint's directory -> sha256


_STEP_PREFIX = "step-"


class CheckpointError(Exception):
    """A checkpoint directory is torn or corrupted (the message says which file)."""


def step_dir(root: Path, group: str, step: int) -> Path:
    """The directory of ``group``'s checkpoint of ``step`` under ``root``."""
    return root / f"group-{group}" / f"{_STEP_PREFIX}{step:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _data_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST and not p.name.endswith(".tmp"))


def write_manifest(directory: Path, step: int) -> None:
    """Writes the manifest (the step and the sha256 of every file) of a completed save, atomically: last, so that
    its presence means the checkpoint is whole."""
    manifest = CheckpointManifest(
        step=step, files={str(p.relative_to(directory)): _sha256(p) for p in _data_files(directory)}
    )
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(manifest.model_dump_json(indent=1), encoding="utf-8")
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)  # atomic: readers see no manifest or the whole one


def verify(directory: Path) -> int:
    """The checkpoint's step if ``directory`` is intact; raises CheckpointError saying what is wrong otherwise."""
    manifest_path = directory / MANIFEST
    if not manifest_path.exists():
        raise CheckpointError(f"{directory}: no {MANIFEST} (the save never completed)")
    try:
        manifest = CheckpointManifest.model_validate_json(manifest_path.read_bytes())
    except ValidationError as e:
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({e})") from e
    step, files = manifest.step, manifest.files
    if not files:
        raise CheckpointError(f"{manifest_path}: lists no files")
    for rel, digest in files.items():
        path = directory / rel
        if not path.exists():
            raise CheckpointError(f"{directory}: {rel} is missing")
        if _sha256(path) != digest:
            raise CheckpointError(f"{directory}: {rel} does not match its sha256 (corrupted)")
    return step


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Every step directory under any group's folder, newest step first (intact or not)."""
    found = []
    for d in root.glob(f"group-*/{_STEP_PREFIX}*"):
        try:
            found.append((int(d.name.removeprefix(_STEP_PREFIX)), d))
        except ValueError:
            continue
    return sorted(found, key=lambda sd: (-sd[0], str(sd[1])))


@dataclass(frozen=True)
class Found:
    """The newest intact checkpoint: its step, its directory, and why newer ones were skipped."""

    step: int
    path: Path
    skipped: list[str]  # why newer checkpoints were not used


def newest_intact(root: Path) -> Found | None:
    """The newest checkpoint under ``root`` whose manifest verifies (any group's), or None; says on stderr why newer
    ones were skipped."""
    skipped = []
    for _, d in list_checkpoints(root):
        try:
            return Found(step=verify(d), path=d, skipped=skipped)
        except CheckpointError as e:
            skipped.append(str(e))
    if skipped:
        print(f"[checkpoint] no intact checkpoint under {root}: {'; '.join(skipped)}", file=sys.stderr, flush=True)
    return None


def _clone(value: Any) -> Any:
    """A private copy of a (nested) state dict, so training can mutate the live tensors while the save runs."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()  # a DTensor clone keeps its placement and copies the local shard
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value


class AsyncCheckpointer:
    """Saves in the background; at most one save in flight. Only ``rank`` 0 of the group writes the manifest.

    dcp's coordinator (rank 0 of ``process_group``) writes ``.metadata`` only after every rank finished writing, so
    when rank 0's save completes the whole checkpoint is on disk and the manifest can be written.
    """

    def __init__(self, root: Path, group: str, keep: int, rank: int = 0, process_group: Any = None) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (got {keep}): the newest checkpoint is always kept")
        self.root, self.group, self.keep, self.rank, self.pg = root, group, keep, rank, process_group
        self._pending: tuple[int, Path, Future[Any]] | None = None
        self._on_done: Callable[[int, Path], None] | None = None
        self.saved_steps: list[int] = []

    def save(
        self,
        step: int,
        state: dict[str, Any],
        on_done: Callable[[int, Path], None] | None = None,
        before_save: Callable[[], None] | None = None,
    ) -> None:
        """Starts saving ``state``; ``before_save`` may write files of its own into the step's directory first
        (the manifest written at the end covers them)."""
        self.wait()  # one in flight: a slow disk throttles checkpoints, never the memory
        directory = step_dir(self.root, self.group, step)
        if directory.exists() and self.rank == 0:
            shutil.rmtree(directory)  # a torn save of the same step from an earlier incarnation
        if self.pg is not None:
            dist.barrier(group=self.pg)
        directory.mkdir(parents=True, exist_ok=True)
        if before_save is not None:
            before_save()
        import torch.distributed.checkpoint as dcp  # slow to import (DTensor, sympy): only once checkpoints are on

        fut = dcp.async_save(_clone(state), checkpoint_id=str(directory), process_group=self.pg)
        self._pending = (step, directory, fut)
        self._on_done = on_done

    def poll(self) -> None:
        """Finish a completed save (manifest, retention) without blocking."""
        if self._pending is not None and self._pending[2].done():
            self.wait()

    def wait(self) -> None:
        """Blocks until the save in flight (if any) completes, then rank 0 writes its manifest, prunes old
        checkpoints and reports it."""
        if self._pending is None:
            return
        step, directory, fut = self._pending
        self._pending = None
        fut.result()
        if self.rank != 0:
            return
        write_manifest(directory, step)
        self.saved_steps.append(step)
        self._prune()
        if self._on_done is not None:
            self._on_done(step, directory)

    def _prune(self) -> None:
        mine = [(s, d) for s, d in list_checkpoints(self.root) if d.parent.name == f"group-{self.group}"]
        intact_seen = 0
        for _, d in mine:  # newest first
            if (d / MANIFEST).exists():
                intact_seen += 1
                if intact_seen <= self.keep:
                    continue
            elif intact_seen == 0:
                continue  # newer than every intact one: may be a save in flight
            shutil.rmtree(d, ignore_errors=True)


def load(found: Found, state: dict[str, Any], process_group: Any = None) -> None:
    """Load ``found`` into ``state`` in place (tensors are overwritten; shapes must match the model)."""
    import torch.distributed.checkpoint as dcp  # see save: not paid by every trainer start

    dcp.load(state, checkpoint_id=str(found.path), process_group=process_group)
