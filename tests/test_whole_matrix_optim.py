"""Optimizers that need whole matrices (torch's Muon and Adafactor, a hand-written Muon) on sharded
parameters, against the same optimizer on the plain model (issue 29).

The models are small on purpose; at every world size some matrix straddles a rank boundary and at 3 and 4
ranks some rank holds an empty range of some parameter (each test checks its layout says so).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_harness import run_distributed
from parity import compare_params, lm_batches, wholes
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from toy import ToyGPT

import bmt_wrap as bmt
from bmt_wrap.base._compat import muon_orthogonalize
from bmt_wrap.runtime.sharded_tensor import ShardedTensor

WORLD_SIZES = [1, 2, 3, 4]


class _Cube(nn.Module):
    """A block with a matrix, a bias and a 3-D parameter (Adafactor factors its last two dimensions)."""

    def __init__(self, d: int = 12) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 2 * d)
        self.cube = nn.Parameter(torch.randn(3, 2 * d, d) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        return x + torch.einsum("bk,jkd->bd", h, self.cube) / 3


class _CubeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Cube() for _ in range(2))
        self.head = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _layout_facts(model: nn.Module) -> dict[str, bool]:
    """Whether some parameter straddles ranks and some rank holds none of some parameter."""
    n = bmt.world_size()
    straddles = empty = False
    for p in model.parameters():
        if isinstance(p, ShardedTensor):
            holders = [r for r in range(n) if p.source_range(r)[1] > p.source_range(r)[0]]
            straddles |= len(holders) > 1
            empty |= len(holders) < n
    return {"straddles": straddles, "empty": empty}


def _whole_params(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter's name and whole value (one gather for them all)."""
    named = list(model.named_parameters())
    return [(name, value) for (name, _), value in zip(named, wholes([(p, p) for _, p in named]), strict=True)]


def _same_grads(ref: nn.Module, model: nn.Module, step: int) -> None:
    """The same full gradient for each parameter of both models (this rank's range for the sharded one)."""
    g = torch.Generator().manual_seed(100 + step)
    params = dict(model.named_parameters())
    for name, rp in ref.named_parameters():
        full = torch.randn(rp.shape, generator=g)
        rp.grad = full.clone()
        p = params[name]
        if isinstance(p, ShardedTensor):
            p.grad = ShardedTensor.wrap(p.shard_layout.local_of_full(full).clone(), p.shard_layout)
        elif p is not rp:
            p.grad = full.clone()


def _muon_same_grads_body(make: str, nesterov: bool, weight_decay: float, adjust: str | None) -> dict:
    torch.manual_seed(0)
    ref = ToyGPT(vocab=40, d=12, n_layers=2)
    model = bmt.BMTrainModelWrapper(copy.deepcopy(ref))
    cls = {"torch": torch.optim.Muon, "bmt": bmt.optim.Muon}[make]
    kw = {"lr": 0.05, "nesterov": nesterov, "weight_decay": weight_decay, "adjust_lr_fn": adjust}
    ref_opt = torch.optim.Muon([p for p in ref.parameters() if p.ndim == 2], **kw)
    opt = cls([p for p in model.parameters() if p.ndim == 2], **kw)
    bmt.reset_comm_stats()
    for step in range(3):
        _same_grads(ref, model, step)
        ref_opt.step()
        opt.step()
    assert all(p.grad is not None for p in model.parameters()), "the fast path gives the gradients back"
    ref_params = dict(ref.named_parameters())
    for name, value in _whole_params(model):
        assert torch.equal(value, ref_params[name].detach()), f"{name} differs from torch's Muon"
    stats = bmt.comm_stats()
    plan = bmt.optim.muon_plan(opt)
    size = sum(p.numel() * p.element_size() for p in model.parameters() if p.ndim == 2)
    moved = stats.get("reduce_scatter", {}).get("bytes", 0)
    return _layout_facts(model) | {
        "materialized": stats.get("materialize", {}).get("calls", 0), "moved": moved,
        "planned": 3 * (plan.bytes_per_rank() if plan is not None else 0),
        "bound": 3 * 4 * size / bmt.world_size()}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize(("make", "nesterov", "weight_decay", "adjust"), [
    ("torch", True, 0.1, None), ("torch", False, 0.0, "match_rms_adamw"), ("bmt", True, 0.1, "original")])
def test_muon_on_sharded_parameters_equals_torchs_muon(world_size: int, make: str, nesterov: bool,
                                                      weight_decay: float, adjust: str | None) -> None:
    results = run_distributed(_muon_same_grads_body, world_size, make, nesterov, weight_decay, adjust)
    for r in results:
        assert r["materialized"] == 0, "the fast path gathers nothing whole"
        assert r["moved"] == r["planned"] <= r["bound"]
    if world_size > 1:
        assert results[0]["straddles"] and results[0]["moved"] > 0
    if world_size > 2:
        assert results[0]["empty"]


