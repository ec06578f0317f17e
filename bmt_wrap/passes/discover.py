"""Block discovery: find the repeated units of a model from its module tree alone (docs/design.md rules).

Blocks are maximal sets of >= 2 same-signature siblings; the outermost container with such a set
wins; a same-container sibling that is near-identical to one of them (T5's block 0, a ResNet stage's
first block) is a block of its own; a block must hold >= 0.5% of all parameters; blocks never nest.
A module without a forward of its own (``ModuleList``, ``ModuleDict``) is never called, so it is never a
block: it is read as the container it is (Funnel's encoder keeps its layers in a list of lists).
A layer compiled with ``torch.compile(layer)`` is read as the layer it wraps: it is the same block as its
uncompiled siblings, and the block is the inner module (``layers.0._orig_mod``, the names plain torch
gives its parameters), whose compiled code the executor then runs (``bmt_wrap/wrapping/compiled.py``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property

from torch import nn

from .signature import SignatureCache, near_identical, uncompiled

#: A candidate block smaller than this fraction of all parameters stays in its parent's group: gathering
#: it separately would cost a collective launch for almost no memory saved.
MIN_BLOCK_FRACTION = 0.005


@dataclass(frozen=True)
class DiscoveredBlock:
    """One discovered block: a module gathered, checkpointed and released as a unit (the wrapper then binds
    it as a ``CheckpointBlock``, which ``bmt.Block`` names)."""

    fqn: str  # canonical name (first in ``named_modules(remove_duplicate=False)``)
    container: str  # FQN of the module whose child it is ("" for the model itself)
    signature: str
    numel: int  # unique parameter elements under the block
    aliases: tuple[str, ...] = ()  # other names of the same module object

    @property
    def names(self) -> tuple[str, ...]:
        """Every name of the block module, canonical first."""
        return (self.fqn, *self.aliases)


@dataclass(frozen=True)
class BlockList:
    """The blocks of one container, in module order."""

    container: str
    members: tuple[str, ...]


@dataclass
class Discovery:
    """Blocks of a model in module order, and why the tree was read the way it was."""

    blocks: list[DiscoveredBlock]
    total_numel: int
    notes: list[str] = field(default_factory=list)

    def fqns(self) -> list[str]:
        """Canonical block names in module order."""
        return [b.fqn for b in self.blocks]

    @property
    def lists(self) -> list[BlockList]:
        """Blocks grouped by container (an encoder-decoder has two lists)."""
        by_container: dict[str, list[str]] = {}
        for b in self.blocks:
            by_container.setdefault(b.container, []).append(b.fqn)
        return [BlockList(c, tuple(m)) for c, m in by_container.items()]

    @cached_property
    def canonical(self) -> dict[str, str]:
        """Map from every block name (aliases included) to its canonical name."""
        return {n: b.fqn for b in self.blocks for n in b.names}

    def owner(self, name: str) -> str | None:
        """Canonical name of the block that ``name`` (a parameter or module FQN) lies under, if any."""
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            hit = self.canonical.get(".".join(parts[:i]))
            if hit is not None:
                return hit
        return None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _runs_itself(m: nn.Module) -> bool:
    """True if ``m`` has a forward: only a module that is called can be gathered around its call."""
    return type(uncompiled(m)).forward is not nn.Module.forward


def discover_blocks(model: nn.Module) -> Discovery:
    """Find the blocks of ``model`` by structure (works on meta-device models)."""
    signature = SignatureCache()
    total = sum(p.numel() for p in model.parameters())
    threshold = MIN_BLOCK_FRACTION * total
    names: dict[int, list[str]] = defaultdict(list)
    for fqn, m in model.named_modules(remove_duplicate=False):
        names[id(m)].append(fqn)

    blocks: list[DiscoveredBlock] = []
    notes: list[str] = []
    seen: set[int] = set()  # modules already made blocks or descended into (an alias is read once)

    def numel(m: nn.Module) -> int:
        return sum(p.numel() for p in m.parameters())

    def big_enough(m: nn.Module) -> bool:
        return 0 < numel(m) >= threshold

    def add_block(container: str, m: nn.Module) -> None:
        m = uncompiled(m)  # the module that owns the parameters and runs in the executor
        if id(m) not in seen:
            seen.add(id(m))
            fqn, *aliases = names[id(m)]
            blocks.append(DiscoveredBlock(fqn, container, signature(m), numel(m), tuple(aliases)))

    def visit(prefix: str, module: nn.Module) -> None:
        seen.add(id(module))
        children = list(module.named_children())
        by_sig: dict[str, list[nn.Module]] = defaultdict(list)
        for _, c in children:
            if _runs_itself(c):
                by_sig[signature(c)].append(c)
        runs = [ms for ms in by_sig.values() if len(ms) >= 2]
        in_run = {id(m) for ms in runs for m in ms}
        for ms in runs:
            size = numel(ms[0])
            if 0 < size < threshold:
                first = names[id(ms[0])][0]
                notes.append(f"{len(ms)} same-structure modules like {first!r} hold {size / total:.2%} of the "
                             f"parameters each (< {MIN_BLOCK_FRACTION:.1%}): kept in the parent's group")
        for name, c in children:
            if id(c) in in_run:
                if big_enough(c):
                    add_block(prefix, c)
                # A run member is never descended into: the outermost run wins even when too small.
            elif _runs_itself(c) and big_enough(c) and any(near_identical(c, ms[0]) for ms in runs):
                add_block(prefix, c)
                notes.append(f"{_join(prefix, name)!r} differs slightly from its siblings: a block of its own")
            elif id(c) not in seen:
                visit(_join(prefix, name), c)

    visit("", model)
    if not blocks:
        notes.append("no repeated blocks: every parameter stays in the root group")
    return Discovery(blocks=blocks, total_numel=total, notes=notes)
