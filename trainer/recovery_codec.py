"""State dicts <-> (JSON metadata, one flat byte buffer) for live recovery. Nothing is ever unpickled: the metadata is
plain JSON (dict keys keep their int/str type, tuples stay tuples) and tensors are raw bytes at aligned offsets.

DTensors (FSDP2) travel as their local shard; the receiving rank rebuilds them on its own device mesh.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

ALIGN = 64  # every tensor starts at a multiple of this, so a byte view can be re-typed to any dtype
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


class CodecError(ValueError):
    """The state cannot be encoded, or received metadata is malformed."""


@dataclass
class Packed:
    meta: Any  # JSON tree; tensors replaced by {"__tensor__": index}
    tensors: list[dict[str, Any]]  # per tensor: dtype, shape, offset, nbytes, dtensor
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


def _placement_json(p: Any) -> list[Any]:
    from torch.distributed.tensor import Partial, Replicate, Shard

    if isinstance(p, Shard):
        return ["shard", p.dim]
    if isinstance(p, Replicate):
        return ["replicate"]
    if isinstance(p, Partial):
        return ["partial"]
    raise CodecError(f"unsupported DTensor placement {p!r}")


def _placement_from_json(p: list[Any]) -> Any:
    from torch.distributed.tensor import Partial, Replicate, Shard

    if p and p[0] == "shard" and len(p) == 2 and isinstance(p[1], int):
        return Shard(p[1])
    if p == ["replicate"]:
        return Replicate()
    if p == ["partial"]:
        return Partial()
    raise CodecError(f"malformed DTensor placement {p!r} in recovery metadata")


def pack(state: Any) -> Packed:
    """One copy of every tensor into a fresh buffer: a snapshot the training thread may keep changing after."""
    found: list[tuple[torch.Tensor, dict[str, Any]]] = []

    def encode(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            info: dict[str, Any] = {"dtensor": None}
            if is_dtensor(obj):
                info["dtensor"] = {
                    "placements": [_placement_json(p) for p in obj.placements],
                    "shape": list(obj.shape),
                    "stride": list(obj.stride()),
                }
                obj = obj.to_local()
            dtype = str(obj.dtype).removeprefix("torch.")
            if dtype not in DTYPES:
                raise CodecError(f"tensor at {path} has dtype {obj.dtype}, which recovery does not carry")
            info.update(dtype=dtype, shape=list(obj.shape), nbytes=obj.numel() * obj.element_size())
            found.append((obj.detach(), info))
            return {"__tensor__": len(found) - 1}
        if isinstance(obj, dict):
            pairs = []
            for k, v in obj.items():
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise CodecError(f"state key {k!r} at {path} must be a str or int")
                pairs.append([k, encode(v, f"{path}/{k}")])
            return {"__dict__": pairs}
        if isinstance(obj, list):
            return [encode(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return {"__tuple__": [encode(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        raise CodecError(f"state at {path} is a {type(obj).__name__}: recovery carries tensors and JSON values only")

    meta = encode(state, "state")
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
    return Packed(meta=meta, tensors=[info for _t, info in found], buffer=buffer, copied=copied)


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


def unpack(meta: Any, tensors: list[dict[str, Any]], buffer: torch.Tensor, template: Any = None) -> Any:
    """Rebuilds the state from a verified buffer. Tensors are views of ``buffer`` (on its device); DTensors are
    rebuilt on the mesh of the matching entry of ``template`` (the receiver's own state dict)."""
    if not isinstance(tensors, list):
        raise CodecError("recovery metadata 'tensors' must be a list")
    mesh = None

    def tensor(index: Any, path: list[Any]) -> torch.Tensor:
        nonlocal mesh
        if not isinstance(index, int) or not 0 <= index < len(tensors):
            raise CodecError(f"recovery metadata references tensor {index!r} of {len(tensors)}")
        info = tensors[index]
        dtype = DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise CodecError(f"recovery metadata has unknown dtype {info.get('dtype')!r}")
        shape, offset, nbytes = info["shape"], info["offset"], info["nbytes"]
        numel = 1
        for s in shape:
            numel *= s
        if numel * dtype.itemsize != nbytes or offset % ALIGN or offset + nbytes > buffer.numel():
            raise CodecError(f"recovery metadata for tensor {index} is inconsistent (shape {shape}, {nbytes} bytes)")
        local = buffer[offset : offset + nbytes].view(dtype).view(shape)
        spec = info.get("dtensor")
        if not spec:
            return local
        from torch.distributed.tensor import DTensor

        like = _lookup(template, path)
        if is_dtensor(like):
            mesh_of_like, placements_of_like = like.device_mesh, like.placements
            return DTensor.from_local(
                local, mesh_of_like, placements_of_like, shape=torch.Size(spec["shape"]), stride=tuple(spec["stride"])
            )
        mesh = mesh or _any_mesh(template)
        if mesh is None:
            raise CodecError("received a sharded (DTensor) state but this rank's own state has no device mesh")
        placements = [_placement_from_json(p) for p in spec["placements"]]
        return DTensor.from_local(
            local, mesh, placements, shape=torch.Size(spec["shape"]), stride=tuple(spec["stride"])
        )

    def decode(obj: Any, path: list[Any]) -> Any:
        if isinstance(obj, list):
            return [decode(v, [*path, i]) for i, v in enumerate(obj)]
        if isinstance(obj, dict):
            if "__tensor__" in obj:
                return tensor(obj["__tensor__"], path)
            if "__tuple__" in obj:
                return tuple(decode(v, [*path, i]) for i, v in enumerate(obj["__tuple__"]))
            if "__dict__" in obj:
                return {k: decode(v, [*path, k]) for k, v in obj["__dict__"]}
            raise CodecError(f"malformed recovery metadata object with keys {sorted(obj)}")
        return obj

    return decode(meta, [])
