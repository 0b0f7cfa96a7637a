"""Digests that prove replicas bitwise equal: groups compare them at the end of a run (run records, lighthouse)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch
from ftjob.ft.recovery.codec import local_part
from torch import nn


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Name -> full parameter tensor (CPU), name-sorted. Sharded (DTensor) parameters are gathered: with FSDP2
    ``full_tensor()`` is a collective, so every rank of the group must call this together."""
    out = {}
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out[name] = t.cpu().contiguous()
    return out


def digest_of(params: dict[str, torch.Tensor]) -> str:
    """sha256 over each tensor's name and raw bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(params[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def model_digest(model: nn.Module) -> str:
    """The replica-identity digest: sha256 over every parameter's bytes (full tensors), name-sorted. A collective
    for sharded models."""
    return digest_of(full_params(model))


def local_digest(tensors: Iterable[torch.Tensor]) -> str:
    """sha256 over the bytes of the tensors (local shards for DTensors): no collective."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(local_part(t).detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())  # no extra copy
    return h.hexdigest()


def replica_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """What every replica must hold bitwise equal after a commit: the model's parameters (in its order) and the
    optimizer's per-parameter state (in its parameter order, keys sorted; non-tensor values as float64 scalars).
    Not buffers (e.g. BatchNorm statistics follow each group's own data), the data position or user state."""
    out = [p for p in model.parameters()]
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                for key in sorted(state, key=str):
                    v = state[key]
                    if isinstance(v, torch.Tensor):
                        out.append(v)
                    elif isinstance(v, (int, float, bool)):
                        out.append(torch.tensor(float(v), dtype=torch.float64))
    return out


def combine(digests: Iterable[str]) -> str:
    """One digest for a sharded group from its ranks' digests (in rank order)."""
    return hashlib.sha256("".join(digests).encode()).hexdigest()
