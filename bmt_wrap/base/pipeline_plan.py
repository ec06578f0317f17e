"""The pipeline section of a plan: which blocks and root parameters each stage holds, the micro-batches
and the schedule (docs/design.md, "Pipeline parallelism in the one-liner").

Plain dataclasses with a JSON round-trip, like the rest of the plan: ``passes/pipeline.py`` fills one in,
``wrapping/pipeline.py`` applies it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import PlanError

#: The schedules the one-liner's own loop runs (autograd's order); torch's schedules come through
#: ``bmt.pipeline_step`` (wrapping/pipeline.py).
SCHEDULES = ("gpipe",)


@dataclass
class PipelineStage:
    """One stage: its blocks (in call order) and the root parameters it holds (canonical names)."""

    blocks: list[str]
    root: list[str] = field(default_factory=list)
    param_bytes: int = 0  # every parameter the stage holds, unsharded (divide by the shard size per rank)


@dataclass
class PipelinePlan:
    """How the one-liner splits a model over ``size`` ranks of a pipeline, ``virtual`` stages each (``stages``
    holds ``size x virtual`` of them, stage ``s`` on rank ``s % size``: Megatron's interleaved layout), run as
    ``schedule`` over ``microbatches``."""

    size: int
    microbatches: int
    stages: list[PipelineStage]
    schedule: str = "gpipe"
    # Where the root parameters' stages were read: "graph" (the captured forward's order of uses) or
    # "registration" (module registration order, checked against the first call's capture).
    root_source: str = "registration"
    notes: list[str] = field(default_factory=list)
    virtual: int = 1  # stages per rank (pp_virtual_stages)

    def rank_of(self, stage: int) -> int:
        """The pipe-group rank that runs stage ``stage``."""
        return stage % self.size

    def stages_on(self, rank: int) -> list[int]:
        """The stages rank ``rank`` runs, in order: ``rank``, ``rank + size``, ..."""
        return list(range(rank, len(self.stages), self.size))

    def rank_of_block(self, block: str) -> int:
        """The pipe-group rank that holds ``block``."""
        return self.rank_of(self.stage_of(block))

    def stage_of(self, block: str) -> int:
        """The stage that runs ``block``."""
        for i, s in enumerate(self.stages):
            if block in s.blocks:
                return i
        raise PlanError(f"block {block!r} is in no stage of the plan's pipeline section")

    def root_sets(self) -> list[tuple[tuple[int, ...], list[str]]]:
        """The root parameters grouped by the ranks that hold them, in a fixed order: (ranks, names). A
        parameter two stages on two ranks use (a tied embedding and head) is in one set held by both."""
        holders: dict[str, tuple[int, ...]] = {}
        for i, s in enumerate(self.stages):
            for name in s.root:
                if self.rank_of(i) not in holders.get(name, ()):
                    holders[name] = (*holders.get(name, ()), self.rank_of(i))
        sets: dict[tuple[int, ...], list[str]] = {}
        for name, stages in holders.items():
            sets.setdefault(stages, []).append(name)
        return sorted(sets.items(), key=lambda kv: (len(kv[0]), kv[0]))

    def bubble(self) -> float:
        """The idle fraction of a GPipe or 1F1B step, (P - 1) / (M + P - 1); with V stages per rank, that of
        an interleaved (or looped BFS) one, (P - 1) / (V x M + P - 1)."""
        return (self.size - 1) / (self.virtual * self.microbatches + self.size - 1)

    def to_dict(self) -> dict[str, Any]:
        """The section as JSON-ready data."""
        return {"size": self.size, "microbatches": self.microbatches, "virtual": self.virtual, "schedule": self.schedule,
                "root_source": self.root_source, "notes": list(self.notes),
                "stages": [{"blocks": s.blocks, "root": s.root, "param_bytes": s.param_bytes} for s in self.stages]}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> PipelinePlan:
        """The section ``to_dict`` wrote."""
        return cls(size=raw["size"], microbatches=raw["microbatches"], virtual=raw.get("virtual", 1),
                   schedule=raw.get("schedule", "gpipe"),
                   root_source=raw.get("root_source", "registration"), notes=list(raw.get("notes", [])),
                   stages=[PipelineStage(**s) for s in raw["stages"]])


def pipeline_text(section: PipelinePlan) -> list[str]:
    """The section as ``str(plan)`` and ``bmt-wrap dump`` show it: one line per stage."""
    stages = f"{section.size} ranks x {section.virtual} stages" if section.virtual > 1 else f"{section.size} stages"
    # With several stages per rank the bound is pipeline_step's interleaved schedules'; the loop runs them serially
    bubble = f"bubble {section.bubble():.0%}" + (" under Interleaved1F1B" if section.virtual > 1 else "")
    lines = [f"pipeline: {stages}, {section.microbatches} micro-batches, {section.schedule} "
             f"({bubble}); root parameters' stages from the {section.root_source}"]
    for i, s in enumerate(section.stages):
        blocks = f"{s.blocks[0]} .. {s.blocks[-1]}" if len(s.blocks) > 2 else ", ".join(s.blocks)
        root = f"; root: {', '.join(s.root)}" if s.root else ""
        rank = f" (rank {section.rank_of(i)})" if section.virtual > 1 else ""
        lines.append(f"  stage {i}{rank}: {len(s.blocks)} block(s) {blocks}{root}; {s.param_bytes:,} parameter "
                     "bytes (unsharded)")
    lines += [f"  note: {n}" for n in section.notes]
    return lines
