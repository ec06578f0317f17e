"""Property tests over random block structures, dtypes and world sizes: sharding then gathering is the
identity, padding and alignment gaps never carry gradient, and the global gradient norm over shards is
the unsharded model's."""

from __future__ import annotations

import math

import torch
from dist_harness import run_distributed
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from toy import manual_plan

import bmt_wrap as bmt
from bmt_wrap.apply_plan import apply_plan
from bmt_wrap.gathered import sharded_groups


class Stack(nn.Module):
    """Input projection, blocks of random widths (each a small MLP), output head."""

    def __init__(self, d: int, widths: list[int], dtype: torch.dtype) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d, dtype=dtype)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, w, dtype=dtype), nn.Tanh(), nn.Linear(w, d, dtype=dtype))
                                    for w in widths)
        self.head = nn.Linear(d, 3, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = x + b(x)
        return self.head(x).float().pow(2).mean()


def _body(d: int, widths: list[int], dtype_name: str, checkpoint: bool) -> dict:
    dtype = getattr(torch, dtype_name)
    n, r = bmt.world_size(), bmt.rank()
    torch.manual_seed(len(widths) * 1000 + d)
    ref = Stack(d, widths, dtype)
    model = Stack(d, widths, dtype)
    model.load_state_dict(ref.state_dict())
    model = apply_plan(model, manual_plan(model, [f"blocks.{i}" for i in range(len(widths))], checkpoint=checkpoint))

    # gather(shard(x)) == x, exactly, for every parameter
    full = model.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(full[k], v), k

    x = torch.randn(2 * n, d, dtype=dtype)
    ref(x).backward()
    model(x.chunk(n)[r]).backward()

    # padding and alignment gaps of every gradient shard are exactly zero
    sq = torch.zeros(1, dtype=torch.float64)
    for group in sharded_groups(model):
        for buf in group.buffers:
            grad = buf.grad_shard
            if grad is None:
                continue
            covered = torch.zeros(buf.shard_numel, dtype=torch.bool)
            for a, b in buf.local_ranges:
                covered[a:b] = True
            assert torch.all(grad[~covered] == 0), f"{group.name}: gradient leaked into padding"
            sq += grad.double().pow(2).sum()
    bmt.get_state().comm.all_reduce(sq)
    ref_sq = sum(p.grad.double().pow(2).sum() for p in ref.parameters())
    # the reference sums the per-rank mean losses' gradients once; shards hold the rank average
    return {"norm": math.sqrt(float(sq)), "ref_norm": math.sqrt(float(ref_sq))}


@settings(max_examples=12)
@given(d=st.sampled_from([4, 8, 24]), widths=st.lists(st.integers(1, 40), min_size=1, max_size=4),
       dtype=st.sampled_from(["float32", "bfloat16"]), world_size=st.sampled_from([1, 2, 4]),
       checkpoint=st.booleans())
def test_random_structures(d: int, widths: list[int], dtype: str, world_size: int, checkpoint: bool) -> None:
    result = run_distributed(_body, world_size, d, widths, dtype, checkpoint)[0]
    rtol = 1e-5 if dtype == "float32" else 2e-2
    assert math.isclose(result["norm"], result["ref_norm"], rel_tol=rtol, abs_tol=1e-6), result
