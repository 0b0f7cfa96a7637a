"""(a) Without failures, N fault-tolerant groups end where plain torch DDP ends (same model, data, seeds)."""

from __future__ import annotations

from pathlib import Path

import torch
from ftjob.gpt.config import TrainConfig
from ftjob.gpt.model import build_model

from hack.bench.ddp_baseline import run_ddp  # the baselines live with the benches
from tests.support.launch_runs import assert_clean, launch

STEPS, GROUPS, BATCH = 20, 2, 4


def test_groups_match_ddp(tmp_path: Path) -> None:
    rc, report = launch(
        tmp_path, f"--replicas={GROUPS}", f"--min-replicas={GROUPS}", f"--steps={STEPS}", f"--batch-size={BATCH}"
    )
    assert rc == 0, report
    assert_clean(report, GROUPS, STEPS)
    assert report.samples.committed == STEPS * GROUPS * BATCH
    ours = torch.load(tmp_path / "run" / "final-params-group-0.pt")

    ddp = run_ddp(TrainConfig(model="tiny", steps=STEPS, batch_size=BATCH), GROUPS, tmp_path / "ddp")
    assert len(set(ddp.digests)) == 1
    initial = dict(build_model("tiny", TrainConfig.seed).named_parameters())
    assert set(ours) == set(ddp.params) == set(initial)
    # training really moved the weights, so agreeing below is not two untouched initialisations agreeing
    assert (ours["wte.weight"] - initial["wte.weight"]).abs().max() > 1e-3
    for name, theirs in ddp.params.items():
        # the two reduce gradients in different orders, so they agree to float rounding, not bitwise
        torch.testing.assert_close(ours[name], theirs, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
