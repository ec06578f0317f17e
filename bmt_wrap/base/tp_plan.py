"""The tensor-parallel section of a plan: which modules are split across the TP group and how, which head
counts change, what stays replicated and why, and the TP traffic that follows (docs/design.md "Tensor
parallelism in the one-liner").

Plain dataclasses with a JSON round-trip, like the rest of the plan: ``passes/tensor_parallel.py`` fills
one in, ``wrapping/tensor_parallel.py`` applies it.
"""

from __future__ import annotations

import math
from collections import Counter
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
#: Where sequence parallelism moves activations along the sequence (``SPPoint.kind``), and the collectives
#: each issues, forward then backward (elements per token of the whole sequence: ``SPPoint.width``):
#: ``unit``: a module holding a column -> row pair gathers its hidden-states argument on entry, and the
#: gather's backward sums the partial gradients of its columns (``column``: no copy, no all-reduce);
#: ``unit_whole``: the same gather, whose backward keeps this rank's slice of a whole gradient (the unit's
#: column Linears keep their copy and its all-reduce: right whatever the unit's unseen code does);
#: ``gather``: a column Linear gathers its own input (its pair is elementwise, no reshape on the way);
#: ``row``: a row Linear reduce-scatters its output along the sequence instead of all-reducing it;
#: ``enter``: a block cuts its hidden-states input to this rank's part (backward gathers the gradient);
#: ``leave``: a block gathers its output whole; ``head``: a root Linear gathers its input (the chain's end).
SP_OPS: dict[str, tuple[list[str], list[str]]] = {
    "unit": (["all_gather"], ["reduce_scatter"]), "unit_whole": (["all_gather"], []), "column": ([], []),
    "gather": (["all_gather"], ["reduce_scatter"]), "row": (["reduce_scatter"], ["all_gather"]),
    "enter": ([], ["all_gather"]), "leave": (["all_gather"], []),
    "head": (["all_gather"], ["reduce_scatter"]), "head_whole": (["all_gather"], []),
}


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
    # A fused projection (GPT-2's c_attn: q, k, v along its outputs): the split dimension holds ``parts``
    # equal blocks, each cut over the TP group, so a rank holds its heads' slice of each (Megatron's strided
    # split; ``runtime/tp_marks.tp_slice``). 1: one contiguous cut.
    parts: int = 1

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
    """An integer attribute (a head count the module's forward reshapes with, or the width it cuts a fused
    projection's output by: GPT-2's ``split_size``) set to its TP-local value."""

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
class SPPoint:
    """One place sequence parallelism changes a collective (``SP_OPS``)."""

    module: str  # the module's fully-qualified name
    kind: str  # one of SP_OPS
    width: int  # elements per token of the tensor moved along the sequence
    block: str | None = None  # the block it runs in (recomputed with it), else None (root)
    arg: int | str | None = None  # a unit's hidden-states argument: its position, or its keyword


@dataclass
class SequenceParallel:
    """Sequence parallelism (Megatron-SP, BMTrain's split between the parallel linears): norms, dropout and
    residual adds run on this TP rank's part of the sequence (dimension ``dim`` of the hidden states).

    ``partial``: parameters used on sequence parts, whose gradients are summed over the TP group;
    ``dropouts``: dropout modules run on parts (each rank draws the whole sequence's mask and keeps its
    part: the same stream as one process); ``reasons``: why a block (or the chain between blocks) is not.
    """

    enabled: bool
    dim: int = 1
    points: list[SPPoint] = field(default_factory=list)
    partial: list[str] = field(default_factory=list)
    dropouts: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    def covers(self, module: str) -> SPPoint | None:
        """The point at ``module``, or None."""
        return next((p for p in self.points if p.module == module), None)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SequenceParallel:
        """Rebuild from ``dataclasses.asdict`` output."""
        return cls(**{**raw, "points": [SPPoint(**p) for p in raw.get("points", [])]})


