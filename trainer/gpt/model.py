"""A small byte-level GPT (vocabulary 256), written to be read: embeddings, pre-norm blocks, tied output head.

Presets span a few-second smoke model (``tiny``) to ~100M parameters (``large``). Dropout is always 0 so that two
replicas fed the same bytes and the same averaged gradients stay bitwise identical.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

VOCAB_SIZE = 256  # bytes


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int  # context length in bytes
    vocab_size: int = VOCAB_SIZE


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64),  # ~0.1M: tests, the local launcher default
    "small": GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=128),  # ~3.2M: the benchmark size
    "medium": GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=256),  # ~11M
    "large": GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=512),  # ~86M
}


def preset(name: str) -> GPTConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}: choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd ({cfg.n_embd}) must be a multiple of n_head ({cfg.n_head})")
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (b, t, c) -> (b, heads, t, head_dim)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # weight tying: fewer parameters, the usual GPT-2 choice
        self.apply(self._init_weights)
        # GPT-2's scaled init of residual projections keeps the residual stream's variance flat with depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = idx.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds the model's block_size {self.cfg.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def build_model(name: str, seed: int) -> GPT:
    """The preset's model with weights drawn from ``seed`` alone, so every replica starts identical."""
    cfg = preset(name)
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return GPT(cfg)
    finally:
        torch.random.set_rng_state(gen_state)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
