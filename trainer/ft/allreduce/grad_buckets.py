"""Gradient buckets for the cross-group all-reduce.

Every group must issue the same collectives in the same order with the same sizes, so the layout is a pure function
of the parameter list: reverse registration order (the backward pass finishes the last layers first), split by
dtype/device and by size, the first bucket small so that the first collective starts early.

For an unsharded model (one rank per group) ``BackwardLauncher`` starts each bucket's all-reduce from the backward
pass, as soon as the last gradient of that bucket is final, instead of after the whole backward: the same overlap
DDP gets. Buckets are launched strictly in layout order whatever order their gradients finish in, so every group
still issues the identical sequence. FSDP2 (several ranks per group) reduces inside the group after the backward,
so sharded models keep the post-backward path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from ftjob.ft.recovery.codec import local_part

FIRST_BUCKET_BYTES = 1024 * 1024


def plan_buckets(
    params: Sequence[torch.Tensor], bucket_bytes: int, first_bucket_bytes: int = FIRST_BUCKET_BYTES
) -> list[list[int]]:
    """Parameter indices per bucket, in launch order."""
    buckets: list[list[int]] = []
    open_: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}  # kind -> (bucket, bytes so far)
    for i in reversed(range(len(params))):
        t = local_part(params[i])
        kind, size = (t.dtype, t.device), t.numel() * t.element_size()
        current, used = open_.get(kind, ([], 0))
        limit = first_bucket_bytes if not buckets else bucket_bytes
        if current and used + size > limit:
            buckets.append(current)
            current, used = [], 0
        open_[kind] = ([*current, i], used + size)
    buckets.extend(b for b, _ in open_.values() if b)
    return buckets


def flatten(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """A fresh flat copy (never a view of the grads: an abandoned collective may still write into it)."""
    return torch.cat([g.reshape(-1) for g in grads])


def unflatten_into(flat: torch.Tensor, grads: Sequence[torch.Tensor], divisor: int) -> None:
    """Copies a reduced flat bucket back into its gradients, divided by ``divisor`` (the contributors) first."""
    if divisor > 1:
        flat.div_(divisor)
    pieces = flat.split([g.numel() for g in grads])
    torch.foreach.copy_(list(grads), [piece.view_as(g) for piece, g in zip(pieces, grads, strict=True)])


class BackwardLauncher:
    """Starts bucket all-reduces from gradient hooks while the backward pass runs. With gradient accumulation the
    earlier backward passes run ``held`` (hooks ignored); the last one launches.

    The buckets are persistent flat buffers and each ``.grad`` is a view into its bucket (DDP's
    ``gradient_as_bucket_view``): the backward accumulates straight into the bucket and the average lands in the
    grads in place, with no copy in or out and no fresh bucket memory to fault in every step. A grad replaced by
    someone else (``zero_grad(set_to_none=True)``, the first backward) is copied in and re-pointed once, by its hook.
    A step whose collectives were abandoned (``release``) leaves its buffers to them: they may still be written, so
    the grads are copied out and the next step gets new buffers."""

    def __init__(self, params: Sequence[torch.nn.Parameter], buckets: list[list[int]]) -> None:
        self.params = list(params)
        self.buckets = buckets
        self._bucket_of = {i: b for b, members in enumerate(buckets) for i in members}
        self._launch: Callable[[torch.Tensor], Any] | None = None
        self._missing: list[int] = []
        self._next = 0
        self._buffers: list[torch.Tensor] = []  # one flat buffer per bucket ([] until the first arm / a release)
        self._views: list[torch.Tensor] = []  # per parameter: its slice of its bucket, shaped like it
        self._settled = True  # False while a started bucket's all-reduce was neither averaged nor released
        self.flats: list[torch.Tensor] = []
        self.works: list[Any] = []
        self.error: Exception | None = None
        self.held = False
        self.weight = 1.0  # multiplies this group's gradients before the sum (uneven shares of the batch)
        self.prepare: Callable[[torch.Tensor], None] | None = None  # sees each bucket before weighting (the guard)
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self.params)]

    @property
    def armed(self) -> bool:
        """Whether the backward pass now launches the buckets whose gradients are final (between ``arm`` and
        ``disarm``)."""
        return self._launch is not None

    def _allocate(self) -> None:
        self._buffers, self._views = [], [torch.empty(0)] * len(self.params)
        for members in self.buckets:
            first = self.params[members[0]]
            flat = torch.zeros(sum(self.params[i].numel() for i in members), dtype=first.dtype, device=first.device)
            offset = 0
            for i in members:
                p = self.params[i]
                self._views[i] = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
            self._buffers.append(flat)

    def _adopt(self, i: int) -> None:
        """Makes parameter ``i``'s grad its bucket view (copying its value in; zeros for a missing grad)."""
        p, view = self.params[i], self._views[i]
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
        else:
            return
        p.grad = view

    def arm(self, launch: Callable[[torch.Tensor], Any]) -> None:
        """From now until ``finish``, buckets whose gradients are final are handed to ``launch``."""
        if not self._settled:  # the last step started buckets nobody waited for: they may still be written
            self.release()
        if not self._buffers:
            self._allocate()
        self._launch = launch
        self.weight = 1.0
        self._missing = [len(b) for b in self.buckets]
        self._next = 0
        self.flats, self.works, self.error = [], [], None

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def ready(_param: torch.Tensor) -> None:
            if self._launch is None or self.held:
                return
            self._adopt(index)
            self._missing[self._bucket_of[index]] -= 1
            while self._next < len(self.buckets) and self._missing[self._next] <= 0:
                self._start(self._next)

        return ready

    def _start(self, b: int) -> None:
        self._next = b + 1
        if self.error is not None or self._launch is None:
            return
        for i in self.buckets[b]:  # unused parameters (no hook ran): zeros, or what their grad holds
            self._adopt(i)
        flat = self._buffers[b]
        if self.prepare is not None:
            self.prepare(flat)
        if self.weight != 1.0:
            flat.mul_(self.weight)
        try:
            self.works.append(self._launch(flat))
            self.flats.append(flat)
            self._settled = False
        except Exception as e:  # the process group was retired (abort): the step fails in finish()
            self.error = e

    def finish(self) -> tuple[list[torch.Tensor], list[Any], Exception | None]:
        """Starts the buckets the backward did not complete (unused parameters), in order; disarms."""
        while self._next < len(self.buckets):
            self._start(self._next)
        self._launch = None
        return self.flats, self.works, self.error

    def average(self, divisor: int) -> None:
        """After the buckets' all-reduces completed: the sums in the buckets become the average in the grads."""
        self._settled = True
        for flat in self._buffers:
            if divisor > 1:
                flat.div_(divisor)
        for i, p in enumerate(self.params):
            if p.grad is not None and p.grad.data_ptr() != self._views[i].data_ptr():  # replaced since its hook
                p.grad.copy_(self._views[i])

    def release(self) -> None:
        """The step's collectives were abandoned and may still write into the buffers: the grads get copies of
        their own, and the next ``arm`` new buffers."""
        self._settled = True
        for i, p in enumerate(self.params):
            if self._views and p.grad is not None and p.grad.data_ptr() == self._views[i].data_ptr():
                p.grad = p.grad.clone()
        self._buffers, self._views = [], []

    def disarm(self) -> None:
        """Stops launching buckets from the gradient hooks (the buffers stay for the next step)."""
        self._launch = None

    def remove(self) -> None:
        """Removes the gradient hooks from the parameters: the launcher is done for good."""
        for h in self._handles:
            h.remove()
