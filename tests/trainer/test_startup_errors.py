"""Startup errors a user's own loop meets: one line saying what is wrong and what to do, raised before the process
joins anything (no process group, no lighthouse, no quorum)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist
from ftjob import contract, ft
from ftjob.ft import setup
from ftjob.ft.wrappers import data
from torch.utils.data import IterableDataset


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
