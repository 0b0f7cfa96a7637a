"""State dicts <-> (a typed JSON tree, one flat byte buffer) for live recovery. Nothing is ever unpickled: the tree
is ftjob.contract.recovery_api's StateNode (dict keys keep their int/str type, tuples stay tuples) and tensors are raw
bytes at aligned offsets.

DTensors (FSDP2) travel as their local shard; the receiving rank rebuilds them on its own device mesh.
"""

from __future__ import annotations

import sys
import typing
from dataclasses import dataclass
from typing import Any

import torch
from ftjob.contract.recovery_api import (
    DictNode,
    DTensorSpec,
    DTypeName,
    PartialPlacement,
    Placement,
    ReplicatePlacement,
    ShardPlacement,
    StateNode,
    TensorInfo,
    TensorRef,
    TupleNode,
)

ALIGN = 64  # every tensor starts at a multiple of this, so a byte view can be re-typed to any dtype
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in typing.get_args(DTypeName)}


class CodecError(ValueError):
    """The state cannot be encoded (the message names the offending entry), or received metadata is malformed."""


@dataclass
class Packed:
    state: StateNode  # the tree; tensors replaced by TensorRef indices into ``tensors``
    tensors: list[TensorInfo]
    buffer: torch.Tensor  # uint8 on the CPU (pinned when the state lives on an accelerator)
    copied: Any = None  # a CUDA event when the copies into ``buffer`` are still in flight


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor, without importing torch.distributed.tensor: that import costs ~0.9 s (it pulls
    sympy) on every trainer start, and no DTensor can exist until FSDP2 has imported it anyway."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor itself."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def _placement(p: Any) -> Placement:
    from torch.distributed.tensor import Partial, Replicate, Shard

    if isinstance(p, Shard):
        return ShardPlacement(dim=p.dim)
    if isinstance(p, Replicate):
        return ReplicatePlacement()
    if isinstance(p, Partial):
        return PartialPlacement()
    raise CodecError(f"unsupported DTensor placement {p!r}")


def _torch_placement(p: Placement) -> Any:
    from torch.distributed.tensor import Partial, Replicate, Shard

    if isinstance(p, ShardPlacement):
        return Shard(p.dim)
    return Replicate() if isinstance(p, ReplicatePlacement) else Partial()


def encode(state: Any) -> tuple[StateNode, list[tuple[torch.Tensor, dict[str, Any]]]]:
    """The state's tree and its tensors (not copied), or CodecError naming the first entry recovery cannot carry."""
    found: list[tuple[torch.Tensor, dict[str, Any]]] = []

    def node(obj: Any, path: str) -> StateNode:
        if isinstance(obj, torch.Tensor):
            info: dict[str, Any] = {"dtensor": None}
            if is_dtensor(obj):
                info["dtensor"] = DTensorSpec(
                    placements=[_placement(p) for p in obj.placements],
                    shape=list(obj.shape),
                    stride=list(obj.stride()),
                )
                obj = obj.to_local()
            dtype = str(obj.dtype).removeprefix("torch.")
            if dtype not in DTYPES:
                raise CodecError(f"tensor at {path} has dtype {obj.dtype}, which recovery does not carry")
            info.update(dtype=dtype, shape=list(obj.shape), nbytes=obj.numel() * obj.element_size())
            found.append((obj.detach(), info))
            return TensorRef(index=len(found) - 1)
        if isinstance(obj, dict):
            items: list[tuple[str | int, StateNode]] = []
            for k, v in obj.items():
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise CodecError(f"state key {k!r} at {path} must be a str or int")
                items.append((k, node(v, f"{path}/{k}")))
            return DictNode(items=items)
        if isinstance(obj, list):
            return [node(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return TupleNode(values=[node(v, f"{path}[{i}]") for i, v in enumerate(obj)])
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        raise CodecError(
            f"state at {path} is a {type(obj).__module__}.{type(obj).__qualname__}: recovery carries tensors, "
            "dicts, lists, tuples, str, int, float, bool and None only"
        )

    return node(state, "state"), found


def pack(state: Any) -> Packed:
    """One copy of every tensor into a fresh buffer: a snapshot the training thread may keep changing after."""
    tree, found = encode(state)
    offset = 0
    for _t, info in found:
        info["offset"] = offset
        offset += (info["nbytes"] + ALIGN - 1) // ALIGN * ALIGN
    on_cuda = any(t.is_cuda for t, _ in found)
    buffer = torch.empty(offset, dtype=torch.uint8, pin_memory=on_cuda and torch.cuda.is_available())
    for t, info in found:
        if info["nbytes"]:
            dst = buffer[info["offset"] : info["offset"] + info["nbytes"]].view(t.dtype).view(t.shape)
            dst.copy_(t, non_blocking=t.is_cuda)
    copied = None
    if on_cuda:
        copied = torch.cuda.Event()
        copied.record()
    return Packed(state=tree, tensors=[TensorInfo(**info) for _t, info in found], buffer=buffer, copied=copied)


def _lookup(template: Any, path: list[Any]) -> Any:
    for key in path:
        try:
            template = template[key]
        except (KeyError, IndexError, TypeError):
            return None
    return template


def _any_mesh(template: Any) -> Any:
    if is_dtensor(template):
        return template.device_mesh
    values = template.values() if isinstance(template, dict) else template if isinstance(template, list) else ()
    for v in values:
        mesh = _any_mesh(v)
        if mesh is not None:
            return mesh
    return None


def unpack(tree: StateNode, tensors: list[TensorInfo], buffer: torch.Tensor, template: Any = None) -> Any:
    """Rebuilds the state from a verified buffer. Tensors are views of ``buffer`` (on its device); DTensors are
    rebuilt on the mesh of the matching entry of ``template`` (the receiver's own state dict)."""
    mesh = None

    def tensor(ref: TensorRef, path: list[Any]) -> torch.Tensor:
        nonlocal mesh
        if ref.index >= len(tensors):
            raise CodecError(f"recovery metadata references tensor {ref.index} of {len(tensors)}")
        info = tensors[ref.index]
        dtype = DTYPES[info.dtype]
        numel = 1
        for s in info.shape:
            numel *= s
        if numel * dtype.itemsize != info.nbytes or info.offset % ALIGN or info.offset + info.nbytes > buffer.numel():
            raise CodecError(
                f"recovery metadata for tensor {ref.index} is inconsistent (shape {info.shape}, {info.nbytes} bytes)"
            )
        local = buffer[info.offset : info.offset + info.nbytes].view(dtype).view(info.shape)
        spec = info.dtensor
        if spec is None:
            return local
        from torch.distributed.tensor import DTensor

        shape, stride = torch.Size(spec.shape), tuple(spec.stride)
        like = _lookup(template, path)
        if is_dtensor(like):
            return DTensor.from_local(local, like.device_mesh, like.placements, shape=shape, stride=stride)
        mesh = mesh or _any_mesh(template)
        if mesh is None:
            raise CodecError("received a sharded (DTensor) state but this rank's own state has no device mesh")
        placements = [_torch_placement(p) for p in spec.placements]
        return DTensor.from_local(local, mesh, placements, shape=shape, stride=stride)

    def decode(node: StateNode, path: list[Any]) -> Any:
        if isinstance(node, list):
            return [decode(v, [*path, i]) for i, v in enumerate(node)]
        if isinstance(node, TensorRef):
            return tensor(node, path)
        if isinstance(node, TupleNode):
            return tuple(decode(v, [*path, i]) for i, v in enumerate(node.values))
        if isinstance(node, DictNode):
            return {k: decode(v, [*path, k]) for k, v in node.items}
        return node

    return decode(tree, [])
