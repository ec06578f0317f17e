"""The tensor-parallel section of a plan: which modules are split across the TP group and how, which head
counts change, what stays replicated and why, and the TP traffic that follows (docs/design.md "Tensor
parallelism in the one-liner").

Plain dataclasses with a JSON round-trip, like the rest of the plan: ``passes/tensor_parallel.py`` fills
one in, ``wrapping/tensor_parallel.py`` applies it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

#: How a split module computes: each style's forward collectives (``wrapping/tensor_parallel.py``).
#: ``colwise``: output features split, input replicated (backward all-reduces the input's gradient);
#: ``colwise_gather``: the same, then the output gathered whole; ``rowwise``: input features split, output
#: all-reduced; ``rowwise_split_input``: a replicated input is cut to this rank's slice first;
#: ``vocab_embedding``: rows of an embedding split, lookups outside this rank's rows give zeros, summed.
SPLIT_STYLES = ("colwise", "colwise_gather", "rowwise", "rowwise_split_input", "vocab_embedding")
#: Bytes per TP rank of the digest each forward all-reduces over the TP group to refuse different batches.
INPUT_DIGEST_BYTES = 8


@dataclass
class TPEntry:
    """One module split across the TP group."""

    module: str  # the module's fully-qualified name
    style: str  # one of SPLIT_STYLES
    kind: str  # "linear", "conv1d" (transformers' Conv1D: weight [in, out], y = x @ W + b) or "embedding"
    split_dims: dict[str, int]  # parameter name within the module -> dimension it is split along
    full_shapes: dict[str, list[int]]  # parameter name within the module -> its unsplit shape
    in_features: int  # per token: the Linear's input width, or 1 for an embedding (one index)
    out_features: int  # per token: the full output width
    block: str | None = None  # the discovered block holding the module (recomputed with it), else None

    def local_shape(self, name: str, tp_size: int) -> list[int]:
        """The shape of parameter ``name`` on one TP rank."""
        shape = list(self.full_shapes[name])
        dim = self.split_dims.get(name)
        if dim is not None:
            shape[dim] //= tp_size
        return shape

    def forward_traffic(self, tp_size: int) -> list[tuple[str, int]]:
        """(op, elements per token of this rank's tensor) of each collective one forward call issues."""
        if self.style in ("rowwise", "rowwise_split_input", "vocab_embedding"):
            return [("all_reduce", self.out_features)]
        if self.style == "colwise_gather":
            return [("all_gather", self.out_features // tp_size)]
        return []

    def backward_traffic(self, tp_size: int) -> list[tuple[str, int]]:
        """(op, elements per token) of each collective one backward issues (the input's gradient)."""
        if self.style in ("colwise", "colwise_gather"):
            return [("all_reduce", self.in_features)]
        if self.style == "rowwise_split_input":
            return [("all_gather", self.in_features // tp_size)]
        return []


@dataclass
class HeadRewrite:
    """An integer attribute (a head count the module's forward reshapes with) set to its TP-local value."""

    module: str
    attribute: str
    full: int
    local: int


@dataclass
class Replicated:
    """A module the plan (or the derivation) could have split but leaves whole on every TP rank."""

    module: str
    reason: str


@dataclass
class TensorParallelPlan:
    """Tensor parallelism over ``tp_size`` adjacent ranks; ZeRO then shards over the data-parallel group."""

    tp_size: int
    source: str  # "transformers" (the model's own tp plan), "user" (tp_plan=), "derived" (the traced graph)
    entries: list[TPEntry] = field(default_factory=list)
    heads: list[HeadRewrite] = field(default_factory=list)
    replicated: list[Replicated] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def local_shapes(self) -> dict[str, list[int]]:
        """Fully-qualified parameter name -> its shape on one TP rank, for every split parameter."""
        return {f"{e.module}.{n}" if e.module else n: e.local_shape(n, self.tp_size)
                for e in self.entries for n in e.full_shapes}

    def traffic(self, tokens: int, itemsize: int, recomputed: set[str],
                calls: dict[str, int] | None = None) -> dict[str, int]:
        """Bytes per rank per training step over the TP group, by op, as the counting communicator counts
        them: all-gather ``shard (T-1)``, all-reduce ``2 bytes (T-1)/T`` rounded per call.

        ``tokens``: tokens in one rank's batch; ``recomputed``: checkpointed blocks, whose forward collectives
        run again in backward; ``calls``: calls per step of each block (default 1; root modules run once).
        One forward of the model per step: its inputs' digest is all-reduced once.
        """
        t = self.tp_size
        out: dict[str, int] = {"all_reduce": 0, "all_gather": 0}
        if t == 1:
            return out
        out["all_reduce"] += round(2 * t * INPUT_DIGEST_BYTES * (t - 1) / t)
        for e in self.entries:
            n_calls = (calls or {}).get(e.block, 1) if e.block else 1
            forwards = n_calls * (2 if e.block in recomputed else 1)
            for ops, times in ((e.forward_traffic(t), forwards), (e.backward_traffic(t), n_calls)):
                for op, elems in ops:
                    nbytes = tokens * elems * itemsize
                    per_call = nbytes * (t - 1) if op == "all_gather" else round(2 * nbytes * (t - 1) / t)
                    out[op] += times * per_call
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TensorParallelPlan:
        """Rebuild from ``dataclasses.asdict`` output (the plan's JSON)."""
        return cls(tp_size=raw["tp_size"], source=raw["source"],
                   entries=[TPEntry(**e) for e in raw.get("entries", [])],
                   heads=[HeadRewrite(**h) for h in raw.get("heads", [])],
                   replicated=[Replicated(**r) for r in raw.get("replicated", [])],
                   notes=raw.get("notes", []))


def tp_text(tp: TensorParallelPlan) -> list[str]:
    """The plan's TP section for people: split modules, head rewrites, what stays replicated and why."""
    numel = sum(math.prod(s) for e in tp.entries for s in e.full_shapes.values())
    lines = [f"tensor parallel: tp_size={tp.tp_size}, plan from {tp.source}, {len(tp.entries)} module(s) "
             f"split ({numel:,} parameters), {len(tp.heads)} head count(s) rewritten, "
             f"{len(tp.replicated)} left replicated"]
    lines += [f"  split {e.module}: {e.style}" for e in tp.entries]
    lines += [f"  heads {h.module}.{h.attribute}: {h.full} -> {h.local}" for h in tp.heads]
    lines += [f"  replicated {r.module}: {r.reason}" for r in tp.replicated]
    lines += [f"  note: {n}" for n in tp.notes]
    return lines
