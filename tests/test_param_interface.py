"""The public face of a sharded parameter: its group, its slot, the part of the full tensor this rank
holds, loading a full value, reading it back. Every layer above the runtime goes through these; the
private attributes behind them stay in runtime/ (checked by grep)."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from dist_harness import run_distributed

PACKAGE = Path(__file__).resolve().parent.parent / "bmt_wrap"
OWNERS = {"runtime/param.py", "runtime/sharded_tensor.py"}  # where the attributes are made and kept


def _interface_body() -> dict:
    import bmt_wrap as bmt
    from bmt_wrap.runtime.standalone import full_value

    full = torch.arange(10 * 7, dtype=torch.float32).reshape(10, 7)
    p = bmt.DistributedParameter(full.clone())
    start, end = p.source_range()
    assert p.shape == full.shape and torch.equal(p.to_local(), full.reshape(-1)[start:end])
    assert torch.equal(p.full_tensor(), full)
    assert p.slot_spec.shape == [10, 7] and p.shard_group.buffers[p.shard_group.buffers.index(p.flat_buffer)] \
        is p.flat_buffer and p.slot_index == 0
    p.load_full(full * 2)
    assert torch.equal(full_value(p), full * 2)
    view = p.gathered_view(p.shard_group.gather_values())
    assert torch.equal(view, full * 2) and view.shape == (10, 7)
    return {"range": [start, end]}


def test_each_rank_holds_its_part_and_full_values_round_trip() -> None:
    ranges = sorted(r["range"] for r in run_distributed(_interface_body, 2))
    assert ranges[0][0] == 0 and ranges[0][1] == ranges[1][0] and ranges[1][1] == 70, ranges


def test_private_parameter_attributes_stay_in_the_runtime() -> None:
    readers = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                     if str(p.relative_to(PACKAGE)) not in OWNERS
                     and re.search(r"\._(local|layout)\b", p.read_text()))
    assert not readers, f"use DistributedParameter's public interface instead: {readers}"
