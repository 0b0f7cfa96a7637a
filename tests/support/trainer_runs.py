"""The real reference trainer under the operator, with its run records on a host path every node of the local
cluster shares, and the checks of a finished run: exactly-once samples, steps never trained twice, equal digests."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ftjob.ft.records import CommitRecord, FinishedRecord, StartRecord, read_run_dir
from ftjob.launch.run_records import sample_coverage

from tests.support.operator_cluster import job_manifest

RECORDS_ROOT = Path("/var/tmp/ftjob-test-records")
# The tiny model at batch 4 has heavy-tailed gradient norms: a healthy group was refused at 133x the others' median
# (the retry repeats the same data, so the refusal too, and the group is evicted). Tests that are not about the
# gradient guard use a ratio well above that; tests/operator/test_integrity_cluster.py covers the guard itself.
TINY_MODEL_INTEGRITY = {"gradientGuard": {"normRatio": 1000}}


def train_command(steps: int) -> list[str]:
    """Paced (0.2 s a step) so faults land mid-run; records go to /records."""
    return ["ftjob-trainer", "train", "--model", "tiny", "--steps", str(steps), "--corpus-bytes", "262144",
            "--batch-size", "4", "--log-every", "20", "--min-step-seconds", "0.2", "--run-dir", "/records"]  # fmt: skip


def training_job(name: str, steps: int, records: Path, workers_on: str | None = None, **spec: Any) -> dict[str, Any]:
    spec.setdefault("integrity", TINY_MODEL_INTEGRITY)
    m = job_manifest(name, command=train_command(steps), lighthouse={"heartbeatTimeoutSeconds": 5},
                     failurePolicy={"maxRestartsPerGroup": 2}, **spec)  # fmt: skip
    pod = m["spec"]["template"]["spec"]
    pod["containers"][0]["volumeMounts"] = [{"name": "records", "mountPath": "/records"}]
    pod["volumes"] = [{"name": "records", "hostPath": {"path": str(records), "type": "Directory"}}]
    if workers_on:  # the lighthouse is not pinned: it goes wherever the scheduler can put it
        term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [workers_on]}]}
        required = {"nodeSelectorTerms": [term]}
        pod["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}
    return m


Records = list[StartRecord | CommitRecord | FinishedRecord]


def without_dead_branches(by_group: dict[str, Records]) -> tuple[dict[str, Records], list[CommitRecord]]:
    """The run records less the commits of a quorum that died whole: (the records kept, the commits dropped).

    A pod force-deleted with its lighthouse lives on for the kubelet's kill grace (about 2 s), and so does the old
    lighthouse; processes that were all being killed can still commit a step among themselves while the survivors
    commit the same step, in another quorum, on the replacement. Nothing of that branch survives (the replacement
    lighthouse refuses replaced generations, so no one heals from them). Where a step's commits disagree on the quorum
    (contributors, participants) and exactly one of those quorums lives on (one of its incarnations is its group's
    last, or commits a later step that is kept), the others are dropped: none of their incarnations ever committed
    again."""
    segments: list[tuple[str, Records, bool]] = []
    for group, recs in by_group.items():
        cuts = [i for i, r in enumerate(recs) if isinstance(r, StartRecord)] or [0]
        parts = [recs[a:b] for a, b in itertools.pairwise([*cuts, len(recs)])]
        segments += [(group, part, i == len(parts) - 1) for i, part in enumerate(parts)]
    by_step: dict[int, list[tuple[int, CommitRecord]]] = {}
    for index, (_, part, _) in enumerate(segments):
        for r in part:
            if isinstance(r, CommitRecord):
                by_step.setdefault(r.step, []).append((index, r))
    goes_on = [last for _, _, last in segments]  # the incarnation is its group's last or commits later (kept)
    dead: set[int] = set()  # id() of the dropped commits
    for step in sorted(by_step, reverse=True):
        quorums: dict[tuple[int, int, int, int], list[tuple[int, CommitRecord]]] = {}
        for index, c in by_step[step]:
            quorums.setdefault((c.cursor, c.step_samples, c.num_contributors, c.participants), []).append((index, c))
        living = [q for q in quorums.values() if any(goes_on[i] for i, _ in q)]
        if len(quorums) > 1 and len(living) == 1:
            dead.update(id(c) for q in quorums.values() if q is not living[0] for _, c in q)
        for index, c in by_step[step]:
            if id(c) not in dead:
                goes_on[index] = True
    kept = {group: [r for r in recs if id(r) not in dead] for group, recs in by_group.items()}
    dropped = [r for recs in by_group.values() for r in recs if id(r) in dead]
    return kept, dropped


def check_run(records: Path, groups: set[str], steps: int, restarted: set[str],
              start_counts: Mapping[str, int] | None = None,
              dead_branches: bool = False) -> dict[str, list[CommitRecord]]:  # fmt: skip
    """Exactly-once samples, no step committed twice or skipped without a heal, every group at the last step with one
    digest, and only the groups in ``restarted`` started twice (``start_counts``: how often each group named there
    started, for a group replaced more than once). ``dead_branches``: first drop the commits of quorums that died
    whole (:func:`without_dead_branches`), for runs that force-delete the lighthouse with groups. Returns the commits
    by group."""
    by_group = read_run_dir(records)
    if dead_branches:
        by_group, dropped = without_dead_branches(by_group)
        if dropped:
            print(f"dropped a dead branch: {[(c.group, c.step, c.num_contributors) for c in dropped]}")
    assert set(by_group) == groups, f"run records of groups {sorted(by_group)}, expected {sorted(groups)}"
    cov = sample_coverage(by_group)
    assert (cov.dropped, cov.duplicated, cov.inconsistent_steps, cov.shard_errors) == (0, 0, [], []), cov
    digests, commits = {}, {}
    for group, recs in by_group.items():
        starts = [r for r in recs if isinstance(r, StartRecord)]
        expected = (start_counts or {}).get(group, 2 if group in restarted else 1)
        assert len(starts) == expected, f"group {group} started {len(starts)} times, expected {expected}"
        commits[group] = [r for r in recs if isinstance(r, CommitRecord)]
        got = [r.step for r in commits[group]]
        # never a step twice, never backwards; a jump is a heal (copied from a peer while the others went on)
        odd = [(a, b) for a, b in itertools.pairwise(got) if b != a + 1]
        assert all(b > a for a, b in odd), f"group {group} committed a step twice or went back: {odd}"
        jumps = [(a, b) for a, b in odd if not next(c.healed for c in commits[group] if c.step == b)]
        assert not jumps, f"group {group} skipped steps without healing: {jumps}"
        finished = [r for r in recs if isinstance(r, FinishedRecord)]
        assert finished and finished[-1].step == steps, f"group {group} did not finish"
        digests[group] = finished[-1].param_digest
    assert len(set(digests.values())) == 1, f"groups diverged: {digests}"
    return commits


def commit_gaps(commits: list[CommitRecord], start: float, end: float) -> tuple[float, float]:
    """(the longest gap between commits that touches [start, end], the median gap of the whole run)."""
    times = [c.t for c in commits]
    gaps = [(b - a, a, b) for a, b in itertools.pairwise(times)]
    inside = [g for g, a, b in gaps if b >= start and a <= end]
    return max(inside, default=0.0), statistics.median(g for g, _, _ in gaps)


def run_summary(records: Path, tail: int = 5) -> str:
    """What a failed test's run records say, compactly: per group its starts, heals, commits where the quorum
    changed, its highest loss and its last commits."""
    try:
        by_group = read_run_dir(records)
    except (OSError, ValueError) as e:
        return f"(unreadable: {e})"
    lines = []
    for group, recs in sorted(by_group.items()):
        commits = [r for r in recs if isinstance(r, CommitRecord)]
        starts = sum(isinstance(r, StartRecord) for r in recs)
        healed = [c.step for c in commits if c.healed]
        changes = [f"{c.step}:{c.num_contributors}/{c.participants}" for a, c in itertools.pairwise(commits)
                   if (a.num_contributors, a.participants) != (c.num_contributors, c.participants)]  # fmt: skip
        losses = [(c.loss, c.step) for c in commits if c.loss is not None]
        worst = max(losses, default=None)
        lines.append(f"group {group}: {starts} start(s), {len(commits)} commits, healed at steps {healed}, "
                     f"quorum changes (step:contributors/participants) {changes}, highest loss {worst}")  # fmt: skip
        lines += [f"  step {c.step} cursor {c.cursor} groups {c.num_contributors}/{c.participants} shard "
                  f"{c.shard_start} healed {c.healed} loss {c.loss} t {c.t:.2f}" for c in commits[-tail:]]  # fmt: skip
    return "\n".join(lines) or "(no records)"
