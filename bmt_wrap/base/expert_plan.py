"""The experts section of a plan: the mixture-of-experts layers, where each one's experts are placed over
``ep_size`` expert-parallel ranks, why a layer stays dense, and what expert parallelism moves per step
(docs/design.md, "Expert parallelism").

Plain dataclasses with a JSON round-trip, like the rest of the plan: ``passes/experts.py`` fills one in.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from ..errors import ExpertParallelError
from .dtypes import itemsize


@dataclass
class MoELayer:
    """One mixture-of-experts layer: a router whose top-k indices choose among ``num_experts`` experts."""

    module: str  # the layer (e.g. ``model.layers.0.mlp``)
    router: str  # the child whose parameters score the experts (a weight with one row per expert)
    experts: str  # the child holding the experts
    layout: str  # "packed": 3-D weights, expert on dim 0; "list": a ModuleList/ModuleDict of expert MLPs
    num_experts: int
    top_k: int
    hidden: int  # width of the tokens the experts receive
    activation_dtype: str  # dtype of those tokens (what dispatch and combine move)
    params: dict[str, list[int]]  # each expert parameter (full name) -> its full shape, experts on dim 0
    expert_bytes: int  # every expert's parameters, unsharded
    dense: list[str] = field(default_factory=list)  # the layer's other children: shared experts, their gates
    # The experts module's int attributes counting its experts (transformers' ``num_experts``): an EP rank's
    # module holds ``num_experts / ep_size`` of them, and its forward sizes its work by them.
    counts: list[str] = field(default_factory=list)

    def owned(self, ep_rank: int, ep_size: int) -> range:
        """The experts EP rank ``ep_rank`` of ``ep_size`` holds: a contiguous run of ``num_experts / ep_size``."""
        per = self.num_experts // ep_size
        return range(ep_rank * per, (ep_rank + 1) * per)

    def local_params(self, count: int) -> dict[str, list[int]]:
        """Each expert parameter's name and shape on a rank holding ``count`` of this layer's experts: a packed
        one's ``count`` experts on dim 0; a list's children numbered ``0 .. count - 1`` (when planned)."""
        if self.layout == "packed":
            return {n: [count, *s[1:]] for n, s in self.params.items()}
        star = f"{self.experts}.*."
        return {n.replace(star, f"{self.experts}.{j}.", 1): s[1:] for n, s in self.params.items() for j in range(count)}

    def token_bytes(self, tokens: int) -> int:
        """Bytes of one copy of the (token, expert) pairs one rank routes: ``tokens x k x hidden``."""
        return tokens * self.top_k * self.hidden * itemsize(self.activation_dtype)


@dataclass
class DenseLayer:
    """A layer that looked like a mixture of experts and stays dense (ZeRO-3 like the rest), with why."""

    module: str
    reason: str


@dataclass
class ExpertPlan:
    """How a model's MoE layers are split over ``ep_size`` expert-parallel ranks (1: found, not split)."""

    ep_size: int
    layers: list[MoELayer] = field(default_factory=list)
    dense: list[DenseLayer] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # ``ep_capacity_factor=``: each expert takes at most ceil(factor x tokens x k / experts) of a call's
    # (token, expert) pairs on each rank, the first in token order; None: dropless (``capacity``).
    capacity_factor: float | None = None

    def capacity(self, layer: MoELayer, tokens: int) -> int | None:
        """The most (token, expert) pairs one of ``layer``'s experts takes from a rank's call of ``tokens``
        tokens (GShard's and Megatron's expert capacity); None: no limit."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * tokens * layer.top_k / layer.num_experts)

    def expert_params(self) -> dict[str, list[int]]:
        """Every expert parameter of every split layer -> its full shape."""
        return {n: s for layer in self.layers for n, s in layer.params.items()}

    def local_shapes(self) -> dict[str, list[int]]:
        """Each expert parameter's name and shape on one EP rank, holding ``num_experts / ep_size`` experts
        (a list's numbered from 0 when planned: ``wrapping/experts.py``)."""
        return {n: s for layer in self.layers for n, s in layer.local_params(layer.num_experts // self.ep_size).items()}

    def expert_bytes(self) -> int:
        """Every expert's parameter bytes, unsharded."""
        return sum(layer.expert_bytes for layer in self.layers)

    def exchange_bytes(self, tokens: int) -> int:
        """Bytes of all-to-all buffers one layer's exchange holds on a rank routing ``tokens`` tokens (the
        largest layer's), with uniform routing: its (token, expert) rows four times, the rows sent and
        received by the dispatch and by the combine (``runtime/experts.py``), which a checkpointed block's
        recompute and backward hold beside the experts' own activations."""
        return max((4 * layer.token_bytes(tokens) for layer in self.layers), default=0) if self.ep_size > 1 else 0

    def traffic(self, world: int, tokens: int | None, recomputed: Collection[str] = ()) -> dict[str, int | None]:
        """Bytes per rank per training step for the experts, at ``world`` data-parallel ranks.

        ``experts_per_rank``: this rank's shard of its experts (ZeRO-3 over the ``world / ep_size`` ranks that
        own the same experts). ``all_to_all``: bytes a rank sends to the other EP ranks when routing is
        uniform, for ``tokens`` tokens per rank (None without them): dispatch and combine in forward, both
        again in backward, and once more in the recompute of a layer inside a checkpointed block (one of
        ``recomputed``). ``ep_zero``: the gathers and reduce-scatter of the owned experts among their owners,
        counted as the ZeRO estimate counts them (``shard x (R - 1)`` per gather: forward, backward, one
        reduce-scatter). ``zero3``: the same for every expert without EP, over all ``world`` ranks.
        """
        e = self.ep_size
        if world % e:
            raise ExpertParallelError(f"ep_size {e} does not divide the {world} data-parallel ranks")
        owners, total = world // e, self.expert_bytes()

        def passes(layer: MoELayer) -> int:
            return 6 if any(layer.module.startswith(f"{b}.") for b in recomputed) else 4

        a2a = None if tokens is None else sum(
            passes(layer) * layer.token_bytes(tokens) * (e - 1) // e for layer in self.layers)
        return {"experts_per_rank": -(-total // world), "all_to_all": a2a,
                "ep_zero": 3 * (total // e // owners) * (owners - 1),
                "zero3": 3 * -(-total // world) * (world - 1)}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ExpertPlan:
        """The section as ``dataclasses.asdict`` wrote it (the plan's JSON)."""
        return cls(ep_size=raw["ep_size"], notes=list(raw.get("notes", [])), capacity_factor=raw.get("capacity_factor"),
                   layers=[MoELayer(**layer) for layer in raw.get("layers", [])],
                   dense=[DenseLayer(**d) for d in raw.get("dense", [])])


def experts_text(section: ExpertPlan) -> list[str]:
    """The section as ``str(plan)`` shows it: each MoE layer and its placement, each dense one and why."""
    e = section.ep_size
    cap = section.capacity_factor
    lines = [f"experts: {len(section.layers)} mixture-of-experts layer(s), ep_size={e}"
             + (f", {len(section.dense)} left dense" if section.dense else "")
             + (f", capacity factor {cap:g} (each expert takes at most ceil({cap:g} x tokens x k / experts) "
                "pairs of a rank's call, the first in token order; the rest are dropped)" if cap is not None
                else "")]
    for layer in section.layers:
        where = "; ".join(f"ep rank {r}: experts {layer.owned(r, e).start}-{layer.owned(r, e).stop - 1}"
                          for r in range(e)) if e > 1 else "every expert on every rank (ZeRO-3)"
        dense = f"; dense beside them: {', '.join(layer.dense)}" if layer.dense else ""
        lines.append(f"  {layer.module}: router {layer.router} picks {layer.top_k} of {layer.num_experts} "
                     f"experts in {layer.experts} ({layer.layout}, {layer.expert_bytes:,} bytes){dense}")
        lines.append(f"    {where}")
    lines += [f"  dense {d.module}: {d.reason}" for d in section.dense]
    lines += [f"  note: {n}" for n in section.notes]
    return lines
