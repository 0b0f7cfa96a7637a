"""The model wrapper: DistributedDataParallel's interface, with the replicas spread over fault-tolerant groups."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from ftjob.ft.setup import current_session
from ftjob.ft.step.session import Session
from torch import nn
from torch.utils._pytree import tree_leaves  # private: torch has no public pytree (tests/trainer/test_private_hooks.py)


class DistributedDataParallel(nn.Module):
    """Wraps any ``nn.Module`` (plain, or sharded inside the group with FSDP2's ``fully_shard``) in place of
    ``torch.nn.parallel.DistributedDataParallel``.

    Calling it begins the step if no ``ftjob.ft.DataLoader`` did (joining the quorum; healing first if this group is
    behind). Its backward pass all-reduces the gradients across the quorum's groups, bucket by bucket while the
    backward still runs (one rank per group), and returns with the job-wide average in ``.grad``, so clipping sees what
    every group sees. ``no_sync()`` accumulates without communicating, as with DDP. The loss is a mean over the batch
    (PyTorch's default reduction), as with DDP; groups given uneven shares of the global batch are weighed exactly.
    """

    def __init__(self, module: nn.Module, session: Session | None = None) -> None:
        super().__init__()
        self.module = module
        self._session = session or current_session()
        self._session.register_model(module)
        self._sync = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Begins the step (or the next micro-batch of it) and runs the module; outside ``no_sync`` the
        gradients are averaged across the quorum once the backward pass is over."""
        session = self._session
        session.begin_step()
        session.hold_gradient_sync(not self._sync)
        out = self.module(*args, **kwargs)
        if self._sync:
            _average_after_backward(out, session)
        return out

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients; the first one outside averages the sum."""
        fsdp = _fsdp_modules(self.module)
        old, self._sync = self._sync, False
        for m in fsdp:
            m.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self._sync = old
            for m in fsdp:
                m.set_requires_gradient_sync(True)


def _fsdp_modules(module: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def _average_after_backward(out: Any, session: Session) -> None:
    """Hooks on the output: when the backward pass reaches it, queue the cross-group average for the pass's end."""
    tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    queued = [False]

    def hook(_grad: torch.Tensor) -> None:
        if not queued[0]:
            queued[0] = True
            queue = torch.autograd.graph.queue_callback
            # Re-queued from the first callback, ours runs after every callback queued meanwhile (FSDP2's
            # reduce-scatter finishes in one): the gradients are final when it averages them.
            queue(lambda: queue(session.end_backward))

    for t in tensors:
        t.register_hook(hook)