def _muon_training_body(world_size_check: int) -> dict:
    torch.manual_seed(0)
    ref = ToyGPT(vocab=40, d=12, n_layers=2)
    model = bmt.BMTrainModelWrapper(copy.deepcopy(ref))
    opts = []
    for m in (ref, model):
        matrices = [p for p in m.parameters() if p.ndim == 2]
        others = [p for p in m.parameters() if p.ndim != 2]
        opts.append((torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(others, lr=1e-3)))
    n, r = bmt.world_size(), bmt.rank()
    losses, ref_losses = [], []
    for x, y in lm_batches(4, 4, vocab=40):
        ref_losses.append(float(ref(x, y)))
        ref(x, y).backward()
        loss = model(x.chunk(n)[r], y.chunk(n)[r])
        loss.backward()
        losses.append(float(bmt.sum_loss(loss.detach())))
        for o in (*opts[0], *opts[1]):
            o.step()
            o.zero_grad()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    compare_params(ref, model, "adamw", "after Muon training")
    return {"steps": len(losses), "world_size": world_size_check}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_torch_muon_trains_a_wrapped_model_like_plain_pytorch(world_size: int) -> None:
    results = run_distributed(_muon_training_body, world_size, world_size)
    assert [r["steps"] for r in results] == [4] * world_size


