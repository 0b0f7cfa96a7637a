"""Optimizer-side wrappers: each acts only when the step commits, so a failed step leaves no trace anywhere."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from ftjob.ft.setup import current_session
from ftjob.ft.step.session import Session


class Optimizer(torch.optim.Optimizer):
    """Wraps any ``torch.optim.Optimizer``. ``step()`` is the commit point: the group votes, and the wrapped
    optimizer steps only if the step commits (else the step is trained again). Pass this wrapper, not the inner
    optimizer, to LR schedulers and ``GradScaler``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, session: Session | None = None) -> None:
        # No super().__init__(): every optimizer attribute is the wrapped optimizer's (delegated below).
        self.optimizer = optimizer
        self._session = session or current_session()
        self._session.register_optimizer(optimizer)

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:
        """The wrapped optimizer's per-parameter state."""
        return self.optimizer.state

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        """The wrapped optimizer's default hyperparameters."""
        return self.optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """The commit point: the group votes, and the wrapped optimizer steps only if the step commits. No closure."""
        if closure is not None:
            raise ValueError("ftjob.ft.Optimizer.step() takes no closure: the step commits once, after its backward")
        self._session.commit(self.optimizer.step)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads the wrapped optimizer's state."""
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a parameter group to the wrapped optimizer."""
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"ftjob.ft.Optimizer({self.optimizer!r})"


class LRScheduler:
    """Wraps any LR scheduler built on the ``ftjob.ft.Optimizer``: ``step()`` steps it only after a committed step,
    so the schedule follows the job's committed steps. Its state travels with healing and checkpoints."""

    def __init__(self, scheduler: Any, session: Session | None = None) -> None:
        self.scheduler = scheduler
        self._session = session or current_session()
        self._session.register_state("scheduler", scheduler)

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Steps the wrapped scheduler, only after a committed step."""
        self._session.close_open_step()
        if self._session.last_committed:
            self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        """The wrapped scheduler's last learning rates."""
        return list(self.scheduler.get_last_lr())

    def state_dict(self) -> dict[str, Any]:
        """The wrapped scheduler's state."""
        return dict(self.scheduler.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads the wrapped scheduler's state."""
        self.scheduler.load_state_dict(state_dict)


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose ``update()`` moves the scale only after a committed step, so every group keeps
    the same scale; the scale travels with healing and checkpoints. Use it in the usual order::

        scaler.scale(loss).backward()      # gradients averaged across groups (still scaled: one scale everywhere)
        scaler.unscale_(optimizer)         # optional, e.g. before clipping
        scaler.step(optimizer)             # commits; skipped on inf/NaN (then the step commits without an update)
        scaler.update()
    """

    def __init__(self, device: str = "cuda", *, session: Session | None = None, **kwargs: Any) -> None:
        super().__init__(device, **kwargs)
        self._session = session or current_session()
        self._session.register_state("scaler", self)
        self._session.loss_scaling = self.is_enabled()  # overflows are its business, not the gradient guard's

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Moves the scale only after a committed step; a failed step keeps it (and clears the step's inf
        bookkeeping)."""
        self._session.close_open_step()
        if not self.is_enabled():
            return
        if self._session.last_committed:
            super().update(new_scale)
        elif self._scale is not None:  # a failed step keeps the scale (and clears this step's inf bookkeeping)
            super().update(self.get_scale())
