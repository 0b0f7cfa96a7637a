"""The run-record check's dead-branch rule (tests/support/trainer_runs.py): a quorum whose incarnations all died
right after committing a step is dropped; a live conflict is never hidden."""

from __future__ import annotations

from ftjob.ft.records import CommitRecord, FinishedRecord, StartRecord

from tests.support.trainer_runs import without_dead_branches

SAMPLES = 8


def commit(group: str, step: int, contributors: int, shard: int) -> CommitRecord:
    share = SAMPLES // contributors
    return CommitRecord(group=group, step=step, cursor=(step - 1) * SAMPLES, step_samples=SAMPLES,
                        num_contributors=contributors, participants=contributors, contributing=True, shard=shard,
                        shard_start=(step - 1) * SAMPLES + shard * share, shard_count=share)  # fmt: skip


def test_a_quorum_of_replaced_incarnations_that_never_commit_again_is_dropped():
    # groups 1 and 2 commit step 3 among themselves while dying; group 0 commits step 3 alone on the new lighthouse
    by_group = {
        "0": [StartRecord(group="0"), commit("0", 1, 3, 0), commit("0", 2, 3, 0), commit("0", 3, 1, 0),
              commit("0", 4, 1, 0), FinishedRecord(group="0", step=4, param_digest="d")],
        "1": [StartRecord(group="1"), commit("1", 1, 3, 1), commit("1", 2, 3, 1), commit("1", 3, 2, 0),
              StartRecord(group="1"), FinishedRecord(group="1", step=4, param_digest="d")],
        "2": [StartRecord(group="2"), commit("2", 1, 3, 2), commit("2", 2, 3, 2), commit("2", 3, 2, 1),
              StartRecord(group="2"), FinishedRecord(group="2", step=4, param_digest="d")],
    }  # fmt: skip
    kept, dropped = without_dead_branches(by_group)
    assert sorted((c.group, c.step) for c in dropped) == [("1", 3), ("2", 3)]
    assert [r.step for r in kept["0"] if isinstance(r, CommitRecord)] == [1, 2, 3, 4]


def test_a_conflict_with_an_incarnation_that_lives_on_is_kept():
    # group 1 commits step 3 in another quorum and trains on to the end: a split brain, not a dead branch
    by_group = {
        "0": [StartRecord(group="0"), commit("0", 1, 2, 0), commit("0", 2, 2, 0), commit("0", 3, 1, 0),
              FinishedRecord(group="0", step=3, param_digest="d")],
        "1": [StartRecord(group="1"), commit("1", 1, 2, 1), commit("1", 2, 2, 1), commit("1", 3, 2, 1),
              FinishedRecord(group="1", step=3, param_digest="d")],
    }  # fmt: skip
    kept, dropped = without_dead_branches(by_group)
    assert dropped == [] and kept == by_group
