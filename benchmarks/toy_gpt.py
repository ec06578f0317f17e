"""The benchmarks' parameter-heavy toy GPT (8 blocks x d_model 1024, seq 32, vocab 8192: ~118M params),
as a plain module and written against BMTrain's explicit API (same parameter names, same computation)."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import bmt_wrap as bmt

# The explicit model uses the BMTrain-style layers of examples/bmtrain_style.py.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from bmtrain_style import Embedding, Layernorm, Linear  # noqa: E402


@dataclass
class ToyGPTConfig:
    """Sizes of the toy GPT; the defaults are the benchmark line the README reports."""

    vocab: int = 8192
    d_model: int = 1024
    n_layers: int = 8
    n_heads: int = 16
    seq: int = 32
    dropout: float = 0.0


class Block(nn.Module):
    """Pre-norm attention + MLP."""

    def __init__(self, cfg: ToyGPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class ToyGPT(nn.Module):
    """Token + position embeddings, blocks, final norm, untied head; returns the mean LM loss."""

    def __init__(self, cfg: ToyGPTConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or ToyGPTConfig()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layers) if "out" in name else 0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class ToyGPTExplicit(bmt.DistributedModule):
    """The toy GPT as a BMTrain user writes it: DistributedModule layers at the root, CheckpointBlocks."""

    forward = ToyGPT.forward

    def __init__(self, cfg: ToyGPTConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or ToyGPTConfig()
        self.cfg = cfg
        self.wte = Embedding(cfg.vocab, cfg.d_model)
        self.wpe = Embedding(cfg.seq, cfg.d_model)
        self.blocks = bmt.TransformerBlockList([bmt.CheckpointBlock(Block(cfg)) for _ in range(cfg.n_layers)])
        self.ln_f = Layernorm(cfg.d_model)
        self.head = Linear(cfg.d_model, cfg.vocab, bias=False)


def token_batches(cfg: ToyGPTConfig, steps: int, batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic random token batches (inputs, shifted targets)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        seq = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=g)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out
