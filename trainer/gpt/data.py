"""The training corpus and its deterministic sharding.

Corpus: the Python standard library's own ``.py`` files -- present on every machine that runs the trainer, no
download. Files are listed, sorted by relative path and concatenated in that order (up to ``max_bytes``), so every
replica that runs the same image sees the same bytes; ``Corpus.digest`` lets the launcher check that.

Samples: sample ``i`` is the ``block_size + 1`` bytes starting at ``(i mod n) * block_size`` (inputs + shifted
targets), so a global sample index alone names the data. A step takes the contiguous range
``[cursor + shard*b, cursor + (shard+1)*b)`` for per-group batch ``b``; the cursor is training state and advances by
``num_contributors * b`` on commit, so nothing is skipped or repeated whichever groups take part.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_MAX_BYTES = 16 * 1024 * 1024
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_corpus_files(root: Path) -> list[Path]:
    """Every ``.py`` file under ``root`` (third-party package folders excluded), sorted by relative path."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        rel = os.path.relpath(dirpath, root)
        found.extend(os.path.normpath(os.path.join(rel, f)) for f in filenames if f.endswith(".py"))
    return [root / r for r in sorted(found)]


@dataclass(frozen=True)
class Corpus:
    data: torch.Tensor  # uint8, 1-D
    digest: str  # sha256 of the bytes: replicas compare it to prove they train on the same text
    files: int

    @classmethod
    def load(cls, root: Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> Corpus:
        root = stdlib_root() if root is None else root
        chunks: list[bytes] = []
        total = files = 0
        for path in list_corpus_files(root):
            if total >= max_bytes:
                break
            try:
                raw = path.read_bytes()
            except OSError:
                continue  # unreadable files are skipped identically on every replica of one image
            chunks.append(raw)
            total += len(raw)
            files += 1
        blob = b"".join(chunks)[:max_bytes]
        if len(blob) < 1024:
            raise ValueError(
                f"corpus under {root} holds only {len(blob)} bytes of .py files: point --corpus-root "
                f"at a directory with Python sources"
            )
        data = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        return cls(data=data, digest=hashlib.sha256(blob).hexdigest(), files=files)


class SampleSource:
    """Fixed-length samples addressed by a global sample index."""

    def __init__(self, corpus: Corpus, block_size: int) -> None:
        self.corpus = corpus
        self.block_size = block_size
        self.num_samples = (corpus.data.numel() - 1) // block_size
        if self.num_samples < 1:
            raise ValueError(f"corpus ({corpus.data.numel()} bytes) is shorter than one sample of {block_size + 1}")
        # Unfolded view: row i holds bytes [i*block, i*block + block + 1) without copying the corpus.
        self._rows = corpus.data[: self.num_samples * block_size + 1].unfold(0, block_size + 1, block_size)

    def samples(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets (int64, shape ``(count, block_size)``) for global samples ``[start, start+count)``."""
        if start < 0 or count < 0:
            raise ValueError(f"sample range must be non-negative, got start={start} count={count}")
        idx = torch.arange(start, start + count) % self.num_samples
        rows = self._rows[idx].long()
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def shard_range(cursor: int, shard: int, num_shards: int, per_group_batch: int) -> tuple[int, int]:
    """The ``[start, end)`` global sample range one contributing group trains at this step."""
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} out of range for {num_shards} shards")
    start = cursor + shard * per_group_batch
    return start, start + per_group_batch


def rank_range(group_start: int, per_group_batch: int, rank: int, world_size: int) -> tuple[int, int]:
    """Split one group's range across the ranks inside the group (each rank holds an equal slice)."""
    if per_group_batch % world_size:
        raise ValueError(f"per-group batch {per_group_batch} must be a multiple of the ranks per group {world_size}")
    per_rank = per_group_batch // world_size
    start = group_start + rank * per_rank
    return start, start + per_rank
