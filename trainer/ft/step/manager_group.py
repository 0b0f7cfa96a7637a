"""What the ranks of one replica group tell each other (over the group's default process group, no pickle):
rank 0's lighthouse answer, every rank's addresses, and unanimous votes (with the guard's table summed over the
ranks). The commit vote also carries each rank's wish to leave the job (it got SIGTERM): the group leaves as one,
after the same step, if any rank wishes to."""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


class InGroup:
    """Collectives among the ranks of one replica group (the default process group): broadcasts of rank 0's answers,
    gathers and unanimous votes. A group of one needs no torch.distributed."""

    def __init__(self, rank: int, world_size: int) -> None:
        if world_size > 1 and not dist.is_initialized():
            raise ValueError(
                f"world_size={world_size} needs torch.distributed initialised for the group's own ranks "
                "(dist.init_process_group with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT) before creating the Manager"
            )
        if world_size > 1 and (dist.get_world_size() != world_size or dist.get_rank() != rank):
            raise ValueError(
                f"ManagerConfig says rank {rank} of {world_size} but the default process group is rank "
                f"{dist.get_rank()} of {dist.get_world_size()}; pass the group's own rank and size"
            )
        self.rank = rank
        self.world_size = world_size
        self._device = "cpu"
        if world_size > 1 and dist.get_backend() == "nccl":
            self._device = f"cuda:{torch.cuda.current_device()}"

    def _tensor(self, data: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self._device)

    def broadcast_json(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.world_size == 1:
            return obj
        raw = json.dumps(obj).encode() if self.rank == 0 else b""
        size = self._tensor([len(raw)], torch.int64)
        dist.broadcast(size, src=0)
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=self._device)
        if self.rank == 0:
            buf.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        dist.broadcast(buf, src=0)
        return json.loads(bytes(buf.cpu().numpy()))

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if self.world_size == 1:
            return [obj]
        raw = json.dumps(obj).encode()
        sizes = [self._tensor([0], torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, self._tensor([len(raw)], torch.int64))
        longest = max(int(s.item()) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8, device=self._device)
        mine[: len(raw)].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        bufs = [torch.empty(longest, dtype=torch.uint8, device=self._device) for _ in range(self.world_size)]
        dist.all_gather(bufs, mine)
        return [json.loads(bytes(b[: int(s.item())].cpu().numpy())) for b, s in zip(bufs, sizes, strict=True)]

    def all_true(self, flag: bool) -> bool:
        """Unanimous vote: True only if every rank of the group says True."""
        if self.world_size == 1:
            return flag
        t = self._tensor([1 if flag else 0], torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def vote(self, flag: bool, leaving: bool) -> tuple[bool, bool]:
        """The commit vote: (every rank says True, some rank is leaving), in one all-reduce."""
        if self.world_size == 1:
            return flag, leaving
        t = self._tensor([0 if flag else 1, 1 if leaving else 0], torch.int32)  # summed: ranks against, leaving
        dist.all_reduce(t)
        against, leavers = t.tolist()
        return against == 0, leavers > 0

    def all_true_summing(
        self, flag: bool, table: list[list[float]] | None, rows: int, columns: int, leaving: bool = False
    ) -> tuple[bool, list[list[float]], bool]:
        """``vote`` that also sums every rank's ``rows`` x ``columns`` table (a rank without one sends zeros), in the
        same single all-reduce: the vote a sharded group takes anyway carries its shards' guard rows. Returns
        (every rank says True, the summed table, some rank is leaving)."""
        if table is not None and len(table) != rows:
            table, flag = None, False  # not this quorum's table: this rank cannot vote for the step
        if self.world_size == 1:
            return flag, table if table is not None else [[0.0] * columns for _ in range(rows)], leaving
        t = torch.zeros(2 + rows * columns, dtype=torch.float64, device=self._device)
        t[0] = 0.0 if flag else 1.0  # summed: the number of ranks against
        t[1] = 1.0 if leaving else 0.0  # summed: the number of ranks leaving
        if table is not None:
            t[2:] = torch.tensor(table, dtype=torch.float64).flatten()
        dist.all_reduce(t)
        values = t.tolist()
        rows_ = [values[2 + r * columns : 2 + (r + 1) * columns] for r in range(rows)]
        return values[0] == 0.0, rows_, values[1] > 0.0
