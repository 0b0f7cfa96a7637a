"""Corpus determinism, sample addressing, sharding, and the committed-sample accounting (pure logic)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ftjob.ft.records import CommitRecord
from ftjob.gpt.data import Corpus, SampleSource, list_corpus_files, rank_range, shard_range, stdlib_root
from ftjob.launch.run_records import Coverage, sample_coverage


def test_corpus_is_the_sorted_stdlib_without_third_party_packages() -> None:
    files = list_corpus_files(stdlib_root())
    rel = [str(p.relative_to(stdlib_root())) for p in files]
    assert rel == sorted(rel)
    assert "os.py" in rel and "json/__init__.py" in rel
    assert not any("site-packages" in r for r in rel)


def test_corpus_is_deterministic_and_starts_with_the_first_file() -> None:
    a = Corpus.load(max_bytes=1 << 20)
    b = Corpus.load(max_bytes=1 << 20)
    assert a.digest == b.digest and a.data.numel() == 1 << 20
    first = list_corpus_files(stdlib_root())[0].read_bytes()
    n = min(len(first), 4096)
    assert bytes(a.data[:n].tolist()) == first[:n]


def test_corpus_rejects_a_directory_without_python_sources(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="--corpus-root"):
        Corpus.load(tmp_path)


def test_sample_i_is_the_bytes_at_i_times_block(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_bytes(bytes(range(256)) * 8)  # 2048 bytes: byte k == k % 256
    src = SampleSource(Corpus.load(tmp_path), block_size=16)
    x, y = src.samples(3, 2)
    assert x.shape == (2, 16) and x.dtype == torch.int64
    assert x[0].tolist() == [(48 + k) % 256 for k in range(16)]
    assert y[0].tolist() == [(49 + k) % 256 for k in range(16)]  # targets are inputs shifted by one
    assert x[1].tolist() == [(64 + k) % 256 for k in range(16)]
    # past the end the index wraps: the same sample index always names the same bytes
    wrapped, _ = src.samples(3 + src.num_samples, 1)
    assert torch.equal(wrapped[0], x[0])


def test_shards_tile_the_step_without_overlap() -> None:
    cursor, b = 40, 8
    for n in (1, 2, 3, 5):
        ranges = [shard_range(cursor, k, n, b) for k in range(n)]
        assert ranges[0][0] == cursor and ranges[-1][1] == cursor + n * b
        assert all(ranges[k][1] == ranges[k + 1][0] for k in range(n - 1))
    with pytest.raises(ValueError, match="out of range"):
        shard_range(0, 3, 3, b)


def test_rank_range_splits_a_group_batch_evenly() -> None:
    assert [rank_range(16, 8, r, 2) for r in range(2)] == [(16, 20), (20, 24)]
    with pytest.raises(ValueError, match="multiple"):
        rank_range(0, 8, 0, 3)


def coverage(recs: dict[str, list[dict]]) -> Coverage:
    """The launcher's check of records written as plain dicts (edited freely by the tests below)."""
    return sample_coverage({g: [CommitRecord(**r) for r in rs] for g, rs in recs.items()})


def _commit(step: int, cursor: int, n: int, shard: int, b: int = 4, contributing: bool = True) -> dict:
    return {
        "event": "commit",
        "step": step,
        "cursor": cursor,
        "step_samples": n * b,
        "num_contributors": n,
        "contributing": contributing,
        "shard": shard if contributing else -1,
        "shard_start": cursor + shard * b if contributing else -1,
        "shard_count": b if contributing else 0,
    }


def _run(steps: list[tuple[int, int]], groups: int = 2, b: int = 4) -> dict[str, list[dict]]:
    """Records of `groups` groups for steps given as (step, num_contributors), cursor advancing correctly."""
    out: dict[str, list[dict]] = {str(g): [] for g in range(groups)}
    cursor = 0
    for step, n in steps:
        for g in range(groups):
            out[str(g)].append(_commit(step, cursor, n, g, b, contributing=g < n))
        cursor += n * b
    return out


def test_clean_run_has_no_drops_or_duplicates() -> None:
    cov = coverage(_run([(1, 2), (2, 2), (3, 1), (4, 2)]))
    assert (cov.committed, cov.dropped, cov.duplicated) == (4 * 7, 0, 0)
    assert cov.inconsistent_steps == [] and cov.shard_errors == []


def test_a_skipped_range_is_counted_as_dropped() -> None:
    recs = _run([(1, 2), (2, 2)])
    for r in recs["0"] + recs["1"]:
        if r["step"] == 2:  # step 2 started 8 samples late
            r["cursor"] += 8
            r["shard_start"] += 8
    cov = coverage(recs)
    assert cov.dropped == 8 and cov.duplicated == 0


def test_a_repeated_range_is_counted_as_duplicated() -> None:
    recs = _run([(1, 2), (2, 2)])
    for r in recs["0"] + recs["1"]:
        if r["step"] == 2:  # step 2 re-trained half of step 1's samples
            r["cursor"] -= 4
            r["shard_start"] -= 4
    cov = coverage(recs)
    assert cov.duplicated == 4 and cov.dropped == 0


def test_one_lost_line_does_not_fake_a_gap() -> None:
    recs = _run([(1, 2), (2, 2), (3, 2)])
    recs["1"] = [r for r in recs["1"] if r["step"] != 2]  # killed between commit and write
    cov = coverage(recs)
    assert (cov.dropped, cov.duplicated) == (0, 0)


def test_groups_disagreeing_on_a_step_are_reported() -> None:
    recs = _run([(1, 2), (2, 2)])
    recs["1"][1]["cursor"] += 1
    assert coverage(recs).inconsistent_steps == [2]


def test_two_groups_claiming_the_same_shard_is_a_shard_error() -> None:
    recs = _run([(1, 2)])
    recs["1"][0]["shard"], recs["1"][0]["shard_start"] = 0, 0  # shard 0 twice, shard 1 never
    recs["2"] = [_commit(1, 0, 2, 1)]
    recs["2"][0]["shard_start"] = 5  # claims shard 1 but at the wrong place
    assert coverage(recs).shard_errors == [1]