@dataclass
class TensorParallelPlan:
    """Tensor parallelism over ``tp_size`` adjacent ranks; ZeRO then shards over the data-parallel group."""

    tp_size: int
    source: str  # "transformers" (the model's own tp plan), "user" (tp_plan=), "derived" (the traced graph)
    entries: list[TPEntry] = field(default_factory=list)
    heads: list[HeadRewrite] = field(default_factory=list)
    replicated: list[Replicated] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    sequence: SequenceParallel | None = None  # None: sequence_parallel= not asked for

    def local_shapes(self) -> dict[str, list[int]]:
        """Fully-qualified parameter name -> its shape on one TP rank, for every split parameter."""
        return {f"{e.module}.{n}" if e.module else n: e.local_shape(n, self.tp_size)
                for e in self.entries for n in e.full_shapes}

    def split_names(self) -> set[str]:
        """Fully-qualified names of the parameters split along a dimension (the rest are held whole)."""
        return {f"{e.module}.{n}" if e.module else n for e in self.entries for n in e.split_dims}

    def traffic(self, tokens: int, itemsize: int, recomputed: set[str],
                calls: dict[str, int] | None = None) -> dict[str, int]:
        """Bytes per rank per training step over the TP group, by op, as the counting communicator counts
        them: all-gather ``shard (T-1)``, reduce-scatter ``output (T-1)``, all-reduce ``2 bytes (T-1)/T``
        rounded per call.

        ``tokens``: tokens in one rank's batch; ``recomputed``: checkpointed blocks, whose forward collectives
        run again in backward; ``calls``: calls per step of each block (default 1; root modules run once).
        One forward of the model per step: its inputs' digest is all-reduced once. Under sequence
        parallelism a collective along the sequence moves ``tokens / T`` tokens' worth per rank; the
        gradients of parameters used on sequence parts are summed by ``partial_grad_traffic``.
        """
        t = self.tp_size
        out: dict[str, int] = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}
        if t == 1:
            return out
        out["all_reduce"] += round(2 * t * INPUT_DIGEST_BYTES * (t - 1) / t)
        sp = self.sequence if self.sequence is not None and self.sequence.enabled else None

        def times(block: str | None) -> tuple[int, int]:
            n_calls = (calls or {}).get(block, 1) if block else 1
            return n_calls * (2 if block in recomputed else 1), n_calls

        for e in self.entries:
            fwd, bwd = e.forward_traffic(t), e.backward_traffic(t)
            if sp is not None and sp.covers(e.module):  # its all-reduce became the point's collectives
                fwd, bwd = [o for o in fwd if o[0] != "all_reduce"], [o for o in bwd if o[0] != "all_reduce"]
            for ops, n in zip((fwd, bwd), times(e.block), strict=True):
                for op, elems in ops:
                    nbytes = tokens * elems * itemsize
                    out[op] += n * (nbytes * (t - 1) if op == "all_gather" else round(2 * nbytes * (t - 1) / t))
        for p in sp.points if sp is not None else []:
            n_fwd, n_bwd = times(p.block)
            if p.kind in ("enter", "leave"):  # around the block's call, outside what recompute replays
                n_fwd = n_bwd
            for ops, n in zip(SP_OPS[p.kind], (n_fwd, n_bwd), strict=True):
                for op in ops:
                    out[op] += n * (tokens // t) * p.width * itemsize * (t - 1)
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TensorParallelPlan:
        """Rebuild from ``dataclasses.asdict`` output (the plan's JSON)."""
        return cls(tp_size=raw["tp_size"], source=raw["source"],
                   entries=[TPEntry(**e) for e in raw.get("entries", [])],
                   heads=[HeadRewrite(**h) for h in raw.get("heads", [])],
                   replicated=[Replicated(**r) for r in raw.get("replicated", [])],
                   notes=raw.get("notes", []),
                   sequence=SequenceParallel.from_dict(raw["sequence"]) if raw.get("sequence") else None)


def tp_text(tp: TensorParallelPlan) -> list[str]:
    """The plan's TP section for people: split modules, head rewrites, what stays replicated and why."""
    numel = sum(math.prod(s) for e in tp.entries for s in e.full_shapes.values())
    lines = [f"tensor parallel: tp_size={tp.tp_size}, plan from {tp.source}, {len(tp.entries)} module(s) "
             f"split ({numel:,} parameters), {len(tp.heads)} head count(s) rewritten, "
             f"{len(tp.replicated)} left replicated"]
    lines += [f"  split {e.module}: {e.style}" + (f" (strided: each of {e.parts} fused blocks cut)" if e.parts > 1
                                                  else "") for e in tp.entries]
    lines += [f"  heads {h.module}.{h.attribute}: {h.full} -> {h.local}" for h in tp.heads]
    lines += [f"  replicated {r.module}: {r.reason}" for r in tp.replicated]
    lines += [f"  note: {n}" for n in tp.notes]
    sp = tp.sequence
    if sp is not None:
        where = Counter(p.kind for p in sp.points)
        what = ", ".join(f"{n} {k}" for k, n in sorted(where.items()))
        lines.append(f"  sequence parallel: {'on' if sp.enabled else 'off'} (sequence dim {sp.dim})"
                     + (f": {what}; {len(sp.partial)} parameter(s) on sequence parts, {len(sp.dropouts)} "
                        "dropout(s)" if what else ""))
        lines += [f"    sp {p.kind} {p.module}" for p in sp.points if p.kind in ("enter", "leave", "head",
                                                                             "head_whole")]
        lines += [f"    not sequence parallel: {r}" for r in sp.reasons]
    return lines
