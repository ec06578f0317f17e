"""A shard group's explicit states: every transition of a real group, and the assertion that guards them."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_distributed
from toy import ToyGPT, manual_plan

from bmt_wrap.apply_plan import apply_plan
from bmt_wrap.runtime.group import GroupState, StorageMode, _assert_in


def _transitions_body(checkpoint: bool) -> list[str]:
    torch.manual_seed(0)
    m = apply_plan(ToyGPT(n_layers=2), manual_plan(ToyGPT(n_layers=2), ["layers.0", "layers.1"],
                                                   checkpoint=checkpoint))
    group = m.layers[0]._bmt_group
    assert group.mode is (StorageMode.POOLED if checkpoint else StorageMode.RESIZABLE)
    seen = [group.state.value]
    group.start_gather()
    seen.append(group.state.value)
    group.start_gather()  # no-op while in flight
    seen.append(group.state.value)
    full = group.wait_gathered()
    seen.append(group.state.value)
    assert group.wait_gathered() is full  # no second gather once gathered
    group.release()
    seen.append(group.state.value)
    group.release()  # no-op when released
    seen.append(group.state.value)
    with pytest.raises(AssertionError, match=r"internal error: reading.*'layers.0' in state released"):
        _assert_in(group, "reading the gathered buffers", GroupState.GATHERED)
    idx = torch.randint(0, 64, (2, 8))
    m(idx, idx).backward()  # a step leaves every group released
    seen.append(",".join(sorted({g.state.value for g in (m.layers[0]._bmt_group, m.layers[1]._bmt_group)})))
    return seen


@pytest.mark.parametrize("checkpoint", [True, False])
def test_group_states_follow_gather_and_release(checkpoint: bool) -> None:
    for seen in run_distributed(_transitions_body, 2, checkpoint):
        assert seen == ["released", "gathering", "gathering", "gathered", "released", "released", "released"]
