"""Spend a memory budget where it buys speed (docs/design.md "Memory budget").

Starting from the schedule the options ask for (by default ZeRO-3 with every block recomputed), each
block can buy two things with memory:

- **keep its parameters gathered** from forward to backward (``zero_level=2``, FSDP2's
  ``reshard_after_forward=False``): no second all-gather. Saves the block's gathered bytes x (N-1)/N;
  costs its gathered buffers for the whole step;
- **keep its activations**: no recompute in backward. Saves the block's forward FLOPs; costs what
  autograd saves inside the block beyond its inputs (measured on the exported graph).

Choices are ranked in one fixed order and the budget buys the longest prefix of it that fits, so a
larger budget only ever adds choices. Then prefetch deepens while memory allows. Pure: no communication.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ..base.plan import PEAK_ROW, ShardGroupSpec, WrapPlan, fmt_bytes
from ..errors import MemoryBudgetError
from .activations import ActivationProfile
from .capacity import scheduled_estimate
from .estimate import gathered_traffic, held_gathered, tp_of

#: Depth 1 already overlaps each block's gather with the previous block's compute; a second gather in
#: flight absorbs uneven block times. Deeper only holds more memory: collectives run one at a time.
MAX_PREFETCH_DEPTH = 2

ACTIVATIONS = "activations"
PARAMETERS = "parameters"
#: Which kind of choice the budget takes first (docs/design.md "Memory budget"). A block that keeps its
#: activations but reshards must free its gathered storage after forward and refill it before backward
#: (a kept graph views it); on CPU each refill is a fresh page-faulted allocation that can cost more than
#: the recompute it saves. Parameters kept first make every later activation choice land on a block whose
#: buffer stays put, and their cost is fixed by the model where activations grow with the batch.
KIND_ORDER = (PARAMETERS, ACTIVATIONS)


@dataclass(frozen=True)
class Choice:
    """One way to spend memory on one block: what it saves per step and the bytes per rank it costs."""

    kind: str  # ACTIVATIONS or PARAMETERS
    block: str
    saving: int  # FLOPs of recompute (activations) or bytes of all-gather (parameters) avoided per step
    cost: int  # bytes per rank it holds (before the estimate's shared terms shift)

    @property
    def per_byte(self) -> float:
        """Saving per byte of memory: the rank within one kind."""
        return self.saving / max(self.cost, 1)

    def apply(self, group: ShardGroupSpec, on: bool = True) -> None:
        """Make (or, with ``on=False``, undo) this choice on ``group``."""
        if self.kind == ACTIVATIONS:
            group.checkpoint = not on
        else:
            group.zero_level = 2 if on else 3

    def describe(self) -> str:
        """``keep activations of layers.3`` and the like, for notes."""
        what = "activations" if self.kind == ACTIVATIONS else "parameters gathered"
        return f"keep {what} of {self.block}"


def choices(plan: WrapPlan, activations: ActivationProfile, world_size: int) -> list[Choice]:
    """Every choice the budget may take on ``plan``, in the order it takes them."""
    saved: dict[str, int] = defaultdict(int)
    flops: dict[str, int] = defaultdict(int)
    for call in activations.calls:
        saved[call.block] += max(call.saved_bytes - call.input_bytes, 0)
        flops[call.block] += call.flops
    calls = defaultdict(int)
    for name in plan.order:
        calls[name] += 1
    # Ties go to the blocks called last: their backward runs first, where a gather or a recompute has
    # the least earlier work to hide behind.
    last = {name: i for i, name in enumerate(plan.order)}
    found: list[Choice] = []
    for g in plan.blocks():
        if g.name not in last:
            continue  # not scheduled (an edited plan): it runs as root code
        if g.checkpoint:
            found.append(Choice(ACTIVATIONS, g.name, flops[g.name], saved[g.name]))
        gathers = calls[g.name] * gathered_traffic(g, world_size, tp_of(plan))
        if g.zero_level == 3 and gathers > 0:  # one rank gathers nothing: keeping would buy nothing
            found.append(Choice(PARAMETERS, g.name, gathers, held_gathered(g, world_size, tp_of(plan))))
    return sorted(found, key=lambda c: (KIND_ORDER.index(c.kind), -c.per_byte, -last[c.block]))


def minimum_error(needed: int, budget: int, world_size: int, activations_known: bool) -> MemoryBudgetError:
    """The error for a budget the plan's least memory-hungry schedule already exceeds."""
    unknown = "" if activations_known else " plus activations (unknown without example inputs)"
    return MemoryBudgetError(
        f"memory_budget={budget} ({fmt_bytes(budget)}) per rank cannot be met on {world_size} rank(s): "
        f"recomputing every block and resharding after forward needs at least {needed} B "
        f"({fmt_bytes(needed)}){unknown}. Raise memory_budget to at least {needed}, add ranks, shrink the "
        "batch or lower prefetch_depth.", needed=needed, world_size=world_size, activations_known=activations_known)


def fit_budget(plan: WrapPlan, activations: ActivationProfile | None, world_size: int, budget: int) -> list[str]:
    """Make the longest prefix of ``plan``'s choices that stays within ``budget``, then deepen prefetch.

    Mutates ``plan``; returns notes saying what was chosen. Raises ``MemoryBudgetError`` when ``plan`` as
    given already exceeds ``budget``.
    """
    def total() -> int:
        # The step's peak as the capacity plan counts it (by phase), not the sum of terms that peak apart:
        # the estimates table's PEAK_ROW.
        return scheduled_estimate(plan, world_size, activations).peak or 0

    if total() > budget:
        raise minimum_error(total(), budget, world_size, activations is not None)
    if activations is None:
        return [f"memory budget {fmt_bytes(budget)}: activation bytes unknown, so every block stays as the options "
                "say until inputs are known (example_inputs=, or the wrapper's first forward)"]
    groups = {g.name: g for g in plan.blocks()}
    order = choices(plan, activations, world_size)
    totals = []
    for choice in order:
        choice.apply(groups[choice.block])
        totals.append(total())
    # The longest prefix that fits, not the first that does not: keeping the last block's parameters frees
    # the pooled buffers the others cycled through, so a prefix can fit where a shorter one did not.
    k = max((i + 1 for i, t in enumerate(totals) if t <= budget), default=0)
    for choice in order[k:]:
        choice.apply(groups[choice.block], on=False)
    taken = order[:k]
    stopped = f"; next: {order[k].describe()} needs {fmt_bytes(totals[k])}" if k < len(order) else ""
    deepest = min(MAX_PREFETCH_DEPTH, max(len(plan.order) - 1, 0))
    while plan.prefetch_depth < deepest:
        plan.prefetch_depth += 1
        if total() > budget:
            plan.prefetch_depth -= 1
            break
    blocks = len(groups)
    kept = [c.block for c in taken if c.kind == ACTIVATIONS]
    gathered = [c.block for c in taken if c.kind == PARAMETERS]
    return [f"memory budget {fmt_bytes(budget)}: {len(gathered)} of {blocks} blocks keep parameters gathered "
            f"through backward{': ' + ', '.join(gathered) if gathered else ''}; {len(kept)} of {blocks} keep "
            f"activations{': ' + ', '.join(kept) if kept else ''}{stopped}",
            f"memory budget {fmt_bytes(budget)}: prefetch depth {plan.prefetch_depth}, {PEAK_ROW} "
            f"{fmt_bytes(total())} per rank (the table's total sums terms that peak at different moments)"]