def _hand_muon_step(params: list[torch.Tensor], bufs: list[torch.Tensor], lr: float) -> None:
    """A Muon written the way scripts write it: X.mT, @, norm(dim=(-2, -1)) and reshape(p.shape)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    for p, buf in zip(params, bufs, strict=True):
        buf.mul_(0.9).add_(p.grad)
        x = buf.float()
        x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
        tall = x.shape[-2] > x.shape[-1]
        if tall:
            x = x.mT
        for _ in range(5):
            gram = x @ x.mT
            x = a * x + (b * gram + c * gram @ gram) @ x
        if tall:
            x = x.mT
        p.add_(x.reshape(p.shape), alpha=-lr)


def _hand_muon_body() -> dict:
    torch.manual_seed(0)
    ref = ToyGPT(vocab=40, d=12, n_layers=2)
    model = bmt.BMTrainModelWrapper(copy.deepcopy(ref))
    sides = []
    for m in (ref, model):
        params = [p for name, p in m.named_parameters() if p.ndim == 2 and name.startswith("layers.")]
        sides.append((params, [torch.zeros_like(p) for p in params]))
    n, r = bmt.world_size(), bmt.rank()
    bmt.reset_comm_stats()
    first = last = 0.0
    for step, (x, y) in enumerate(lm_batches(3, 12, vocab=40, seed=3)):
        ref(x, y).backward()
        loss = model(x.chunk(n)[r], y.chunk(n)[r])
        loss.backward()
        value = float(bmt.sum_loss(loss.detach()))
        first, last = (value, last) if step == 0 else (first, value)
        with torch.no_grad():
            for params, bufs in sides:
                _hand_muon_step(params, bufs, 0.02)
        for m in (ref, model):
            m.zero_grad()
    compare_params(ref, model, "adamw", "after hand-written Muon")
    return {"first": first, "last": last, "materialized": bmt.comm_stats()["materialize"]["calls"]}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_hand_written_muon_trains_through_materialised_ops(world_size: int) -> None:
    for r in run_distributed(_hand_muon_body, world_size):
        assert r["last"] < r["first"]
        assert r["materialized"] > 0


def test_newton_schulz_on_a_local_range_would_miss_the_tolerance() -> None:
    """Why the whole matrix must meet: orthogonalising the rows one rank holds is not those rows of the
    orthogonalised whole."""
    g = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    whole_rows = muon_orthogonalize(g, (3.4445, -4.7750, 2.0315), 5, 1e-7)[:6].float()
    local_rows = muon_orthogonalize(g[:6], (3.4445, -4.7750, 2.0315), 5, 1e-7).float()
    with pytest.raises(AssertionError):
        torch.testing.assert_close(local_rows, whole_rows, rtol=1e-5, atol=1e-6)
    assert float((local_rows - whole_rows).norm() / whole_rows.norm()) > 5e-3  # beyond even AdamW's tolerance


def _adafactor_body(foreach: bool, closure: bool) -> dict:
    torch.manual_seed(0)
    ref = _CubeNet()
    model = bmt.BMTrainModelWrapper(copy.deepcopy(ref))
    ref_opt = torch.optim.Adafactor(ref.parameters(), lr=0.01, weight_decay=0.01, foreach=foreach)
    opt = torch.optim.Adafactor(model.parameters(), lr=0.01, weight_decay=0.01, foreach=foreach)
    bmt.reset_comm_stats()
    for step in range(3):
        _same_grads(ref, model, step)
        ref_opt.step()
        opt.step((lambda: None) if closure else None)  # a closure keeps torch's step: it materialises
    stats = bmt.comm_stats()
    if not closure and bmt.world_size() > 1:
        assert "materialize" not in stats and "all_gather" not in stats, ("no gather", stats)
    ref_params = dict(ref.named_parameters())
    dims = {p.ndim for p in model.parameters()}
    for name, value in _whole_params(model):
        torch.testing.assert_close(value, ref_params[name].detach(), rtol=1e-5, atol=1e-6, msg=name)
    factored = [s for s in opt.state.values() if "row_var" in s]
    assert factored and all(type(s["row_var"]) is torch.Tensor for s in factored), "factors are plain"
    return _layout_facts(model) | {"dims": sorted(dims)}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize(("foreach", "closure"), [(False, False), (True, False), (True, True)])
def test_adafactor_on_sharded_parameters_matches_torch(world_size: int, foreach: bool, closure: bool) -> None:
    results = run_distributed(_adafactor_body, world_size, foreach, closure)
    assert results[0]["dims"] == [1, 2, 3]
    if world_size > 1:
        assert results[0]["straddles"]
    if world_size > 2:
        assert results[0]["empty"]


# ---- gradient accumulation, no_sync, checkpoints at another world size (issue 29 item 3) ---------------
def _accumulate_body() -> dict:
    torch.manual_seed(0)
    ref = ToyGPT(vocab=40, d=12, n_layers=2)
    model = bmt.BMTrainModelWrapper(copy.deepcopy(ref))
    matrices = [[p for p in m.parameters() if p.ndim == 2] for m in (ref, model)]
    ref_opt, opt = (torch.optim.Muon(ps, lr=0.02) for ps in matrices)
    n, r = bmt.world_size(), bmt.rank()
    muon_ops = []
    for x, y in lm_batches(3, 4 * n, vocab=40):
        for half, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2), strict=True)):
            (ref(xm, ym) / 2).backward()
            with model.no_sync() if half == 0 else contextlib.nullcontext():
                (model(xm.chunk(n)[r], ym.chunk(n)[r]) / 2).backward()
        ref_opt.step()
        with bmt.get_state().comm.trace() as ops:
            opt.step()
        muon_ops.append(sum(label.startswith("muon") for _, label, _ in ops))
        ref_opt.zero_grad()
        opt.zero_grad()
    compare_params(ref, model, "adamw", "after accumulated Muon steps")
    return {"muon_collectives_per_step": muon_ops}


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_muon_after_no_sync_accumulation_orthogonalises_once_per_step(world_size: int) -> None:
    for r in run_distributed(_accumulate_body, world_size):
        assert r["muon_collectives_per_step"] == [2 if world_size > 1 else 0] * 3, "there and back, once"


def _build_for(kind: str) -> tuple[nn.Module, nn.Module, Callable[[nn.Module], torch.optim.Optimizer]]:
    torch.manual_seed(0)
    ref = ToyGPT(vocab=40, d=12, n_layers=2) if kind == "muon" else _CubeNet()
    if kind == "muon":
        def make(m: nn.Module) -> torch.optim.Optimizer:
            return torch.optim.Muon([p for p in m.parameters() if p.ndim == 2], lr=0.05, weight_decay=0.1)
    else:
        def make(m: nn.Module) -> torch.optim.Optimizer:
            return torch.optim.Adafactor(m.parameters(), lr=0.01, weight_decay=0.01)
    torch.manual_seed(1234 + bmt.world_size())  # the wrapped side's values must come from the checkpoint
    fresh = type(ref)() if kind == "adafactor" else ToyGPT(vocab=40, d=12, n_layers=2)
    return ref, fresh, make


def _train(ref: nn.Module, model: nn.Module, opts: tuple, steps: range) -> None:
    for step in steps:
        _same_grads(ref, model, step)
        for o in opts:
            o.step()


def _ckpt_save_body(tmp: str, kind: str) -> None:
    ref, _, make = _build_for(kind)
    model = bmt.BMTrainModelWrapper(copy.deepcopy(ref))
    ref_opt, opt = make(ref), make(model)
    _train(ref, model, (ref_opt, opt), range(2))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp)


def _ckpt_load_body(tmp: str, kind: str) -> dict:
    ref, fresh, make = _build_for(kind)
    model = bmt.BMTrainModelWrapper(fresh)
    ref_opt, opt = make(ref), make(model)
    _train(ref, ref, (ref_opt,), range(2))
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=tmp)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _train(ref, model, (ref_opt, opt), range(2, 4))
    ref_params = dict(ref.named_parameters())
    for name, value in _whole_params(model):
        if kind == "muon":
            assert torch.equal(value, ref_params[name].detach()), name
        else:
            torch.testing.assert_close(value, ref_params[name].detach(), rtol=1e-5, atol=1e-6, msg=name)
    return _layout_facts(model)


@pytest.mark.parametrize("kind", ["muon", "adafactor"])
def test_checkpoints_of_muon_and_adafactor_resume_at_another_world_size(tmp_path: Path, kind: str) -> None:
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_ckpt_save_body, 2, ckpt, kind)
    for world in (1, 3):
        run_distributed(_ckpt_load_body, world, ckpt, kind)
