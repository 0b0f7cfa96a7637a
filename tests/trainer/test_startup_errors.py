"""Startup errors a user's own loop meets: one line saying what is wrong and what to do, raised before the process
joins anything (no process group, no lighthouse, no quorum)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import torch.distributed as dist
from ftjob import contract, ft
from ftjob.ft import setup
from ftjob.ft.wrappers import data
from torch.utils.data import IterableDataset

from tests.support.launch_runs import launch


class Stream(IterableDataset):
    def __iter__(self) -> Iterator[int]:
        return iter(range(8))


def test_init_outside_a_job_names_the_variable_and_the_launchers(monkeypatch):
    monkeypatch.delenv(contract.ENV_LIGHTHOUSE_URL, raising=False)
    with pytest.raises(RuntimeError) as raised:
        ft.init(device="cpu")
    message = str(raised.value)
    assert contract.ENV_LIGHTHOUSE_URL in message and "ftjob-trainer launch" in message and "\n" not in message
    assert not dist.is_initialized() and setup._current is None


def no_session() -> None:
    raise AssertionError("the loader joined the job before checking its dataset")


@pytest.mark.parametrize("dataset", [Stream(), (x for x in range(8)), 42], ids=["IterableDataset", "generator", "int"])
def test_a_dataset_the_loader_cannot_index_is_refused_before_joining(monkeypatch, dataset):
    monkeypatch.setattr(data, "current_session", no_session)
    with pytest.raises(TypeError, match="map-style dataset .* not " + type(dataset).__name__):
        ft.DataLoader(dataset, batch_size=2)


ITERABLE_LOOP = """
from ftjob import ft
from torch.utils.data import IterableDataset


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(8))


for batch in ft.DataLoader(Stream(), batch_size=2):
    pass
"""


def test_the_launcher_stops_at_once_when_every_group_fails_alike_before_the_first_step(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(ITERABLE_LOOP)
    rc, report = launch(tmp_path, "--replicas=2", "--max-crashes=5", command=(sys.executable, str(script)))
    assert rc == 1 and not report.ok
    assert report.failure and "every group failed the same way before the first step" in report.failure
    assert "map-style dataset" in report.failure, report.failure
    assert sorted(e.group for e in report.unexpected_exits) == ["0", "1"], "a group was restarted: no restart helps"
