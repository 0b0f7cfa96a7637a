"""State dicts <-> (a typed JSON tree, one flat byte buffer) for live recovery. Nothing is ever unpickled: the tree
is ftjob.contract.recovery_api's StateNode (dict keys keep their int/str type, tuples stay tuples) and tensors are raw
bytes at aligned offsets (the padding between them is zero). Also the chunks' checksum, and where each received tensor
lands: straight in the receiver's own matching tensor when it has one (no staging copy), else in a staging buffer.

DTensors (FSDP2) travel as their local shard; the receiving rank rebuilds them on its own device mesh.
"""

from __future__ import annotations

import sys
import typing
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from ftjob.contract.recovery_api import (
    Chunk,
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
BLOCK_WORDS = 512  # the checksum weighs each 4 KiB block of a chunk by its position
_MASK = 2**64 - 1
Segment = tuple[int, np.ndarray]  # (offset in the flat buffer, where those bytes land)


class CodecError(ValueError):
    """The state cannot be encoded (the message names the offending entry), or received metadata is malformed."""


@dataclass
class Packed:
    """A state packed for sending: its tree (tensors replaced by references), the tensors' metadata, and one buffer
    holding their bytes."""

    state: StateNode  # the tree; tensors replaced by TensorRef indices into ``tensors``
    tensors: list[TensorInfo]
    buffer: torch.Tensor  # uint8 on the CPU (pinned when the state lives on an accelerator)
    copied: Any = None  # a CUDA event when the copies into ``buffer`` are still in flight


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor, without importing torch.distributed.tensor: that import is slow (it pulls
    sympy) and would run on every trainer start, and no DTensor can exist until FSDP2 has imported it anyway."""
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
        start, end = info["offset"], info["offset"] + info["nbytes"]
        if info["nbytes"]:
            buffer[start:end].view(t.dtype).view(t.shape).copy_(t, non_blocking=t.is_cuda)
        pad_end = (end + ALIGN - 1) // ALIGN * ALIGN
        if pad_end > end:  # zero padding: the checksum of a chunk is then that of its tensors' bytes alone
            buffer[end:pad_end].zero_()
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


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def check_layout(tensors: list[TensorInfo], total: int) -> None:
    """CodecError unless every tensor fits the flat buffer of ``total`` bytes, aligned and apart from the others."""
    end = 0
    for i in sorted(range(len(tensors)), key=lambda i: tensors[i].offset):
        info = tensors[i]
        nbytes = _numel(info.shape) * DTYPES[info.dtype].itemsize
        if nbytes != info.nbytes or info.offset % ALIGN or info.offset < end or info.offset + nbytes > total:
            raise CodecError(f"recovery metadata for tensor {i} is inconsistent (shape {info.shape}, {nbytes} bytes)")
        end = info.offset + nbytes


def tensor_paths(tree: StateNode) -> dict[int, list[Any]]:
    """Each TensorRef's index -> its path of keys in the state."""
    paths: dict[int, list[Any]] = {}

    def walk(node: StateNode, path: list[Any]) -> None:
        if isinstance(node, TensorRef):
            paths[node.index] = path
        elif isinstance(node, (list, TupleNode)):
            for i, v in enumerate(node.values if isinstance(node, TupleNode) else node):
                walk(v, [*path, i])
        elif isinstance(node, DictNode):
            for k, v in node.items:
                walk(v, [*path, k])

    walk(tree, [])
    return paths


def targets(tree: StateNode, tensors: list[TensorInfo], template: Any, device_type: str) -> list[torch.Tensor | None]:
    """For each tensor, the receiver's own tensor (a DTensor's local shard) that can take its bytes in place: same
    place in ``template``, dtype, shape, contiguous, on ``device_type``, sharing memory with no other; else None."""
    found: list[torch.Tensor | None] = [None] * len(tensors)
    spans = []
    for index, path in tensor_paths(tree).items():
        like = _lookup(template, path) if template is not None and index < len(tensors) else None
        info = tensors[index] if like is not None else None
        if info is None or not isinstance(like, torch.Tensor) or is_dtensor(like) != (info.dtensor is not None):
            continue
        t = local_part(like).detach()
        if (
            info.nbytes
            and t.device.type == device_type
            and t.dtype == DTYPES[info.dtype]
            and list(t.shape) == info.shape
            and t.is_contiguous()
        ):
            spans.append((t.data_ptr(), t.data_ptr() + info.nbytes, index, t))
    end = 0
    for start, stop, index, t in sorted(spans, key=lambda s: s[:2]):  # tied weights etc.: the first one only
        if start >= end:
            found[index] = t
            end = stop
    return found


def byte_view(t: torch.Tensor) -> np.ndarray:
    """A contiguous tensor's bytes, writable in place (CPU only)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def segments(tensors: list[TensorInfo], staging: torch.Tensor, into: list[torch.Tensor | None]) -> list[Segment]:
    """The flat buffer as (start, bytes) pieces in order, covering it whole: a tensor with a target in ``into`` lands
    there, everything else (padding included) at its offset in ``staging``."""
    flat = byte_view(staging) if staging.numel() else np.empty(0, np.uint8)
    pieces: list[Segment] = []
    at = 0
    for i in sorted((i for i, t in enumerate(into) if t is not None), key=lambda i: tensors[i].offset):
        info = tensors[i]
        if info.offset > at:
            pieces.append((at, flat[at : info.offset]))
        pieces.append((info.offset, byte_view(into[i])))  # type: ignore[arg-type]
        at = info.offset + info.nbytes
    if at < len(flat):
        pieces.append((at, flat[at:]))
    return pieces


def chunk_pieces(pieces: list[Segment], chunks: list[Chunk], total: int) -> list[list[Segment]]:
    """Cuts the flat buffer's pieces at the chunk boundaries: chunk i's pieces, each at its offset in the chunk."""
    out: list[list[Segment]] = []
    at, k = 0, 0
    for chunk in chunks:
        if chunk.offset != at or chunk.length == 0:
            raise CodecError(f"malformed recovery manifest: chunk at {chunk.offset}, expected one at {at}")
        at = chunk.offset + chunk.length
        mine: list[Segment] = []
        while k < len(pieces) and pieces[k][0] < at:
            start, data = pieces[k]
            lo, hi = max(start, chunk.offset), min(start + len(data), at)
            mine.append((lo - chunk.offset, data[lo - start : hi - start]))
            if start + len(data) > at:
                break
            k += 1
        out.append(mine)
    if at != total:
        raise CodecError(f"malformed recovery manifest: its chunks cover {at} of {total} bytes")
    return out


def to_device(
    tensors: list[TensorInfo], staging: torch.Tensor, into: list[torch.Tensor | None], device: str
) -> list[torch.Tensor | None]:
    """The verified tensors copied from pinned ``staging`` to the GPU: into the receiver's own tensors when they match,
    else into new ones."""
    landed: list[torch.Tensor | None] = []
    for info, dst in zip(tensors, into, strict=True):
        src = staging[info.offset : info.offset + info.nbytes].view(DTYPES[info.dtype]).view(info.shape)
        landed.append(dst.copy_(src, non_blocking=True) if dst is not None else src.to(device, non_blocking=True))
    for dev in {t.device for t in landed if t is not None and t.is_cuda}:
        torch.cuda.current_stream(dev).synchronize()  # staging must outlive the copies
    return landed


def host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """A uint8 CPU buffer: pinned (for an asynchronous copy to the GPU), else malloc'd, whose pages cost nothing until
    written (a receiver's own tensors take most bytes). Not 2 MiB pages (an madvise'd private mapping): they fault in
    faster, but loopback TCP into them stalls on spurious retransmissions, which costs a fetch far more."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


def _word_sums(words: np.ndarray, w0: int) -> tuple[int, int]:
    a = b = 0
    head = min(len(words), -w0 % BLOCK_WORDS)
    full = (len(words) - head) // BLOCK_WORDS * BLOCK_WORDS
    for lo, hi in ((0, head), (head + full, len(words))):  # the partial blocks at both ends
        if hi > lo:
            s = int(np.add.reduce(words[lo:hi]))
            a, b = a + s, b + s * ((w0 + lo) // BLOCK_WORDS + 1)
    if full:  # numpy drops the GIL: fetch threads check in parallel
        blocks = np.add.reduce(words[head : head + full].reshape(-1, BLOCK_WORDS), axis=1)
        first = (w0 + head) // BLOCK_WORDS + 1
        a += int(np.add.reduce(blocks))
        b += int(np.dot(blocks, np.arange(first, first + len(blocks), dtype=np.uint64)))
    return a, b


def chunk_sums(data: np.ndarray, pos: int = 0) -> tuple[int, int]:
    """A chunk's checksum, (sum of its little-endian 64-bit words w, sum of (4 KiB block index of w + 1) * w) mod
    2**64, for the ``data`` found at byte ``pos`` of the chunk: additive, so a chunk received in pieces is summed piece
    by piece. The weights catch blocks in the wrong place; numpy's word sums run several times faster than zlib.crc32
    or sha256 over the same bytes."""
    a = b = 0
    head = min(len(data), -pos % 8)
    words = (len(data) - head) // 8
    for lo, hi in ((0, head), (head + words * 8, len(data))):  # partial words: bytes shifted to their place
        if hi > lo:
            at = pos + lo
            v = int.from_bytes(data[lo:hi].tobytes(), "little") << (8 * (at % 8))
            a, b = a + v, b + v * (at // 8 // BLOCK_WORDS + 1)
    if words:
        wa, wb = _word_sums(data[head : head + words * 8].view("<u8"), (pos + head) // 8)
        a, b = a + wa, b + wb
    return a & _MASK, b & _MASK


def unpack(
    tree: StateNode,
    tensors: list[TensorInfo],
    buffer: torch.Tensor,
    template: Any = None,
    landed: list[torch.Tensor | None] | None = None,
) -> Any:
    """Rebuilds the state from verified bytes: tensor i is ``landed[i]`` when given, else a view of ``buffer`` (on
    its device); DTensors are rebuilt on the mesh of the matching entry of ``template`` (the receiver's own state)."""
    check_layout(tensors, buffer.numel())
    mesh = None

    def tensor(ref: TensorRef, path: list[Any]) -> torch.Tensor:
        nonlocal mesh
        if ref.index >= len(tensors):
            raise CodecError(f"recovery metadata references tensor {ref.index} of {len(tensors)}")
        info = tensors[ref.index]
        local = landed[ref.index] if landed is not None else None
        if local is None:
            local = buffer[info.offset : info.offset + info.nbytes].view(DTYPES[info.dtype]).view(info.shape)
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
