"""Property tests over random block structures: discovery finds exactly the generated repeated units,
and the plan places every parameter once, aligned, with a layout independent of the world size."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from bmt_wrap.dtypes import align_elems
from bmt_wrap.passes import build_plan, discover_blocks
from bmt_wrap.passes.discover import MIN_BLOCK_FRACTION
from bmt_wrap.plan import ROOT


class Unit(nn.Module):
    """A generated repeated unit; ``heads`` are same-shape siblings inside it (never blocks themselves)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.proj_in = nn.Linear(width, 2 * width)
        self.proj_out = nn.Linear(2 * width, width)
        if heads:
            self.heads = nn.ModuleList(nn.Linear(width, width) for _ in range(heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Only a module that is called can be a block (a ModuleList never is): units have a forward.
        h = self.proj_out(torch.relu(self.proj_in(self.norm(x))))
        return x + h + sum(head(x) for head in getattr(self, "heads", []))


def _container(kind: str, units: list[Unit]) -> tuple[nn.Module, list[str]]:
    if kind == "list":
        return nn.ModuleList(units), [str(i) for i in range(len(units))]
    if kind == "seq":
        return nn.Sequential(*units), [str(i) for i in range(len(units))]
    keys = [f"u{i}" for i in range(len(units))]
    if kind == "dict":
        return nn.ModuleDict(dict(zip(keys, units, strict=True))), keys
    holder = nn.Module()  # plain attributes
    for k, u in zip(keys, units, strict=True):
        setattr(holder, k, u)
    return holder, keys


@st.composite
def structures(draw: st.DrawFn) -> tuple[nn.Module, list[str], list[str]]:
    """A meta model, the block FQNs discovery must find (module order), and parameters shared by blocks."""
    with torch.device("meta"):  # built in place: Module.to("meta") would untie shared parameters
        return _structure(draw)


def _structure(draw: st.DrawFn) -> tuple[nn.Module, list[str], list[str]]:
    parts: list[tuple[str, nn.Module, list[str]]] = []
    shared: list[str] = []
    for i in range(draw(st.integers(1, 3))):
        width = 8 + 4 * i  # distinct widths: different lists never look alike
        units = [Unit(width, draw(st.integers(0, 3))) for _ in range(draw(st.integers(2, 5)))]
        units = [Unit(width, len(getattr(units[0], "heads", []))) for _ in units]  # same structure in a list
        container, keys = _container(draw(st.sampled_from(["list", "seq", "dict", "attrs"])), units)
        path = [f"part{i}"]
        for _ in range(draw(st.integers(0, 2))):  # bury the list under plain holder modules
            holder = nn.Module()
            holder.inner = container
            container = holder
            path.append("inner")
        if draw(st.booleans()):  # one LayerNorm weight shared by every unit of the list
            for u in units[1:]:
                u.norm.weight = units[0].norm.weight
            shared.append(".".join([*path, keys[0], "norm.weight"]))
        parts.append((f"part{i}", container, [".".join([*path, k]) for k in keys]))
    fillers = [(f"filler{k}", nn.Linear(3, 7 + k), []) for k in range(draw(st.integers(0, 3)))]
    model = nn.Module()
    expected: list[str] = []
    for name, module, blocks in draw(st.permutations(parts + fillers)):
        setattr(model, name, module)
        expected += blocks
    return model, expected, shared


@given(structures())
def test_discovery_finds_exactly_the_generated_units(case: tuple[nn.Module, list[str], list[str]]) -> None:
    model, expected, _ = case
    d = discover_blocks(model)
    assert d.fqns() == expected
    assert not any(b.startswith(a + ".") for a in expected for b in expected), "blocks are never nested"
    assert all(b.numel >= MIN_BLOCK_FRACTION * d.total_numel for b in d.blocks)


@given(structures())
def test_plan_places_every_parameter_once_aligned_and_independent_of_world_size(
        case: tuple[nn.Module, list[str], list[str]]) -> None:
    model, expected, shared = case
    d = discover_blocks(model)
    plans = {n: build_plan(model, d, world_size=n) for n in (1, 3, 8)}
    plan = plans[3]
    plan.validate()
    assert [g.name for g in plan.groups] == [ROOT, *expected]
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    assert sorted(plan.all_fqns()) == sorted(names)
    assert set(shared) <= {s.fqn for _, s in plan.group(ROOT).slots()}, "shared parameters live in the root"
    for group in plan.groups:
        for buf in group.buffers:
            spans = sorted((s.offset, s.offset + s.numel) for s in buf.slots)
            assert all(lo % align_elems(buf.dtype) == 0 for lo, _ in spans)
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), "slots overlap"
            for n in (1, 3, 8):
                padded = buf.padded_numel(n)
                assert padded % n == 0 and padded >= buf.numel
                assert buf.shard_numel(n) % align_elems(buf.dtype) == 0
    assert plans[1].groups == plans[3].groups == plans[8].groups, "layout depends on the world size"
