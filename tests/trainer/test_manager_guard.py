"""The gradient guard through the real Manager: groups in subprocesses (tests/support/manager_worker.py) and a
real lighthouse. One group's gradients are corrupted (FTJOB_FAULT_INJECTION: NaN, or x1000) for a few step attempts;
every group refuses those attempts alike, nothing commits anywhere, the verdict names the faulty group (in each
group's error and at the lighthouse), and the job ends bitwise where a run without the fault ends: the refused
attempts left no trace in any group's parameters. With the sketch check (FTJOB_GUARD_SKETCH=1) the same holds for a
group that lies to the guard about what it sends."""

from __future__ import annotations

from pathlib import Path

import pytest
from ftjob import contract
from test_manager_hsdp import free_port

from tests.support.local_job import Lighthouse, Worker
from tests.support.polling import wait_for

TIMEOUT = 180  # every process imports torch on 2 shared cores
STEPS, FAULT_STEP, ATTEMPTS = 10, 4, 2
# No eviction here (the launcher tests cover it): the lighthouse counts the offences only.
LIGHTHOUSE_ARGS = ("--min-replicas", "2", "--guard-max-offences", "100")
WORKER_ARGS = ("--steps", str(STEPS), "--min-replicas", "2")


SKETCH_ON, SKETCH_OFF = {contract.ENV_GUARD_SKETCH: "1"}, {contract.ENV_GUARD_SKETCH: "0"}


def run_job(
    tmp_path: Path, procs: list, fault: str | None, env: dict[str, str] | None = None, groups: str = "01"
) -> tuple[Lighthouse, list[Worker], list[dict]]:
    lh = Lighthouse(tmp_path, *LIGHTHOUSE_ARGS).start()
    procs.append(lh)
    env = {**(env or {}), **({contract.ENV_FAULT_INJECTION: fault} if fault else {})}
    workers = [Worker(tmp_path, lh.url, g, *WORKER_ARGS, env=env) for g in groups]
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
            assert "the gradient guard refused the step: " + seen in e["error"], e["error"]
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
    assert_refused_and_traceless(workers, done, clean_digest, "group 1: gradient not finite")
    assert_reported(lh, "nonfinite")


def test_a_x1000_gradient_is_refused_everywhere_and_leaves_no_trace(tmp_path: Path, procs: list, clean_digest: str):
    fault = f"group=1,kind=scale,factor=1000,step={FAULT_STEP},count={ATTEMPTS}"
    lh, workers, done = run_job(tmp_path, procs, fault)
    assert_refused_and_traceless(workers, done, clean_digest, "group 1: gradient norm ")
    assert_reported(lh, "norm_outlier")


def test_a_lying_group_fools_the_guard_without_the_sketch_check(tmp_path: Path, procs: list, clean_digest: str):
    """Group 1 sends x1000 and reports its clean norm: the norm rule judges what groups say, so the poisoned steps
    commit everywhere (what the sketch check is for)."""
    fault = f"group=1,kind=lie,factor=1000,step={FAULT_STEP},count={ATTEMPTS}"
    lh, workers, done = run_job(tmp_path, procs, fault, SKETCH_OFF)
    for w, d in zip(workers, done, strict=True):
        assert all(e["committed"] for e in w.events("step")) and d["metrics"]["failed_commits"] == 0
        assert d["digest"] != clean_digest, f"group {w.group}: the lie left no trace: it did not fool the guard"
    assert lh.status().integrity.guard_offences == {}


def test_with_the_sketch_check_a_lying_group_is_refused_everywhere(tmp_path: Path, procs: list, clean_digest: str):
    """The same lie, its sketch faked too: the groups' sketches do not add up to the sketch of the sum, so every
    group refuses the step and nothing of it remains; sums alone cannot say who lied, so nobody is named and the
    lighthouse counts no offence."""
    fault = f"group=1,kind=lie,factor=1000,step={FAULT_STEP},count={ATTEMPTS}"
    lh, workers, done = run_job(tmp_path, procs, fault, SKETCH_ON)
    assert_refused_and_traceless(workers, done, clean_digest, "the groups' sketches of what they sent do not add up")
    assert lh.status().integrity.guard_offences == {}


def test_with_the_sketch_check_a_misreported_norm_names_the_group(tmp_path: Path, procs: list, clean_digest: str):
    """x1000 with the clean norm reported but an honest sketch: the sketches add up, so each is the sketch of what
    its group sent, and group 1's shows 1000x the norm it reports: refused and named."""
    fault = f"group=1,kind=misreport,factor=1000,step={FAULT_STEP},count={ATTEMPTS}"
    lh, workers, done = run_job(tmp_path, procs, fault, SKETCH_ON)
    assert_refused_and_traceless(workers, done, clean_digest, "group 1: reports sending a gradient of norm ")
    assert_reported(lh, "norm_mismatch")


def test_with_the_sketch_check_healthy_groups_are_never_refused(tmp_path: Path, procs: list, clean_digest: str):
    """Healthy groups, every step checked: no refusal, and the same parameters as without the check."""
    _, workers, done = run_job(tmp_path, procs, None, SKETCH_ON)
    for w, d in zip(workers, done, strict=True):
        refused = [e for e in w.events("step") if not e["committed"]]
        assert refused == [] and d["metrics"]["failed_commits"] == 0, (w.group, refused)
        assert d["digest"] == clean_digest, f"group {w.group} does not end where the run without the check ends"


def start_hsdp_group(procs: list, tmp_path: Path, url: str, group: str, env: dict[str, str]) -> list[Worker]:
    port = str(free_port())
    args = ("--world-size", "2", "--master-port", port, *WORKER_ARGS)
    ranks = [Worker(tmp_path, url, group, "--rank", str(r), *args, env=env) for r in (0, 1)]
    procs.extend(ranks)
    return ranks


@pytest.mark.parametrize(
    ("kind", "seen", "env"),
    [
        ("nan", "gradient not finite", SKETCH_OFF),
        ("scale,factor=1000", "gradient norm ", SKETCH_OFF),
        ("misreport,factor=1000", "reports sending a gradient of norm ", SKETCH_ON),
    ],
)
def test_hsdp_groups_judge_whole_gradients_and_refuse_alike(
    tmp_path: Path, procs: list, kind: str, seen: str, env: dict[str, str]
):
    """2 groups x 2 ranks (FSDP2 inside each group: the post-backward path). The vote sums the ranks' shard rows
    (with the sketch check: each rank's sketches of its shard, under its own projection); every rank judges every
    group's whole gradient alike; rank 0 reports the verdict, once."""
    lh = Lighthouse(tmp_path, *LIGHTHOUSE_ARGS).start()
    procs.append(lh)
    fault = {**env, contract.ENV_FAULT_INJECTION: f"group=1,kind={kind},step={FAULT_STEP},count=1"}
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
