"""Live recovery's wire format as typed messages: the manifest a healing rank reads from a peer's recovery server.

  GET {PATH_RECOVERY}/{step}/manifest?wait=S   RecoveryManifest (JSON)
  GET {PATH_RECOVERY}/{step}/chunk/{i}         raw bytes of chunk i (its checksum is in the manifest)

The state travels as a JSON tree (``StateNode``) whose tensors are ``TensorRef`` indices into ``tensors``; their bytes
sit at aligned offsets of one flat buffer, cut into checksummed chunks. Nothing is ever unpickled.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import TypeAliasType

Count = Annotated[int, Field(ge=0)]
# The dtypes recovery carries (torch names without the "torch." prefix).
DTypeName = Literal["float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"]


class Wire(BaseModel):
    """Strict, closed and immutable; floats keep NaN and infinities (optimizer and scheduler states hold them)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, ser_json_inf_nan="constants")


# --- the state tree -------------------------------------------------------------------------------------------
class TensorRef(Wire):
    kind: Literal["tensor"] = "tensor"
    index: Count  # into RecoveryManifest.tensors


class DictNode(Wire):
    """A dict whose keys keep their type (optimizer states are keyed by int)."""

    kind: Literal["dict"] = "dict"
    items: list[tuple[str | int, StateNode]]


class TupleNode(Wire):
    """A tuple (a list stays a list: the receiver gets back what it sent)."""

    kind: Literal["tuple"] = "tuple"
    values: list[StateNode]


StateNode = TypeAliasType(
    "StateNode",
    "Annotated[TensorRef | DictNode | TupleNode, Field(discriminator='kind')] | list[StateNode] "
    "| bool | int | float | str | None",
)


# --- tensors and chunks ---------------------------------------------------------------------------------------
class ShardPlacement(Wire):
    kind: Literal["shard"] = "shard"
    dim: int


class ReplicatePlacement(Wire):
    kind: Literal["replicate"] = "replicate"


class PartialPlacement(Wire):
    kind: Literal["partial"] = "partial"


Placement = Annotated[ShardPlacement | ReplicatePlacement | PartialPlacement, Field(discriminator="kind")]


class DTensorSpec(Wire):
    """A DTensor travels as its local shard; the receiver rebuilds it on its own device mesh with this spec."""

    placements: list[Placement]
    shape: list[Count]  # the global shape
    stride: list[int]


class TensorInfo(Wire):
    dtype: DTypeName
    shape: list[Count]  # of the bytes sent (a DTensor's local shard)
    offset: Count  # into the flat buffer, a multiple of the codec's alignment
    nbytes: Count
    dtensor: DTensorSpec | None = None


class Chunk(Wire):
    offset: Count
    length: Count
    # (sum of the chunk's little-endian 64-bit words w, sum of (4 KiB block index of w + 1) * w), both mod 2**64
    # (ftjob.ft.recovery.codec.chunk_sums): catches a chunk damaged after the snapshot was taken, any error within a
    # word, and blocks in the wrong place, and numpy sums words several times faster than zlib.crc32 or a hash reads
    # bytes, so that checking costs little next to the copy. A cryptographic hash would add nothing: the peer is
    # authenticated by the job's token and, with TLS, every byte on the wire by the record MAC; the state digests
    # compare the replicas end to end every N steps.
    sum64: Annotated[int, Field(ge=0, lt=2**64)]
    block_sum64: Annotated[int, Field(ge=0, lt=2**64)]


class RecoveryManifest(Wire):
    """Everything a healing rank needs besides the chunks' bytes."""

    step: Count
    total_bytes: Count
    chunks: list[Chunk]
    tensors: list[TensorInfo]
    state: StateNode
