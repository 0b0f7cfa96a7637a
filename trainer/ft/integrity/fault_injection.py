"""Fault injection for tests (env FTJOB_FAULT_INJECTION): one named group misbehaves the way a faulty GPU would.

    group=1,kind=nan,step=20,count=3            a NaN in each gradient bucket it sends, for 3 step attempts from step 20
    group=1,kind=scale,factor=1000,step=20,count=3   its gradient buckets x1000, likewise
    group=2,kind=bitflip,step=30                the lowest mantissa bit of one element of one parameter flipped
                                                right after the commit of step 30 (once)
    group=1,kind=misreport,factor=1000,step=20  its buckets x1000, but it reports the norm of its clean gradient
    group=1,kind=lie,factor=1000,step=20        likewise, and its sketch (the guard's sketch check) is of the clean
                                                gradient too: a group lying to the guard wherever it can

``nan`` and ``scale`` corrupt the buckets before the guard computes their norm (the guard sees what a peer would
receive), as a faulty GPU would; ``misreport`` and ``lie`` after it, as a lying group would. An attempt counts only
when this group contributes. Only the named group's first incarnation (FTJOB_GENERATION unset
or "0") injects, so the replacement the lighthouse and the operator bring up trains cleanly.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from ftjob import contract
from ftjob.ft.recovery.codec import local_part

log = logging.getLogger("ftjob.fault_injection")

Kind = Literal["nan", "scale", "bitflip", "lie", "misreport"]
KINDS = ("nan", "scale", "bitflip", "lie", "misreport")
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class GradientFault:
    """One step attempt's gradient fault: ``corrupt`` changes each bucket in place before it is sent. A lying fault
    takes the bucket's norm for its report before corrupting it (``hides_norm``) and, for the guard's sketch,
    claims to have sent ``claim(bucket as sent)`` (None: its sketch tells the truth)."""

    corrupt: Callable[[torch.Tensor], None]
    hides_norm: bool = False
    claim: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __call__(self, flat: torch.Tensor) -> None:
        self.corrupt(flat)


@dataclass
class FaultInjection:
    """A fault a test injects into one group at one step (FTJOB_FAULT_INJECTION): corrupted gradients (NaN, scaled,
    a lie to the guard) or a flipped bit in the state."""

    group: str
    kind: Kind
    step: int
    count: int = 1  # gradient faults: step attempts to corrupt
    factor: float = 1000.0  # kind=scale

    @classmethod
    def parse(cls, spec: str) -> FaultInjection:
        """``group=G,kind=K,step=S[,count=N][,factor=F]``; ValueError says what is wrong."""
        fields: dict[str, str] = {}
        for part in spec.split(","):
            key, sep, value = part.strip().partition("=")
            if not sep or key not in ("group", "kind", "step", "count", "factor") or key in fields:
                raise ValueError(f"{contract.ENV_FAULT_INJECTION}={spec!r}: bad or repeated field {part.strip()!r}")
            fields[key] = value.strip()
        missing = {"group", "kind", "step"} - fields.keys()
        if missing:
            raise ValueError(f"{contract.ENV_FAULT_INJECTION}={spec!r} lacks {sorted(missing)}")
        if fields["kind"] not in KINDS:
            raise ValueError(
                f"{contract.ENV_FAULT_INJECTION}: kind must be nan, scale or bitflip (or, lying to the guard, lie or "
                f"misreport), got {fields['kind']!r}"
            )
        try:
            fault = cls(
                group=fields["group"],
                kind=fields["kind"],  # type: ignore[arg-type]
                step=int(fields["step"]),
                count=int(fields.get("count", "1")),
                factor=float(fields.get("factor", "1000")),
            )
        except ValueError:
            raise ValueError(f"{contract.ENV_FAULT_INJECTION}={spec!r}: step and count must be integers, factor a "
                             "number") from None  # fmt: skip
        if (
            fault.step < 0
            or fault.count < 1
            or not math.isfinite(fault.factor)
            or (fault.kind == "lie" and not fault.factor)
        ):
            raise ValueError(
                f"{contract.ENV_FAULT_INJECTION}={spec!r}: step >= 0, count >= 1, finite factor (not 0 for lie)"
            )
        return fault

    @classmethod
    def from_environ(cls, group: str, environ: Mapping[str, str] | None = None) -> FaultInjection | None:
        """This process's fault: only for the named group's first incarnation."""
        env = os.environ if environ is None else environ
        spec = env.get(contract.ENV_FAULT_INJECTION, "").strip()
        if not spec:
            return None
        fault = cls.parse(spec)
        if fault.group != group or env.get(contract.ENV_GENERATION, "0").strip() not in ("", "0"):
            return None
        return fault

    def corruption(self, step: int, contributing: bool) -> GradientFault | None:
        """What to do to each gradient bucket this step attempt (None: nothing); counts the attempt."""
        if self.kind == "bitflip" or not contributing or step < self.step or self.count <= 0:
            return None
        self.count -= 1
        log.warning("fault injection: %s gradient of group %s at step %d", self.kind, self.group, step)
        if self.kind == "nan":
            return GradientFault(_poison)
        factor = self.factor

        def scale(flat: torch.Tensor) -> None:
            flat.mul_(factor)

        if self.kind == "scale":
            return GradientFault(scale)
        if self.kind == "misreport":
            return GradientFault(scale, hides_norm=True)
        return GradientFault(scale, hides_norm=True, claim=lambda sent: sent / factor)

    def flip_due(self, step: int) -> bool:
        """True once: at the first step boundary at or after the bit-flip step."""
        if self.kind != "bitflip" or step < self.step or self.count <= 0:
            return False
        self.count = 0
        return True


def _poison(flat: torch.Tensor) -> None:
    if flat.numel():
        flat[0] = float("nan")


def flip_lowest_bit(tensors: Sequence[torch.Tensor]) -> str:
    """Flips the lowest mantissa bit of one element of the first non-empty floating tensor (in place, in its local
    shard) and says what it flipped. The element is the one furthest below the next power of two: only an update
    that carried it past that power (a coarser float spacing) could round the flip away before the next digest, as
    it could for an element just below one; a zero would lose it at once."""
    for i, t in enumerate(tensors):
        local = local_part(t).detach()
        if local.is_floating_point() and local.numel():
            flat = local.view(-1)  # a view: the flip lands in the tensor itself
            mantissa, exponent = torch.frexp(flat.float())
            gap = torch.ldexp(1.0 - mantissa.abs(), exponent.float())  # next power of two - |x|
            gap[(flat == 0) | ~torch.isfinite(flat)] = -1.0
            j = int(gap.argmax())
            before = float(flat[j])
            flat[j : j + 1].view(_INT_OF_SIZE[local.element_size()]).bitwise_xor_(1)
            return f"tensor {i} element {j}: {before!r} -> {float(flat[j])!r}"
    raise ValueError("no floating-point tensor to flip a bit in")
