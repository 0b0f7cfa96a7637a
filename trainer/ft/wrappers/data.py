"""The data loader: each step's fixed global batch, shared out over the groups contributing to that step."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ftjob.ft.setup import current_session
from ftjob.ft.step.manager import QuorumInfo
from ftjob.ft.step.session import Session, StepSamples
from ftjob.ft.wrappers.sharding import SampleOrder, step_shard
from pydantic import BaseModel, ConfigDict
from torch.utils.data import Dataset, IterableDataset, default_collate


class LoaderState(BaseModel):
    """The loader's part of the state a healing peer copies: where the next step's samples start."""

    model_config = ConfigDict(extra="forbid", strict=True)
    cursor: int = 0


class DataLoader:
    """Batches of any map-style dataset (``len()`` and ``dataset[i]``) for a fault-tolerant loop, in place of a
    ``DataLoader`` with a ``DistributedSampler``.

    Every step trains a fixed global batch of ``global_batch_size`` samples (default: ``batch_size`` x ranks per
    group x ``replicas`` x ``accumulation_steps``, i.e. ``batch_size`` per rank and pass when every wanted group
    contributes), split over the groups that contribute to that step; fewer groups means bigger shares, never fewer
    samples. The cursor into the sample stream is committed with the step and copied to healing groups, so every
    sample is trained exactly once whatever groups fail, return or stand by (ftjob.ft.wrappers.sharding has the rule).

    Iterating begins each step (joining its quorum) and yields ``accumulation_steps`` batches per step; it ends after
    ``steps`` committed steps (default: ``epochs`` passes over the dataset, 1 pass when neither is given), then
    reports this group's final parameters to the job. Samples are read in the training process with ``collate_fn``
    (default ``torch.utils.data.default_collate``): a step's samples are known only once its quorum formed.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        batch_size: int | None = None,
        *,
        global_batch_size: int | None = None,
        steps: int | None = None,
        epochs: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        accumulation_steps: int = 1,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        session: Session | None = None,
    ) -> None:
        if isinstance(dataset, IterableDataset) or not all(hasattr(dataset, a) for a in ("__len__", "__getitem__")):
            # a committed step names its samples by position in the stream, which an iterable cannot seek to
            raise TypeError(
                f"ftjob.ft.DataLoader needs a map-style dataset (len() and dataset[i]), not {type(dataset).__name__}: "
                "a retried step or a healing group must re-read samples by index; wrap the samples in a "
                "torch.utils.data.Dataset that indexes them"
            )
        if (batch_size is None) == (global_batch_size is None):
            raise ValueError("give exactly one of batch_size (per rank and pass) or global_batch_size")
        if accumulation_steps < 1 or (steps is not None and steps < 1) or (epochs is not None and epochs < 1):
            raise ValueError("accumulation_steps, steps and epochs must be >= 1")
        self.dataset = dataset
        self._session = session or current_session()
        s = self._session
        self.accumulation_steps = accumulation_steps
        self.global_batch = global_batch_size or (batch_size or 0) * s.ranks * s.cfg.replicas * accumulation_steps
        self.order = SampleOrder(len(dataset), shuffle, seed)  # type: ignore[arg-type]
        self.steps = steps if steps is not None else (epochs or 1) * len(dataset) // self.global_batch  # type: ignore[arg-type]
        if self.steps < 1:
            raise ValueError(f"the dataset ({len(dataset)} samples) holds no global batch of {self.global_batch}")  # type: ignore[arg-type]
        self.collate_fn = collate_fn or default_collate
        self.cursor = 0
        s.total_steps = self.steps
        s.register_state("data", state_dict=self.state_dict, load_state_dict=self.load_state_dict)
        s.on_commit(self._committed)

    def state_dict(self) -> dict[str, Any]:
        """The loader's position in the sample stream (travels with healing and checkpoints)."""
        return LoaderState(cursor=self.cursor).model_dump()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resumes at a peer's or a checkpoint's position in the sample stream."""
        self.cursor = LoaderState.model_validate(state).cursor

    def _committed(self, _info: QuorumInfo) -> None:
        self.cursor += self.global_batch

    def __len__(self) -> int:
        """Batches this rank gets over a whole run."""
        return self.steps * self.accumulation_steps

    def __iter__(self) -> Iterator[Any]:
        s = self._session
        while True:
            s.close_open_step()
            s.start()
            if s.step >= self.steps:
                s.finish()
                return
            info = s.begin_step()
            # A spare or healing group is lent contributor 0's share: it runs the same loop, sends zeros.
            contributor = info.contributor_rank if info.contributing else 0
            shard = step_shard(
                self.cursor,
                self.global_batch,
                info.num_contributors,
                contributor,
                s.ranks,
                s.rank,
                self.accumulation_steps,
            )
            s.note_samples(StepSamples(self.cursor, self.global_batch, shard), info.contributing)
            for micro in shard.micro_batches:
                yield self.collate_fn([self.dataset[self.order.index(p)] for p in micro.positions()])
