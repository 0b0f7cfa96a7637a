"""The cross-group gradient average of one rank: bucketed all-reduces over the quorum's process group, started during
the backward pass when the parameters are registered (one rank per group), held back while gradients accumulate.

Every group issues the same collectives in the same order (grad_buckets plans the layout from the parameter list
alone); a group that does not contribute this step (a spare, a failed step) sends zeros so its peers never wait.

The gradient guard (ftjob.ft.integrity.guard) rides along: each bucket's norm is taken on the device as the bucket is
sent (no host sync per bucket), and after the buckets one more all-reduce of a [groups, 3] float64 table, where each
group fills only its own row (group id, contributing, sum of squares), is started behind them without waiting, so it
completes with them. Every group then holds every group's numbers and judges alike.

With the guard's sketch check (FTJOB_GUARD_SKETCH) that table is replaced by two small rounds after the buckets have
completed, that is once every group's contribution is fixed in the sum: an all-reduce of one random nonce per group
(their sum seeds this step's projection, ftjob.ft.integrity.sketch), then an all-gather of one row per group: its id,
whether it contributes, the sum of squares it says it sent, the sum of squares of the sum as it received it, the
sketch of what it sent (from a copy kept as each bucket was launched: the all-reduce overwrites the bucket) and the
sketch of the sum. An all-gather, not an all-reduce of rows: each row comes from its own group alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from ftjob.ft.allreduce.grad_buckets import BackwardLauncher, flatten, plan_buckets, unflatten_into
from ftjob.ft.allreduce.process_group import CollectiveError, CrossGroupPG
from ftjob.ft.integrity import sketch
from ftjob.ft.integrity.fault_injection import GradientFault
from ftjob.ft.integrity.guard import COLUMNS, FLOAT32_ROUNDOFF, SKETCH_COLUMNS
from ftjob.ft.recovery.codec import local_part


class GradientSync:
    """Averages gradients in place over a step's contributors (the Manager drives it once per step)."""

    def __init__(
        self,
        pg: CrossGroupPG,
        bucket_bytes: int,
        overlap: bool,
        guard: bool = False,
        group_id: int = 0,
        sketch_check: bool = False,
    ) -> None:
        self._pg = pg
        self._bucket_bytes = bucket_bytes
        self._overlap = overlap  # False for sharded groups: FSDP2 reduces inside the group after the backward
        self._layout: tuple[list[int], list[list[int]]] | None = None  # (param ids, buckets)
        self.launcher: BackwardLauncher | None = None
        self.weight = 1.0  # this step's gradient weight (ftjob.ft.wrappers.sharding): 1.0 unless shares are uneven
        self._guard, self._group_id = guard, group_id
        self._sketch = guard and sketch_check  # the guard's rows come from the sketch round instead of the table
        self._norms: list[torch.Tensor] = []  # this step's bucket norms (float32, on the buckets' device)
        self._sent: list[torch.Tensor] = []  # this step's buckets as sent (the sketch check: the sum overwrites them)
        self._copies: list[torch.Tensor] = []  # their buffers, kept from step to step
        self.corrupt: GradientFault | None = None  # this step's injected fault (tests only)
        self.guard_table: list[list[float]] | None = None  # after allreduce(): every group's row, when guarded
        # the unit roundoff of the buckets' dtype: how far the sum may honestly be from the sum of what was sent
        self.roundoff = FLOAT32_ROUNDOFF

    def register(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Lets each bucket's all-reduce start from the backward pass (hooks on ``params``, which must be the list
        later given to ``allreduce``)."""
        if not self._overlap or self.launcher is not None:
            return
        params = [p for p in params if p.requires_grad]
        self.launcher = BackwardLauncher(params, self._buckets(params))
        self.launcher.prepare = self._prepare

    def _buckets(self, params: list[torch.nn.Parameter]) -> list[list[int]]:
        ids = [id(p) for p in params]
        if self._layout is None or self._layout[0] != ids:
            self._layout = (ids, plan_buckets(params, self._bucket_bytes))
        return self._layout[1]

    def arm(self, overlap_now: bool, corrupt: GradientFault | None = None) -> None:
        """At a step's start: overlap this step's all-reduce with its backward pass, or not (alone, failed, spare).
        ``corrupt``: a fault to inject into each bucket this step (tests only)."""
        self.weight = 1.0
        self.corrupt = corrupt
        self._norms = []
        self._sent = []
        self.guard_table = None
        if self.launcher is None:
            return
        if overlap_now and self._pg.world > 1:
            self.launcher.arm(self._launch)
        else:
            self.launcher.disarm()

    def _launch(self, flat: torch.Tensor) -> object:
        """Starts one bucket's all-reduce from the backward pass, keeping a copy of it first for the sketch."""
        if self._sketch:
            self._keep(flat)
        return self._pg.allreduce_start(flat)

    def _keep(self, flat: torch.Tensor) -> None:
        """Copies a bucket as it is about to be sent (weighted, corrupted alike) into this step's next buffer."""
        i = len(self._sent)
        if i < len(self._copies) and self._copies[i].shape == flat.shape and self._copies[i].dtype == flat.dtype:
            self._copies[i].copy_(flat)
        else:
            copy = flat.detach().clone()
            self._copies[i:] = [copy]  # a changed layout: the buffers after it are rebuilt as they come
        self._sent.append(self._copies[i])

    def set_weight(self, weight: float) -> None:
        """Multiplies this group's gradients by ``weight`` before they are summed (set before the backward)."""
        self.weight = weight
        if self.launcher is not None:
            self.launcher.weight = weight

    def hold(self, held: bool) -> None:
        """While held (gradient accumulation), backward passes only accumulate: no bucket starts."""
        if self.launcher is not None:
            self.launcher.held = held

    def disarm(self) -> None:
        """Stops the backward pass from launching buckets (a step that will not be averaged)."""
        if self.launcher is not None:
            self.launcher.disarm()

    def _prepare(self, flat: torch.Tensor) -> None:
        """A bucket about to be sent, before its weight: inject this step's fault, take its norm. Taken before the
        weight, the norm is the raw gradient's (what dividing the weight back out would give, without dividing by a
        zero weight), so uneven shares of the batch compare alike. A lying fault corrupts after the norm."""
        fault = self.corrupt
        if fault is not None and not fault.hides_norm:
            fault(flat)
        if self._guard:
            self._norms.append(torch.linalg.vector_norm(flat, dtype=torch.float32))  # stays on the device: no sync
        if fault is not None and fault.hides_norm:
            fault(flat)

    def _table(self, contributing: bool, device: torch.device) -> torch.Tensor:
        """This group's row of the guard's table (zeros when it does not contribute: it is not judged)."""
        table = torch.zeros(self._pg.world, COLUMNS, dtype=torch.float64, device=device)
        if contributing:
            row = table[self._pg.replica_rank]
            row[0], row[1] = float(self._group_id), 1.0
            if self._norms:
                row[2] = torch.stack(self._norms).to(torch.float64).square().sum()
        return table

    def allreduce(
        self,
        params: list[torch.nn.Parameter],
        num_contributors: int,
        contributing: bool,
        failed: bool,
        should_abort: Callable[[], bool],
    ) -> str | None:
        """Sums the gradients across the quorum and divides by the contributors; returns why it failed, or None.

        A group that does not contribute (a spare, a healing group) sends zeros and receives the average, so it
        applies the same update as everyone; a step that already ``failed`` sends zeros so its peers are not left
        waiting, and keeps nothing (it will not commit)."""
        if self.launcher is not None and self.launcher.armed:
            return self._finish_overlapped(params, num_contributors, should_abort)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [local_part(p.grad) for p in params]
        buckets = self._buckets(params)
        sending = contributing and not failed
        if sending:
            flats = [flatten([grads[i] for i in b]) for b in buckets]
            for flat in flats:
                self._prepare(flat)
                if self.weight != 1.0:
                    flat.mul_(self.weight)
                if self._sketch:
                    self._keep(flat)
        else:
            flats = [torch.zeros(sum(grads[i].numel() for i in b), dtype=grads[b[0]].dtype, device=grads[b[0]].device)
                     for b in buckets]  # fmt: skip
        device = flats[0].device if flats else torch.device(self._pg.device)
        table = self._table(sending, device) if self._guard and not self._sketch else None
        try:
            self._pg.allreduce_sum(flats if table is None else [*flats, table], should_abort)
            if self._sketch:
                self._sketch_round(flats, sending, device, should_abort)
        except CollectiveError as e:
            return str(e)
        if table is not None:
            self.guard_table = table.tolist()  # the step's one host sync for the guard (its verdict decides the vote)
        if not failed:
            for flat, b in zip(flats, buckets, strict=True):
                unflatten_into(flat, [grads[i] for i in b], num_contributors)
        return None

    def _finish_overlapped(
        self, params: list[torch.nn.Parameter], num_contributors: int, should_abort: Callable[[], bool]
    ) -> str | None:
        launcher = self.launcher
        assert launcher is not None
        if [id(p) for p in params] != [id(p) for p in launcher.params]:
            raise RuntimeError("allreduce_gradients() got other parameters than register_params()")
        flats, works, error = launcher.finish()
        if error is not None:
            self._pg.abandon(works)  # some buckets never started: the group is already retired
            launcher.release()
            return str(error)
        device = flats[0].device if flats else torch.device(self._pg.device)
        table = self._table(True, device) if self._guard and not self._sketch else None
        try:
            if table is not None:  # queued behind the buckets still in flight: it completes with them
                works = [*works, self._pg.allreduce_start(table)]
        except CollectiveError as e:
            self._pg.abandon(works)  # the group was just retired with the buckets in flight
            launcher.release()
            return str(e)
        try:
            self._pg.allreduce_wait(works, should_abort)
            if self._sketch:  # before the average: the buckets hold the sum itself
                self._sketch_round(flats, True, device, should_abort)
        except CollectiveError as e:
            launcher.release()  # the abandoned collectives may still write into the buckets
            return str(e)
        if table is not None:
            self.guard_table = table.tolist()
        launcher.average(num_contributors)  # the grads are views of the buckets: divided in place
        return None

    def _sketch_round(
        self, sums: list[torch.Tensor], sending: bool, device: torch.device, should_abort: Callable[[], bool]
    ) -> None:
        """After the buckets completed (``sums`` hold the sum, not yet divided): the seed round and the sketch round
        (the module's docstring); leaves every group's row in ``guard_table``. Raises CollectiveError.

        The nonce all-reduce starts only after this group's buckets completed, and the seed needs every group's
        nonce: so nobody learns the projection before every contribution to the sum is fixed."""
        self.roundoff = max(
            [torch.finfo(f.dtype).eps / 2 for f in sums if f.is_floating_point()], default=FLOAT32_ROUNDOFF
        )
        nonce = torch.tensor([sketch.draw_nonce()], dtype=torch.int64, device=device)
        self._pg.allreduce_sum([nonce], should_abort)
        seed = sketch.derive_seed(int(nonce.item()), self._pg.quorum_id or 0, self._pg.rank_in_group)
        sent: list[torch.Tensor] | None = self._sent if sending else None
        fault = self.corrupt
        if sent is not None and fault is not None and fault.claim is not None:
            sent = [fault.claim(c) for c in sent]  # a lying group sketches a gradient it did not send
        own, total = sketch.Projection(seed).sketch([sent, sums], device)
        row = torch.zeros(SKETCH_COLUMNS, dtype=torch.float64, device=device)
        row[0] = float(self._group_id)
        if sending:
            row[1] = 1.0
            if self._norms:  # what it says it sent: the raw gradient's norms, weighted as it was sent
                row[2] = torch.stack(self._norms).to(torch.float64).square().sum() * self.weight**2
        if sums:
            row[3] = torch.stack([torch.linalg.vector_norm(f, dtype=torch.float64) for f in sums]).square().sum()
        row[4 : 4 + sketch.DIM] = own
        row[4 + sketch.DIM :] = total
        self.guard_table = self._pg.allgather(row, should_abort).tolist()
