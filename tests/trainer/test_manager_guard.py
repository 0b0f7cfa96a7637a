"""The gradient guard through the real Manager: groups in subprocesses (tests/trainer/test_manager_worker.py) and a
real lighthouse. One group's gradients are corrupted (FTJOB_FAULT_INJECTION: NaN, or x1000) for a few step attempts;
every group refuses those attempts alike, nothing commits anywhere, the verdict names the faulty group (in each
group's error and at the lighthouse), and the job ends bitwise where a run without the fault ends: the refused
attempts left no trace in any group's parameters."""

from __future__ import annotations

from pathlib import Path

import pytest
from ftjob import contract
from helpers import wait_for
from test_manager_hsdp import free_port
from test_manager_worker import Lighthouse, Worker

TIMEOUT = 180  # every process imports torch on 2 shared cores
STEPS, FAULT_STEP, ATTEMPTS = 10, 4, 2
# No eviction here (the launcher tests cover it): the lighthouse counts the offences only.
LIGHTHOUSE_ARGS = ("--min-replicas", "2", "--guard-max-offences", "100")
WORKER_ARGS = ("--steps", str(STEPS), "--min-replicas", "2")


def run_job(tmp_path: Path, procs: list, fault: str | None) -> tuple[Lighthouse, list[Worker], list[dict]]:
    lh = Lighthouse(tmp_path, *LIGHTHOUSE_ARGS).start()
    procs.append(lh)
    env = {contract.ENV_FAULT_INJECTION: fault} if fault else {}
    workers = [Worker(tmp_path, lh.url, g, *WORKER_ARGS, env=env) for g in "01"]
    procs.extend(workers)
    done = [wait_for(w.done, TIMEOUT, f"group {w.group} to finish") for w in workers]
    return lh, workers, done


@pytest.fixture(scope="module")
def clean_digest(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The final parameters of the same job without any fault (the workers' data depends on the step only)."""
    started: list = []
    try:
        _, _, done = run_job(tmp_path_factory.mktemp("clean"), started, None)
    finally:
        for p in started:
            p.kill()
    assert done[0]["digest"] == done[1]["digest"]
    return str(done[0]["digest"])


def assert_refused_and_traceless(workers: list[Worker], done: list[dict], clean_digest: str, seen: str) -> None:
    for w, d in zip(workers, done, strict=True):
        steps = w.events("step")
        refused = [(i, e) for i, e in enumerate(steps) if not e["committed"]]
        assert [e["step"] for _, e in refused] == [FAULT_STEP] * ATTEMPTS, (w.group, refused)
        for i, e in refused:
            assert "the gradient guard refused the step: group 1: " + seen in e["error"], e["error"]
            assert "group 0" not in e["error"]
            assert e["digest"] == steps[i - 1]["digest"], f"group {w.group}: a refused attempt changed its parameters"
        assert d["step"] == STEPS and d["metrics"]["commits"] == STEPS and d["metrics"]["failed_commits"] == ATTEMPTS
        assert d["cursor"] == 2 * STEPS  # every step committed once, by both groups
        assert d["digest"] == clean_digest, f"group {w.group} does not end where the run without the fault ends"


def assert_reported(lh: Lighthouse, kind: str) -> None:
    status = lh.status()
    assert status.integrity.guard_offences == {"1": ATTEMPTS}, status.integrity  # one per refused quorum
    guard = [r for r in status.audit if r.kind == "guard"]
    assert len(guard) == ATTEMPTS and all(r.group == "1" and kind in r.reason for r in guard), guard


def test_a_nan_gradient_is_refused_everywhere_and_leaves_no_trace(tmp_path: Path, procs: list, clean_digest: str):
    fault = f"group=1,kind=nan,step={FAULT_STEP},count={ATTEMPTS}"
    lh, workers, done = run_job(tmp_path, procs, fault)
    assert_refused_and_traceless(workers, done, clean_digest, "gradient not finite")
    assert_reported(lh, "nonfinite")


def test_a_x1000_gradient_is_refused_everywhere_and_leaves_no_trace(tmp_path: Path, procs: list, clean_digest: str):
    fault = f"group=1,kind=scale,factor=1000,step={FAULT_STEP},count={ATTEMPTS}"
    lh, workers, done = run_job(tmp_path, procs, fault)
    assert_refused_and_traceless(workers, done, clean_digest, "gradient norm ")
    assert_reported(lh, "norm_outlier")


def start_hsdp_group(procs: list, tmp_path: Path, url: str, group: str, env: dict[str, str]) -> list[Worker]:
    port = str(free_port())
    args = ("--world-size", "2", "--master-port", port, *WORKER_ARGS)
    ranks = [Worker(tmp_path, url, group, "--rank", str(r), *args, env=env) for r in (0, 1)]
    procs.extend(ranks)
    return ranks


@pytest.mark.parametrize(("kind", "seen"), [("nan", "gradient not finite"), ("scale,factor=1000", "gradient norm ")])
def test_hsdp_groups_judge_whole_gradients_and_refuse_alike(tmp_path: Path, procs: list, kind: str, seen: str):
    """2 groups x 2 ranks (FSDP2 inside each group: the post-backward path). The vote sums the ranks' shard rows;
    every rank judges every group's whole gradient alike; rank 0 reports the verdict, once."""
    lh = Lighthouse(tmp_path, *LIGHTHOUSE_ARGS).start()
    procs.append(lh)
    fault = {contract.ENV_FAULT_INJECTION: f"group=1,kind={kind},step={FAULT_STEP},count=1"}
    groups = [start_hsdp_group(procs, tmp_path, lh.url, g, fault) for g in "01"]
    done = {
        (w.group, r): wait_for(w.done, TIMEOUT, f"group {w.group} rank {r}") for ws in groups for r, w in enumerate(ws)
    }
    for ws in groups:
        for w in ws:
            refused = [e for e in w.events("step") if not e["committed"]]
            assert [e["step"] for e in refused] == [FAULT_STEP], (w.group, refused)
            assert f"group 1: {seen}" in refused[0]["error"] and "group 0" not in refused[0]["error"]
    for rank in (0, 1):
        assert done[("0", rank)]["digest"] == done[("1", rank)]["digest"]
        assert done[("0", rank)]["metrics"]["failed_commits"] == 1
    assert lh.status().integrity.guard_offences == {"1": 1}
