"""Durable checkpoints: async save + manifest, resume of the real trainer state, torn/corrupted ones skipped."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from ftjob.ft import checkpoint
from ftjob.ft.integrity.digest import model_digest as param_digest
from ftjob.gpt.config import TrainConfig
from ftjob.gpt.train import Trainer, forward_backward


def _state(value: float) -> dict:
    return {
        "model": {"w": torch.full((4, 4), value)},
        "data": {"cursor": torch.tensor(int(value)), "step": torch.tensor(7)},
    }


def _save(root: Path, step: int, value: float, keep: int = 5, group: str = "0") -> checkpoint.AsyncCheckpointer:
    ck = checkpoint.AsyncCheckpointer(root, group, keep)
    ck.save(step, _state(value))
    ck.wait()
    return ck


def test_async_save_writes_a_manifest_and_snapshots_the_state(tmp_path: Path) -> None:
    live = _state(1.0)
    ck = checkpoint.AsyncCheckpointer(tmp_path, "0", keep=2)
    ck.save(10, live)
    live["model"]["w"].add_(100.0)  # training goes on while the save runs: the checkpoint must hold the old values
    ck.wait()
    d = checkpoint.step_dir(tmp_path, "0", 10)
    manifest = json.loads((d / checkpoint.MANIFEST).read_text())
    assert manifest["step"] == 10 and ".metadata" in manifest["files"]
    found = checkpoint.newest_intact(tmp_path)
    assert found is not None and found.step == 10 and found.skipped == []
    target = _state(0.0)
    checkpoint.load(found, target)
    assert torch.equal(target["model"]["w"], torch.full((4, 4), 1.0))
    assert int(target["data"]["cursor"]) == 1


def test_torn_checkpoint_without_manifest_is_never_loaded(tmp_path: Path) -> None:
    _save(tmp_path, 10, 1.0)
    _save(tmp_path, 20, 2.0)
    (checkpoint.step_dir(tmp_path, "0", 20) / checkpoint.MANIFEST).unlink()  # as if killed before the manifest
    found = checkpoint.newest_intact(tmp_path)
    assert found is not None and found.step == 10
    assert "no manifest.json" in found.skipped[0]


def test_corrupted_checkpoint_is_reported_and_the_previous_one_used(tmp_path: Path) -> None:
    _save(tmp_path, 10, 1.0)
    _save(tmp_path, 20, 2.0)
    data_file = next(p for p in checkpoint.step_dir(tmp_path, "0", 20).iterdir() if p.suffix == ".distcp")
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    found = checkpoint.newest_intact(tmp_path)
    assert found is not None and found.step == 10
    assert "does not match its sha256" in found.skipped[0] and data_file.name in found.skipped[0]
    target = _state(0.0)
    checkpoint.load(found, target)
    assert torch.equal(target["model"]["w"], torch.full((4, 4), 1.0))


def test_keeps_only_the_last_n_and_picks_the_newest_across_groups(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40):
        _save(tmp_path, step, float(step), keep=2)
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [40, 30]
    _save(tmp_path, 50, 50.0, group="1")
    found = checkpoint.newest_intact(tmp_path)
    assert found is not None and found.step == 50 and found.path.parent.name == "group-1"


def test_no_checkpoint_dir_content_means_a_fresh_start(tmp_path: Path) -> None:
    assert checkpoint.newest_intact(tmp_path) is None


def _train_locally(trainer: Trainer, steps: int) -> None:
    """A few plain optimizer steps on the trainer's own model/data (no Manager needed for this test)."""
    for _ in range(steps):
        trainer.optimizer.zero_grad()
        forward_backward(trainer.model, trainer.source, trainer.data.cursor, trainer.cfg.batch_size)
        trainer.optimizer.step()
        trainer.data.cursor += trainer.cfg.batch_size


def test_trainer_resumes_model_optimizer_and_cursor(tmp_path: Path) -> None:
    cfg = TrainConfig(model="tiny", batch_size=2, corpus_bytes=1 << 20, checkpoint_dir=tmp_path, checkpoint_every=3)
    first = Trainer(cfg)
    _train_locally(first, 3)
    first.ckpt.save(3, first._checkpoint_state(3))
    first.ckpt.wait()
    second = Trainer(cfg)
    assert second.resume() == 3
    assert second.data.cursor == first.data.cursor == 6
    assert param_digest(second.model) == param_digest(first.model)
    # the optimizer's moments came back too: one more identical step keeps the two bitwise equal
    _train_locally(first, 1)
    _train_locally(second, 1)
    assert param_digest(second.model) == param_digest(first.model)
