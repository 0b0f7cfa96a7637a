"""The reference GPT and the single-process pieces of the training step (no Manager involved)."""

from __future__ import annotations

import pytest
import torch
from ftjob.ft.integrity.digest import model_digest as param_digest
from ftjob.gpt.config import TrainConfig
from ftjob.gpt.data import Corpus, SampleSource
from ftjob.gpt.model import PRESETS, build_model, count_params, preset
from ftjob.gpt.train import forward_backward, lr_at, make_optimizer


def test_presets_span_tiny_to_about_100m_parameters() -> None:
    sizes = {name: count_params(build_model(name, 0)) for name in ("tiny", "small")}
    assert 0.1e6 <= sizes["tiny"] <= 0.3e6
    assert 2.5e6 <= sizes["small"] <= 4e6
    big = PRESETS["large"]  # counted from the shapes: building 86M parameters is not worth a test's time
    per_layer = 12 * big.n_embd**2 + 13 * big.n_embd
    assert 70e6 <= big.n_layer * per_layer + (big.vocab_size + big.block_size) * big.n_embd <= 130e6
    with pytest.raises(ValueError, match="choose one of"):
        preset("huge")


def test_same_seed_same_weights_and_digest_tracks_every_byte() -> None:
    a, b = build_model("tiny", 7), build_model("tiny", 7)
    assert param_digest(a) == param_digest(b)
    assert param_digest(build_model("tiny", 8)) != param_digest(a)
    with torch.no_grad():
        next(iter(b.parameters())).view(-1)[0] += 1e-7
    assert param_digest(a) != param_digest(b)


def test_build_model_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    build_model("tiny", 1)
    assert torch.equal(torch.rand(3), expected)


def test_loss_falls_on_the_stdlib_corpus() -> None:
    cfg = TrainConfig(model="tiny", lr=3e-3, warmup_steps=1)
    model = build_model("tiny", 0)
    opt = make_optimizer(model, cfg)
    src = SampleSource(Corpus.load(max_bytes=1 << 20), model.cfg.block_size)
    losses = []
    for step in range(30):
        opt.zero_grad()
        losses.append(forward_backward(model, src, step * 8, 8))
        opt.step()
    assert losses[0] > 5.0  # about ln(256): an untrained byte model
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5


def test_learning_rate_warms_up_linearly() -> None:
    cfg = TrainConfig(lr=1e-3, warmup_steps=4)
    assert [lr_at(s, cfg) for s in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
