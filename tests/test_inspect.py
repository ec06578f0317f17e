"""bmt.inspect.inspect_model and bmt.see_memory: statistics of sharded models equal the unsharded model's."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from dist_harness import run_distributed
from torch import nn
from toy import Layer, ToyGPT

import bmt_wrap as bmt
from bmt_wrap.inspect import format_summary, inspect_model, memory_stats

STATS = ("mean", "std", "min", "max")


def _expected(p: torch.Tensor | None) -> dict[str, float] | None:
    if p is None:
        return None
    x = p.detach().double()
    return {"mean": float(x.mean()), "std": float(x.std()), "min": float(x.min()), "max": float(x.max())}


def _assert_rows_match(rows: list[dict], ref: nn.Module) -> None:
    params = dict(ref.named_parameters())
    assert [r["name"] for r in rows] == list(params)
    for row in rows:
        p = params[row["name"]]
        assert row["shape"] == tuple(p.shape), row["name"]
        want, want_grad = _expected(p), _expected(p.grad)
        for k in STATS:
            assert math.isclose(row[k], want[k], rel_tol=1e-5, abs_tol=1e-7), (row["name"], k, row[k], want[k])
            if want_grad is None:
                assert row[f"grad_{k}"] is None, (row["name"], k)
            else:
                assert math.isclose(row[f"grad_{k}"], want_grad[k], rel_tol=1e-4, abs_tol=1e-7), \
                    (row["name"], f"grad_{k}", row[f"grad_{k}"], want_grad[k])


def _wrapped_body() -> dict:
    torch.manual_seed(0)
    ref = ToyGPT(n_layers=3, tied=True)
    ref.layers[1].fc.bias.requires_grad_(False)  # a parameter with no gradient reports grad_* = None
    model = bmt.BMTrainModelWrapper(copy.deepcopy(ref))
    g = torch.Generator().manual_seed(1)
    idx, tgt = torch.randint(0, 64, (4, 8), generator=g), torch.randint(0, 64, (4, 8), generator=g)
    before = inspect_model(model)
    _assert_rows_match(before, ref)  # no gradients yet: grad_* are None everywhere
    ref(idx, tgt).backward()
    n, r = bmt.world_size(), bmt.rank()
    model(idx.chunk(n)[r], tgt.chunk(n)[r]).backward()
    rows = inspect_model(model)
    _assert_rows_match(rows, ref)
    norms = inspect_model(model, "*ln*")
    assert norms and all("ln" in row["name"] for row in norms)
    return {"rows": rows, "table": format_summary(rows)}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_wrapped_model_stats_equal_the_unwrapped_models(world_size: int) -> None:
    results = run_distributed(_wrapped_body, world_size)
    assert all(r["rows"] == results[0]["rows"] for r in results), "every rank returns the same summary"
    table = results[0]["table"].splitlines()
    assert table[0].split() == ["name", "shape", "max", "min", "std", "mean", "grad_std", "grad_mean"]  # BMTrain's
    bias = next(line.split() for line in table if line.split()[0] == "layers.1.fc.bias")
    assert bias[-2:] == ["0.0000", "0.0000"], "no gradient prints as zeros, as in BMTrain"


class _Explicit(bmt.DistributedModule):
    """BMTrain style: a bare DistributedParameter, two CheckpointBlocks and a frozen replicated parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = bmt.DistributedParameter(torch.randn(64, 16) * 0.02)
        self.blocks = bmt.TransformerBlockList([bmt.CheckpointBlock(Layer(16)) for _ in range(2)])
        self.temperature = nn.Parameter(torch.full((3,), 2.0), requires_grad=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.embedding(idx, self.emb))
        return (x @ self.emb.t()).float().pow(2).mean() / self.temperature.mean()


def _explicit_body() -> list[dict]:
    torch.manual_seed(0)
    model = _Explicit()
    with bmt.gathered(model):
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
    rows = inspect_model(model)
    assert [r["name"] for r in rows] == list(full)
    for row in rows:
        want = _expected(full[row["name"]])
        for k in STATS:
            assert math.isclose(row[k], want[k], rel_tol=1e-5, abs_tol=1e-7), (row["name"], k)
    temperature = next(r for r in rows if r["name"] == "temperature")
    assert temperature["mean"] == 2.0 and temperature["std"] == 0.0, "a replicated parameter is counted once"
    return rows


def test_explicit_api_stats_at_two_ranks() -> None:
    run_distributed(_explicit_body, 2)


def _memory_body() -> tuple[list[dict], dict]:
    table = bmt.see_memory("after allocating")
    return table, memory_stats()


def test_see_memory_reports_every_rank() -> None:
    results = run_distributed(_memory_body, 2)
    assert results[0][0] == results[1][0], "every rank gets the whole table"
    rows = results[0][0]
    assert [r["rank"] for r in rows] == [0, 1] and all(r["kind"] == "rss" for r in rows)
    for row, (_, own) in zip(rows, results, strict=True):
        assert 0 < row["current"] <= row["peak"]
        assert abs(row["current"] - own["current"]) < 0.05 * own["current"], "each row is that rank's own RSS"


def test_inspect_needs_no_initialisation_in_one_process() -> None:
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    model(torch.randn(4, 5)).sum().backward()
    _assert_rows_match(inspect_model(model), model)
