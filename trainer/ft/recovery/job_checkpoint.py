"""Durable checkpoints of a Session for whole-job restarts: resume from the newest intact one, save every N commits.

The model and optimizer go through ``torch.distributed.checkpoint`` (sharded when the group shards them, written in
the background by ftjob.ft.checkpoint); every other registered state (data cursor, scheduler, GradScaler, your own)
is small, may differ per rank, and is written synchronously per rank next to it as ``extra-rank<r>.json`` + ``.bin``
in live recovery's format (no pickle). The checkpoint's manifest covers all of it, so a torn or corrupted one is
skipped for the next older one.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from ftjob.contract.recovery_api import RecoveryManifest
from ftjob.ft import checkpoint
from ftjob.ft.recovery.codec import pack, unpack

if TYPE_CHECKING:
    from ftjob.ft.step.session import Session, SessionConfig

log = logging.getLogger("ftjob.checkpoint")
LARGE = ("model", "optim")  # the entries saved with torch.distributed.checkpoint


def _extra_paths(directory: Path, rank: int) -> tuple[Path, Path]:
    return directory / f"extra-rank{rank}.json", directory / f"extra-rank{rank}.bin"


class JobCheckpoints:
    """Saves and resumes a Session's registered state under ``<dir>/group-<g>/step-<N>/``."""

    def __init__(self, root: Path, group: str, rank: int, world_size: int, keep: int) -> None:
        self.root, self.group, self.rank, self.world_size, self.keep = root, group, rank, world_size, keep
        self._writer: checkpoint.AsyncCheckpointer | None = None
        self._pg: Any = None

    @classmethod
    def from_config(cls, cfg: SessionConfig) -> JobCheckpoints:
        """The job's checkpoints as a session configures them (its directory, group, rank and retention)."""
        assert cfg.checkpoint_dir is not None
        m = cfg.manager
        return cls(cfg.checkpoint_dir, m.group, m.rank, m.world_size, cfg.keep_checkpoints)

    def _process_group(self) -> Any:
        # A dedicated gloo group: dcp's background collectives must not interleave with FSDP's on the default one.
        if self._pg is None and self.world_size > 1:
            self._pg = dist.new_group(backend="gloo")
        return self._pg

    def _large_state(self, session: Session) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        assert session.model is not None and session.optimizer is not None
        model_sd, optim_sd = get_state_dict(session.model, session.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def save(self, session: Session, step: int) -> None:
        """Starts saving ``step`` (the previous save must finish first: at most one in flight)."""
        if self._writer is None:
            self._writer = checkpoint.AsyncCheckpointer(
                self.root, self.group, self.keep, self.rank, self._process_group()
            )
        directory = checkpoint.step_dir(self.root, self.group, step)
        extras = {name: value for name, value in session.state_dict().items() if name not in LARGE}
        packed = pack(extras)
        manifest = RecoveryManifest(
            step=step, total_bytes=packed.buffer.numel(), chunks=[], tensors=packed.tensors, state=packed.state
        )

        def write_extras() -> None:  # before dcp's save starts: its manifest then covers these files
            meta, data = _extra_paths(directory, self.rank)
            data.write_bytes(packed.buffer.numpy().tobytes())
            meta.write_text(manifest.model_dump_json())

        self._writer.save(step, self._large_state(session), before_save=write_extras)

    def poll(self) -> None:
        """Finishes a completed background save (manifest, retention) without blocking."""
        if self._writer is not None:
            self._writer.poll()

    def wait(self) -> None:
        """Blocks until the background save in flight, if any, is complete."""
        if self._writer is not None:
            self._writer.wait()

    def resume(self, session: Session) -> int:
        """Loads the newest intact checkpoint of any group into the session; returns its step (0: none found)."""
        found = checkpoint.newest_intact(self.root)
        if found is None:
            return 0
        for why in found.skipped:
            log.warning("checkpoint skipped: %s", why)
        from torch.distributed.checkpoint.state_dict import set_state_dict

        large = self._large_state(session)
        checkpoint.load(found, large, process_group=self._process_group())
        assert session.model is not None and session.optimizer is not None
        set_state_dict(
            session.model, session.optimizer, model_state_dict=large["model"], optim_state_dict=large["optim"]
        )
        meta, data = _extra_paths(found.path, self.rank)
        if not meta.exists():
            raise RuntimeError(f"{found.path} has no state for rank {self.rank}: was it written by a larger group?")
        manifest = RecoveryManifest.model_validate_json(meta.read_bytes())
        raw = bytearray(data.read_bytes())  # empty when every extra is a plain value (frombuffer refuses that)
        buffer = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        extras = unpack(manifest.state, manifest.tensors, buffer)
        for name, (_get, put) in session.entries.items():
            if name not in LARGE:
                if name not in extras:
                    raise RuntimeError(f"{found.path} holds no {name!r} state: register the same state as the run")
                put(extras[name])
        print(f"[group {self.group}] resumed from {found.path} at step {found.step}", flush=True)
        return found.step
