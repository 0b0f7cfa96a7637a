"""Random-projection sketches for the gradient guard's cross-check (ftjob.ft.integrity.guard): a ``DIM``-number summary
of a flat gradient that anyone holding the same seed can compute, linear in the gradient, and whose sum of squares is
an unbiased estimate of the gradient's.

The projection is a count sketch: coordinate ``i`` of a rank's gradient (its buckets laid end to end, in layout
order) is added with sign ``sign(i)`` to output ``bucket(i)``, both drawn from a keyed integer hash of ``i``. So
``P`` is never materialised: it is regenerated chunk by chunk, on the gradient's own device, from the 32-byte seed.
Each column of ``P`` holds a single +-1, hence ``E ||P x||^2 = ||x||^2`` with no scaling, and since the key changes
every step, which coordinates share a bucket (and with which signs) is unknown until the seed is drawn.

Why a hash rather than torch's generators: every group must regenerate the identical ``P``, and torch's CUDA
generators lay their streams out by the device's multiprocessor count; integer arithmetic is the same everywhere.
Why a count sketch rather than a dense Gaussian matrix: ``DIM`` x n random numbers per step would cost far more than
the step; the hash costs a few passes over the gradient. Why a bucket per coordinate rather than a fixed fold with
random signs: a gradient whose mass sits in a few columns of a weight matrix (large activations on a few features)
would then land in a few buckets and its estimate would be as noisy as one squared Gaussian.
"""

from __future__ import annotations

import hashlib
import secrets
import struct
from collections.abc import Sequence

import torch

DIM = 256  # outputs of a sketch: the sum-of-squares estimate's relative spread is ~sqrt(2 / DIM) for a spread vector
NONCE_BITS = 52  # each group's share of the seed; a sum of up to 2**11 of them still fits an int64
_SPAN = 1 << 30  # coordinates hashed under one key: their int32 index never overflows
_CHUNK = {"cpu": 1 << 20, "cuda": 1 << 24}  # coordinates hashed at once: bounds the temporaries (~17 bytes each)
# Odd multipliers of a 32-bit mixing hash (murmur3's finaliser constants, as signed int32: torch wraps int32 products)
_M1, _M2, _M3 = -1640531535, 0x7FEB352D, -2073254261


def draw_nonce() -> int:
    """This group's fresh share of a step's seed (never reused, never predictable by another group)."""
    return secrets.randbits(NONCE_BITS)


def derive_seed(nonce_sum: int, quorum_id: int, rank_in_group: int) -> bytes:
    """The projection's seed for one step of rank ``rank_in_group`` of every group: the sum of every group's nonce
    (random as long as one group's was), bound to the quorum and the rank so that shards are sketched
    independently."""
    return hashlib.sha256(b"ftjob-guard-sketch/1" + struct.pack("<qqq", nonce_sum, quorum_id, rank_in_group)).digest()


def _signed32(raw: bytes) -> int:
    return struct.unpack("<i", raw)[0]


class Projection:
    """The count sketch ``P`` of one step: ``sketch`` applies it to flat tensors sharing one coordinate layout."""

    def __init__(self, seed: bytes, dim: int = DIM) -> None:
        if dim < 2 or dim > 1 << 16 or dim & (dim - 1):
            raise ValueError(f"a sketch's dimension must be a power of two in 2..65536, got {dim}")
        self.seed, self.dim = seed, dim
        self._shift = 32 - dim.bit_length()  # bits [shift, 31) of the hash pick the bucket, bit 31 the sign
        self._keys: dict[int, tuple[int, int]] = {}

    def _key(self, span: int) -> tuple[int, int]:
        """Two int32 keys for the coordinates ``[span * 2**30, (span + 1) * 2**30)``."""
        keys = self._keys.get(span)
        if keys is None:
            raw = hashlib.sha256(self.seed + struct.pack("<q", span)).digest()
            keys = self._keys[span] = (_signed32(raw[:4]), _signed32(raw[4:8]))
        return keys

    def hashes(self, start: int, count: int, device: torch.device) -> torch.Tensor:
        """The signed bucket of coordinates ``[start, start + count)`` (which must lie in one span of 2**30):
        ``bucket + dim`` where the sign is negative, so one index_add into ``2 * dim`` slots applies the signs."""
        span, offset = divmod(start, _SPAN)
        if offset + count > _SPAN:
            raise ValueError("a hashed run of coordinates must not cross a span boundary")
        k1, k2 = self._key(span)
        x = torch.arange(offset, offset + count, dtype=torch.int32, device=device)
        x.mul_(_M1).add_(k1)
        x.bitwise_xor_(x.bitwise_right_shift(15).bitwise_and_(0x1FFFF))  # a logical shift: no sign smearing
        x.mul_(_M2).bitwise_xor_(k2)
        x.bitwise_xor_(x.bitwise_right_shift(13).bitwise_and_(0x7FFFF))
        x.mul_(_M3)
        # the product's top bits are its best mixed: the bucket from the bits just below bit 31, the sign (bit 31,
        # which the arithmetic shift carries down) just above them
        return x.bitwise_right_shift_(self._shift).bitwise_and_(2 * self.dim - 1)

    def _runs(self, start: int, count: int, chunk: int) -> list[tuple[int, int]]:
        """``[start, start + count)`` cut into runs of at most ``chunk`` that never cross a span boundary."""
        runs, at, end = [], start, start + count
        while at < end:
            stop = min(end, at + chunk, (at // _SPAN + 1) * _SPAN)
            runs.append((at, stop))
            at = stop
        return runs

    def sketch(self, sources: Sequence[Sequence[torch.Tensor] | None], device: torch.device) -> list[torch.Tensor]:
        """``P x`` (float64, ``dim`` numbers) for each source: a list of flat tensors laid end to end, every source
        with the same lengths (a rank's buckets: what it sent, the sum it received); None sketches to zeros. The
        hash is computed once per run and shared by all sources; accumulation is in float64, so the sketch's own
        rounding is far below the float32 rounding of the sum it is compared with."""
        slots = [torch.zeros(2 * self.dim, dtype=torch.float64, device=device) for _ in sources]
        live = [(out, src) for out, src in zip(slots, sources, strict=True) if src is not None]
        if not live:
            return [s[: self.dim] for s in slots]
        lengths = [t.numel() for t in live[0][1]]
        if any([t.numel() for t in src] != lengths for _, src in live):
            raise ValueError("every sketched source must have the same bucket lengths")
        chunk = _CHUNK.get(torch.device(device).type, _CHUNK["cpu"])
        start = 0
        for b, count in enumerate(lengths):
            for at, stop in self._runs(start, count, chunk):
                index = self.hashes(at, stop - at, device)
                for out, src in live:
                    out.index_add_(0, index, src[b].reshape(-1)[at - start : stop - start].to(torch.float64))
            start += count
        return [s[: self.dim] - s[self.dim :] for s in slots]  # the positive slots minus the negative ones

    def matrix(self, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """``P`` itself for the first ``count`` coordinates, ``[dim, count]`` float64: for tests on small tensors."""
        p = torch.zeros(self.dim, count, dtype=torch.float64, device=device)
        for at, stop in self._runs(0, count, _CHUNK["cpu"]):
            index = self.hashes(at, stop - at, torch.device(device)).long()
            columns = torch.arange(at, stop, device=device)
            p[index % self.dim, columns] = torch.where(index < self.dim, 1.0, -1.0).to(torch.float64)
        return p


def sumsq(sketch: torch.Tensor) -> float:
    """The estimate of the sketched vector's sum of squares (unbiased: every column of ``P`` is a single +-1)."""
    return float(sketch.square().sum())
