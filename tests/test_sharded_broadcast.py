"""Elementwise ops between a sharded tensor and a plain operand that broadcasts to its full shape: the
in-place form (``x.div_(x.norm(dim=(-2, -1), keepdim=True))``, how Muon-style optimizers write) gives what
the out-of-place form and plain PyTorch give, for every broadcast — one-element operands of any ndim,
row and column vectors, the full shape less leading dims, 0-d tensors, scalars — and where broadcasting
would widen the in-place result, raises what plain PyTorch raises. On 2 ranks, so a ragged range meets
the broadcast."""

from __future__ import annotations

import torch
from dist_harness import raised, run_distributed
from hypothesis import given
from hypothesis import strategies as st
from parity import whole

import bmt_wrap as bmt

_OPS = ("mul", "div", "add")


def _broadcast_body(shape: list[int], operand: list[int] | None) -> dict[str, tuple[str, str]]:
    """Each op in and out of place on a sharded tensor of ``shape`` against ``operand`` (a plain tensor of
    that shape; None: a Python scalar), checked against plain PyTorch; what each in-place form raised."""
    torch.manual_seed(len(shape))
    full = torch.randn(shape)
    y = 1.5 if operand is None else torch.rand(operand) + 0.5
    outcomes = {}
    for op in _OPS:
        want = getattr(full, op)(y)
        x = bmt.DistributedParameter(full.clone()).detach()
        torch.testing.assert_close(whole(getattr(x, op)(y)), want)
        plain = raised(lambda op=op: getattr(full.clone(), f"{op}_")(y))
        got = raised(lambda op=op, x=x: getattr(x, f"{op}_")(y))
        outcomes[op] = (plain[0], got[0])
        if got[0] == "ok":
            assert getattr(x, f"{op}_")(y) is x
            torch.testing.assert_close(x.full_tensor(), getattr(want, op)(y))  # the op applied twice
    return outcomes


@st.composite
def _shapes(draw: st.DrawFn) -> tuple[list[int], list[int] | None]:
    """A full shape and an operand that broadcasts against it: each dim kept or 1, leading dims dropped,
    1s prepended (which widens the result: in place, plain PyTorch raises), or a Python scalar."""
    shape = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    if draw(st.booleans()) and draw(st.booleans()):
        return shape, None
    kept = [d if draw(st.booleans()) else 1 for d in shape]
    dropped = kept[draw(st.integers(0, len(kept))):]
    return shape, [1] * draw(st.sampled_from([0, 0, 0, 1, 2])) + dropped


@given(shapes=_shapes())
def test_in_place_ops_against_a_broadcast_plain_operand_match_out_of_place_and_plain(
        shapes: tuple[list[int], list[int] | None]) -> None:
    for outcomes in run_distributed(_broadcast_body, 2, *shapes):
        for op, (plain, got) in outcomes.items():
            assert got == plain, f"{op}_ on {shapes}: plain PyTorch gave {plain}, the sharded tensor {got}"


def _muon_style_body() -> bool:
    """The issue's case: a 2-D sharded value divided in place by its keepdim norm, a [1, 1] tensor."""
    torch.manual_seed(0)
    full = torch.randn(6, 5)
    x = bmt.DistributedParameter(full.clone()).detach()
    bmt.reset_comm_stats()
    x.div_(torch.ones(1, 1) * 2)  # a one-element operand is read as a scalar: no gather
    assert "materialize" not in bmt.comm_stats()
    x.div_(x.norm(dim=(-2, -1), keepdim=True))
    torch.testing.assert_close(x.full_tensor(), full / 2 / (full / 2).norm(dim=(-2, -1), keepdim=True))
    return True


def test_in_place_division_by_a_keepdim_norm_matches_plain() -> None:
    assert all(run_distributed(_muon_style_body, 2))
