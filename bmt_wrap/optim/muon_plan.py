"""Who orthogonalises which matrix in a sharded Muon step, and what moves (pure: no communication).

A matrix whose elements one rank holds entirely is orthogonalised there and never moves. A matrix that
straddles ranks goes, in bf16, to one owner, chosen greedily (largest first) for the least Newton-Schulz
load so far, each rank's own whole matrices counted; the owner sends each holder its range of the result.
Both directions are one reduce-scatter each (``optim/muon.py``): rank r's segment of the "there" buffer
holds the matrices r owns, laid end to end; rank r's segment of the "back" buffer holds its ranges of the
straddling matrices, in order. Segments are padded to one length (even: bf16 travels as int32 pairs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

BF16_BYTES = 2


@dataclass(frozen=True)
class MatrixPieces:
    """One matrix: its shape and the ``[start, end)`` of its flattened elements each rank holds."""

    shape: tuple[int, int]
    ranges: tuple[tuple[int, int], ...]

    @property
    def holders(self) -> list[int]:
        """Ranks holding at least one element."""
        return [r for r, (s, e) in enumerate(self.ranges) if e > s]

    @property
    def numel(self) -> int:
        """Elements of the full matrix."""
        return self.shape[0] * self.shape[1]

    def ns_flops(self, ns_steps: int) -> int:
        """Newton-Schulz FLOPs on it (the Gram matrix is taken on the shorter side)."""
        m, n = sorted(self.shape)
        return ns_steps * (4 * m * m * n + 2 * m ** 3)


@dataclass
class MuonPlan:
    """Owners and exchange layout of one world size's sharded Muon step."""

    world_size: int
    owners: list[int]  # per matrix
    straddling: list[int]  # matrix indices that move, in exchange order
    there_offsets: dict[int, int] = field(default_factory=dict)  # matrix -> offset in its owner's segment
    there_segment: int = 0  # elements per rank of the "there" buffer
    back_offsets: dict[tuple[int, int], int] = field(default_factory=dict)  # (matrix, rank) -> offset
    back_segment: int = 0
    load: list[int] = field(default_factory=list)  # Newton-Schulz FLOPs per rank

    def bytes_per_rank(self) -> int:
        """Algorithmic bytes each rank moves per step: two reduce-scatters of bf16 segments."""
        return (self.world_size - 1) * (self.there_segment + self.back_segment) * BF16_BYTES


def _even(n: int) -> int:
    return n + (n % 2)


def plan_muon(matrices: Sequence[MatrixPieces], world_size: int, ns_steps: int) -> MuonPlan:
    """The owner of every matrix and where each piece travels; identical on every rank (no randomness)."""
    load = [0] * world_size
    owners = [-1] * len(matrices)
    straddling = []
    for i, m in enumerate(matrices):
        holders = m.holders
        if len(holders) == 1:
            owners[i] = holders[0]
            load[holders[0]] += m.ns_flops(ns_steps)
        elif len(holders) > 1:
            straddling.append(i)
    # Largest first, each to the least-loaded rank; ties go to the rank holding most of it (fewer bytes).
    for i in sorted(straddling, key=lambda i: (-matrices[i].ns_flops(ns_steps), i)):
        m = matrices[i]
        owner = min(range(world_size), key=lambda r: (load[r], -(m.ranges[r][1] - m.ranges[r][0]), r))
        owners[i] = owner
        load[owner] += m.ns_flops(ns_steps)
    plan = MuonPlan(world_size, owners, straddling, load=load)
    fill = [0] * world_size
    back_fill = [0] * world_size
    for i in straddling:
        plan.there_offsets[i] = fill[owners[i]]
        fill[owners[i]] += matrices[i].numel
        for r in matrices[i].holders:
            plan.back_offsets[(i, r)] = back_fill[r]
            back_fill[r] += matrices[i].ranges[r][1] - matrices[i].ranges[r][0]
    plan.there_segment = _even(max(fill)) if straddling else 0
    plan.back_segment = _even(max(back_fill)) if straddling else 0
    return plan
