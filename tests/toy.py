"""Small models for engine tests, and a plan builder that marks blocks by hand."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from bmt_wrap.dtypes import dtype_name
from bmt_wrap.plan import ROOT, ParamInfo, ShardGroupSpec, WrapPlan, layout_buffers


class Layer(nn.Module):
    """A pre-norm transformer layer: attention + MLP, optional dropout."""

    def __init__(self, d: int, heads: int = 2, hidden: int | None = None, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)  # a key bias has an identically zero gradient
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, hidden or 4 * d)
        self.out = nn.Linear(hidden or 4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(d // self.heads)
        if mask is not None:
            att = att.masked_fill(~mask, float("-inf"))
        y = torch.einsum("bhts,bshd->bthd", att.softmax(-1), v).reshape(b, t, d)
        x = x + self.drop(self.proj(y)) * scale
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class DictLayer(Layer):
    """A layer taking keyword arguments and returning a dict (exercises pytrees through the executor)."""

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor | None = None, tag: str = "") -> dict:  # type: ignore[override]
        return {"hidden": super().forward(x, mask), "tag": tag, "aux": x.detach().sum()}


class ToyGPT(nn.Module):
    """Embedding, a list of layers, final norm and a (possibly tied) head."""

    def __init__(self, vocab: int = 64, d: int = 16, n_layers: int = 3, tied: bool = True,
                 dropout: float = 0.0, dict_layers: bool = False, widths: list[int] | None = None,
                 layerdrop: float = 0.0) -> None:
        super().__init__()
        self.layerdrop = layerdrop  # transformers-style: each layer skipped when a fresh torch.rand([]) < p
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Parameter(torch.randn(32, d) * 0.02)
        cls = DictLayer if dict_layers else Layer
        self.layers = nn.ModuleList(cls(d, hidden=(widths[i] if widths else None), dropout=dropout)
                                    for i in range(n_layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.wte.weight
        self.drop = nn.Dropout(dropout)
        self.dict_layers = dict_layers

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        x = self.drop(self.wte(idx) + self.wpe[:t])
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        for layer in self.layers:
            if self.training and self.layerdrop > 0 and torch.rand([]) < self.layerdrop:
                continue
            if self.dict_layers:
                x = layer(x, mask=mask, tag="t")["hidden"]
            else:
                x = layer(x, mask)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def manual_plan(model: nn.Module, blocks: list[str], *, checkpoint: bool | list[bool] = True,
                zero_level: int = 3, prefetch_depth: int = 1, order: list[str] | None = None) -> WrapPlan:
    """A plan with the given block FQNs and everything else in the root group (engine tests only)."""
    seen: dict[int, ParamInfo] = {}
    owner: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            seen[id(p)].aliases.append(name)
            continue
        seen[id(p)] = ParamInfo(name, list(p.shape), dtype_name(p.dtype), p.requires_grad)
        owner[id(p)] = next((b for b in blocks if any(
            name.startswith(n + ".") for n, m in model.named_modules(remove_duplicate=False)
            if m is model.get_submodule(b))), ROOT)
    for b in blocks:  # parameters reachable from two blocks, or a block and the root, go to the root
        block = model.get_submodule(b)
        # A block module registered under several names (a shared layer) is still one block.
        prefixes = tuple(n + "." for n, m in model.named_modules(remove_duplicate=False) if m is block)
        for p in block.parameters():
            names = [seen[id(p)].fqn, *seen[id(p)].aliases]
            if any(not n.startswith(prefixes) for n in names):
                owner[id(p)] = ROOT
    ckpt = checkpoint if isinstance(checkpoint, list) else [checkpoint] * len(blocks)
    groups = [ShardGroupSpec(ROOT, layout_buffers([i for k, i in seen.items() if owner[k] == ROOT]))]
    for b, c in zip(blocks, ckpt, strict=True):
        groups.append(ShardGroupSpec(b, layout_buffers([i for k, i in seen.items() if owner[k] == b]),
                                     checkpoint=c, zero_level=zero_level))
    return WrapPlan(groups=groups, prefetch_depth=prefetch_depth, order=order or list(blocks), capture="explicit")
