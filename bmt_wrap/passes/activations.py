"""Activation memory of one forward, measured on the exported graph with meta tensors (no compute).

The exported graph is interpreted on meta tensors with autograd on; a saved-tensors hook records what
autograd keeps for backward, attributed to the block call that is running. That is exactly what a
non-checkpointed block keeps; a checkpointed block keeps only its inputs (and recomputes the rest).
The same run counts each call's forward FLOPs (torch's ``FlopCounterMode``, shapes only): what a
recompute of that call costs, which a memory budget weighs against the bytes it saves.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.utils.flop_counter import FlopCounterMode

BlockKey = tuple[str, tuple[str, ...]]  # (canonical block FQN, nn_module_stack keys identifying one call)


@dataclass
class BlockCallActivations:
    """Bytes one block call keeps for backward."""

    block: str
    input_bytes: int  # tensors entering the call: all a checkpointed call keeps
    saved_bytes: int  # tensors autograd saves inside the call: what a non-checkpointed call keeps
    flops: int = 0  # forward FLOPs of the call: what recomputing it costs


@dataclass
class ActivationProfile:
    """Activation bytes of one forward at the measured batch shape."""

    root_bytes: int  # saved outside every block
    calls: list[BlockCallActivations] = field(default_factory=list)
    # Held by the output's objects (a KV cache's keys and values). A checkpointed call keeps its
    # arguments, the cache among them, for its recompute, so the cache lives through the blocks' backward
    # even though the caller drops the output; a non-checkpointed call's saved tensors already count them.
    object_bytes: int = 0
    # Forward FLOPs after the last block call (a head and its loss): a pipeline's last stage runs them alone.
    tail_flops: int = 0
    # Tokens of the measured batch (its token ids' elements: ``capture.token_count``; None without them): what
    # scales with tokens outside the graph's tensors, expert parallelism's all-to-all buffers
    # (``ExpertPlan.exchange_bytes``), is counted from them.
    tokens: int | None = None

    def total(self, checkpointed: set[str]) -> int:
        """Peak activation bytes when the blocks in ``checkpointed`` recompute in backward."""
        return sum(self.parts(checkpointed))

    def parts(self, checkpointed: set[str]) -> tuple[int, int, int]:
        """(saved outside blocks, kept by the block calls, one recompute's saved tensors, held by the
        output's objects through backward)."""
        kept = sum(c.input_bytes if c.block in checkpointed else c.saved_bytes for c in self.calls)
        # Backward recomputes one checkpointed call at a time: its saved tensors exist transiently.
        recompute = max((c.saved_bytes for c in self.calls if c.block in checkpointed), default=0)
        objects = self.object_bytes if any(c.block in checkpointed for c in self.calls) else 0
        return self.root_bytes, kept, recompute, objects


def _base(t: torch.Tensor) -> torch.Tensor:
    """The tensor owning ``t``'s storage: views (an expanded mask, a transposed weight) cost nothing."""
    return t if t._base is None else t._base


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


class _Profiler(fx.Interpreter):
    """Runs a graph node by node, tracking which block call each node belongs to."""

    def __init__(self, gm: fx.GraphModule, block_of: Callable[[fx.Node], BlockKey | None]) -> None:
        super().__init__(gm)
        self.block_of = block_of
        self.current: BlockKey | None = None
        self.calls: list[BlockCallActivations] = []
        self.root_bytes = 0
        state = [*gm.parameters(), *gm.buffers()]
        self.state_ids = {id(t) for t in state}
        # Storages counted so far (kept alive so ids stay unique): one tensor kept by several calls,
        # such as an attention mask every layer receives, occupies memory once.
        self.seen: dict[int, torch.Tensor] = {}
        self.entered: dict[int, torch.Tensor] = {}
        self.muted = False  # inside an attention op, whose saves are counted as a fused kernel's
        self.flop_counter = FlopCounterMode(display=False)
        self.tail_flops = 0  # counted outside blocks since the last block call

    def run_node(self, n: fx.Node) -> object:
        """Attribute the node to its block call, counting the tensors that enter a call."""
        key = self.block_of(n)
        if key != self.current:
            self.current = key
            if key is not None:
                self.calls.append(BlockCallActivations(key[0], 0, 0))
        if key is not None:
            for arg in n.all_input_nodes:
                value = self.env.get(arg)
                if self.block_of(arg) == key or not isinstance(value, torch.Tensor):
                    continue
                base = _base(value)
                if id(base) not in self.entered and id(base) not in self.state_ids:
                    self.entered[id(base)] = base
                    self.calls[-1].input_bytes += _nbytes(base)
        before = self.flop_counter.get_total_flops()
        try:
            return self._run_counted(n)
        finally:
            spent = self.flop_counter.get_total_flops() - before
            if key is not None:
                self.calls[-1].flops += spent
                self.tail_flops = 0
            elif self.calls:
                self.tail_flops += spent

    def _run_counted(self, n: fx.Node) -> object:
        if "scaled_dot_product" not in str(n.target):
            return super().run_node(n)
        # On meta, attention dispatches to the math fallback, which saves L x L scores (in fp32). Real
        # devices run a fused kernel that saves q, k, v, the output and the log-sum-exp: count that.
        self.muted = True
        try:
            out = super().run_node(n)
        finally:
            self.muted = False
        q = self.env[n.all_input_nodes[0]]
        if isinstance(out, torch.Tensor) and out.dim() == 4:
            # The fused kernels write [B, L, H, E] and return its transpose: the [B, L, H * E] the output
            # projection reads is then a view, not the copy the math fallback's layout would make.
            out = out.new_empty(out.shape[0], out.shape[2], out.shape[1], out.shape[3]).transpose(1, 2)
        first = out[0] if isinstance(out, (tuple, list)) else out  # the _scaled_dot_product_* ops return tuples
        for t in (*(self.env[a] for a in n.all_input_nodes[:3]), first):
            self.count(t)
        self.count(torch.empty(q.shape[:-1], dtype=torch.float32, device="meta"))  # log-sum-exp
        mask = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
        if isinstance(mask, fx.Node) and isinstance(self.env[mask], torch.Tensor):
            bias = self.env[mask]
            # A boolean mask is saved as the additive bias SDPA makes of it, in q's dtype, one per call.
            self.count(torch.empty(bias.shape, dtype=q.dtype, device="meta") if bias.dtype == torch.bool else bias)
        return out

    def count(self, t: torch.Tensor) -> None:
        """Count ``t`` once, for its first saver (parameters and buffers are not activations)."""
        base = _base(t)
        if id(base) in self.state_ids or id(base) in self.seen:
            return
        self.seen[id(base)] = base
        if self.current is None:
            self.root_bytes += _nbytes(base)
        else:
            self.calls[-1].saved_bytes += _nbytes(base)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """Saved-tensors hook: count what autograd keeps for backward."""
        if not self.muted:
            self.count(t)
        return t


def _weak_pack(profiler: _Profiler) -> Callable[[torch.Tensor], torch.Tensor]:
    """``profiler.pack`` through a weak reference: torch keeps a pack hook beyond its context (held in
    C++, out of the collector's sight), and a bound method would keep the profiler, and with it the
    capture's whole graph, for the life of the process."""
    ref = weakref.ref(profiler)

    def pack(t: torch.Tensor) -> torch.Tensor:
        live = ref()
        return t if live is None else live.pack(t)

    return pack


def profile_activations(gm: fx.GraphModule, flat_inputs: list[object],
                        block_of: Callable[[fx.Node], BlockKey | None]) -> ActivationProfile:
    """Interpret ``gm`` (meta parameters) on meta ``flat_inputs`` and measure saved activations."""
    profiler = _Profiler(gm, block_of)
    with (torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_weak_pack(profiler), lambda t: t),
          profiler.flop_counter):
        profiler.run(*flat_inputs)
    return ActivationProfile(root_bytes=profiler.root_bytes, calls=profiler.calls, tail_flops=profiler.tail_flops)
