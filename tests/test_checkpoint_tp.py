"""Sharded checkpoints under tensor parallelism (issue 38): saved at tp2 x dp2 on 4 ranks, resumed at
tp1 x dp4, tp4 x dp1, tp2 x dp2 (4 ranks), tp2 x dp1 and tp1 x dp2 (2 ranks) and at one rank, with
``bmt.save_checkpoint`` and with DCP; read whole into plain PyTorch; corrupt and missing shards named.

What "resumes exactly" means here: after the load, every whole parameter and every optimizer state
tensor (AdamW's exp_avg, exp_avg_sq, step) equals the saved one bit for bit at every layout (checked
through ``state_dict()`` and by saving again at the new layout); continued training is bit-equal to the
uninterrupted run at the saved layout, and at the others within the Contracts' loss tolerance (TP and
ZeRO at another layout sum partial products in another order). Into plain PyTorch the consolidated
state continues like an uninterrupted plain run (losses rtol 1e-5, parameters AdamW's 5e-3).
All ranks see the whole batch (the data-parallel ranks the same), so every layout trains the same model.
"""

from __future__ import annotations

import copy
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import models
import pytest
import torch
from dist_harness import run_distributed
from hypothesis import given, settings
from hypothesis import strategies as st
from parity import ADAMW_REL, LOSS_RTOL, NOISE_GRAD, compare_params
from parity import whole as joined_over_tp
from test_tp_plan import TOY_PLAN
from test_tp_wrap import llama_mha
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

import bmt_wrap as bmt
from bmt_wrap.errors import CheckpointCorruptError, CheckpointError
from bmt_wrap.runtime.tp_marks import tp_slice
from bmt_wrap.save_load import dcp as bmt_dcp
from bmt_wrap.save_load.reshard import Piece, copy_overlaps, overlaps, shared, span, whole

BEFORE, AFTER = 2, 2  # steps before the save, and after it
# (tp, world) of each resume; the save is at (2, 4)
LAYOUTS = [(2, 4), (1, 4), (4, 4), (2, 2), (1, 2), (1, 1)]


# ---- the pure resharding: any (tp, dp) layout into any other ---------------------------------------------------
def _pieces(shape: tuple[int, ...], dim: int | None, tp: int, dp: int, saving: bool, parts: int = 1) -> list[Piece]:
    """Every rank's piece at (tp, dp), rank = dp_rank * tp + tp_rank; ranges cut like ZeRO's (ceil). A
    tensor TP does not split: every TP rank holds the dp range, and only TP rank 0 writes it. ``parts``:
    a strided split (``dim`` holds that many blocks, each cut over TP)."""
    n = math.prod(shape) // (1 if dim is None else tp)
    per = -(-n // dp)
    out = []
    for d in range(dp):
        for t in range(tp):
            a, b = min(d * per, n), min((d + 1) * per, n)
            if dim is not None:
                out.append(Piece(a, b, dim, t, tp, parts))
            else:
                out.append(Piece(a, b) if t == 0 or not saving else Piece(0, 0))
    return out


def _region(full: torch.Tensor, p: Piece) -> torch.Tensor:
    """The TP slice ``p``'s flat range indexes, as the layers cut it (a strided split: ``tp_slice``)."""
    if p.tp_dim is None:
        return full
    return tp_slice(full, p.tp_dim, p.tp_index, p.tp_size, p.tp_parts)


@settings(max_examples=80, deadline=None)
@given(sizes=st.lists(st.integers(1, 3), min_size=1, max_size=3), data=st.data(),
       saved=st.sampled_from([(1, 1), (1, 3), (2, 1), (2, 2), (4, 1)]),
       loaded=st.sampled_from([(1, 1), (1, 4), (2, 3), (4, 1), (2, 1)]))
def test_any_layout_reads_exactly_into_any_other(sizes: list[int], data: st.DataObject, saved: tuple[int, int],
                                                 loaded: tuple[int, int]) -> None:
    dim = data.draw(st.sampled_from([None, *range(len(sizes))]))
    # A strided split (GPT-2's fused q/k/v): the dimension holds 2 or 3 blocks, each cut over TP.
    parts = 1 if dim is None else data.draw(st.sampled_from([1, 2, 3]))
    shape = tuple(4 * s * (parts if d == dim else 1) for d, s in enumerate(sizes))  # every TP size divides
    full = torch.arange(math.prod(shape), dtype=torch.float64).view(shape)
    files = [(p, _region(full, p).reshape(-1)[p.start:p.end])
             for p in _pieces(shape, dim, *saved, saving=True, parts=parts)]
    for theirs, held in files:  # DCP's boxes of the real shape, each contiguous in the piece's data
        for offsets, box, first in theirs.boxes(shape):
            want = full[tuple(slice(o, o + n) for o, n in zip(offsets, box, strict=True))]
            assert torch.equal(held[first:first + math.prod(box)].view(box), want)
    for mine in [*_pieces(shape, dim, *loaded, saving=False, parts=parts), whole(shape)]:
        out = torch.full((mine.numel,), float("nan"), dtype=torch.float64)
        covered = 0
        for theirs, held in files:
            pairs = overlaps(shape, mine, theirs)
            if pairs:
                a, b = span(pairs)
                copy_overlaps(out, held[a:b], a, pairs)
                covered += shared(pairs)
        assert covered == mine.numel
        assert torch.equal(out, _region(full, mine).reshape(-1)[mine.start:mine.end])


# ---- training at a layout --------------------------------------------------------------------------------------
def _setup(name: str):
    """(build, tp_plan, loss(model, batch), batches): the toy GPT (a user plan) or a transformers Llama
    (its own plan) from a small default config."""
    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, models.VOCAB, (2, 8), generator=g) for _ in range(BEFORE + AFTER)]
    if name == "toy":
        return (lambda: models.seeded(lambda: models.ToyGPT(n_layers=2)), TOY_PLAN,
                lambda m, x: m(x[:, :-1], x[:, 1:]), ids)
    if name == "gpt2":  # no plan: MLP pairs derived, the attention's fused q/k/v split strided
        return models.gpt2, None, lambda m, x: m(input_ids=x, labels=x).loss, ids
    return llama_mha, None, lambda m, x: m(input_ids=x, labels=x).loss, ids


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train(model, opt, loss_fn, batches, steps: range, peaks: dict[str, float] | None = None) -> list[float]:
    """Train ``steps``; ``peaks``: record each parameter's largest gradient (a plain model's)."""
    losses = []
    for s in steps:
        loss = loss_fn(model, batches[s])
        loss.backward()
        if peaks is not None:
            for n, p in model.named_parameters():
                peaks[n] = max(peaks.get(n, 0.0), float(p.grad.abs().max()))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _wrapped(name: str, tp: int):
    build, plan, loss_fn, batches = _setup(name)
    model = bmt.BMTrainModelWrapper(build(), tp_size=tp, tp_plan=plan)
    return model, _optimizer(model), loss_fn, batches


def _save(fmt: str, path: str, model, opt) -> None:
    if fmt == "bmt":
        bmt.save_checkpoint(path, model, optimizer=opt, step=BEFORE)
    else:
        bmt_dcp.save_sharded(path, model, opt)


def _load(fmt: str, path: str, model, opt) -> None:
    if fmt == "bmt":
        bmt.load_checkpoint(path, model, optimizer=opt)
    else:
        bmt_dcp.load_sharded(path, model, opt)


def _save_body(name: str, tmp: str) -> list[float]:
    """Train at tp2 x dp2, save in both formats (``{tmp}/bmt/ckpt``, ``{tmp}/dcp/ckpt``), train on."""
    model, opt, loss_fn, batches = _wrapped(name, 2)
    losses = _train(model, opt, loss_fn, batches, range(BEFORE))
    for fmt in ("bmt", "dcp"):
        _save(fmt, f"{tmp}/{fmt}/ckpt", model, opt)
    return losses + _train(model, opt, loss_fn, batches, range(BEFORE, BEFORE + AFTER))


@pytest.fixture(scope="module")
def saved_at_tp2_dp2(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[str, list[list[float]]]]:
    """A model's ``_save_body`` run, once a module for both formats' tests: (its directory, every rank's losses)."""
    runs: dict[str, tuple[str, list[list[float]]]] = {}

    def get(name: str) -> tuple[str, list[list[float]]]:
        if name not in runs:
            tmp = str(tmp_path_factory.mktemp(f"tp2dp2-{name}"))
            runs[name] = tmp, run_distributed(_save_body, 4, name, tmp)
        return runs[name]
    return get


def _resume_body(name: str, fmt: str, tmp: str, tp: int) -> dict:
    model, opt, loss_fn, batches = _wrapped(name, tp)
    _load(fmt, f"{tmp}/ckpt", model, opt)
    whole_params = {k: v.clone() for k, v in model.state_dict().items()}  # TP slices joined: a collective
    again = f"{tmp}/again-tp{tp}-w{bmt.world_size()}"
    _save(fmt, again, model, opt)  # what this layout holds, written back: compared with the original
    losses = _train(model, opt, loss_fn, batches, range(BEFORE, BEFORE + AFTER))
    return {"params": whole_params if bmt.rank() == 0 else None, "again": again, "losses": losses}


# ---- reading a checkpoint whole, in this (plain) process ----------------------------------------------------
def _plain_state(fmt: str, path: str) -> tuple[dict, dict]:
    """(model state dict, AdamW state by parameter name), whole tensors."""
    if fmt == "bmt":
        return bmt.consolidated_state_dict(path), bmt.consolidated_optimizer_state(path)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = Path(path).parent / f"{Path(path).name}.pt"
    dcp_to_torch_save(path, out)
    saved = torch.load(out, weights_only=False)
    return saved["model"], saved["optimizer"]["state"]


def _plain_run(name: str, start: tuple[dict, dict] | None,
               peaks: dict[str, float] | None = None) -> tuple[list[float], torch.nn.Module]:
    """Plain PyTorch in this process: all steps from the start, or the steps after the save from ``start``."""
    build, _, loss_fn, batches = _setup(name)
    model = build()
    opt = _optimizer(model)
    steps = range(BEFORE + AFTER)
    if start is not None:
        params, states = start
        model.load_state_dict(params)
        names = [n for n, _ in model.named_parameters()]
        osd = opt.state_dict()
        # copies: the optimizer steps its state in place
        osd["state"] = {i: copy.deepcopy(states[n]) for i, n in enumerate(names) if n in states}
        opt.load_state_dict(osd)
        steps = range(BEFORE, BEFORE + AFTER)
    return _train(model, opt, loss_fn, batches, steps, peaks), model


def _assert_same_tensors(a: dict, b: dict, what: str) -> None:
    assert set(a) == set(b), f"{what}: keys differ: {set(a) ^ set(b)}"
    for k in a:
        if isinstance(a[k], dict):
            _assert_same_tensors(a[k], b[k], f"{what} {k}")
        elif isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), f"{what}: {k} differs"
        else:
            assert a[k] == b[k], f"{what}: {k} differs"


@pytest.mark.parametrize(("name", "fmt"), [("toy", "bmt"), ("llama", "bmt"), ("toy", "dcp"), ("llama", "dcp")])
def test_tp2_dp2_checkpoint_resumes_exactly_at_every_layout_and_in_plain_pytorch(
        saved_at_tp2_dp2: Callable[[str], tuple[str, list[list[float]]]], name: str, fmt: str) -> None:
    directory, uninterrupted = saved_at_tp2_dp2(name)
    tmp = f"{directory}/{fmt}"
    assert all(r == uninterrupted[0] for r in uninterrupted)
    params, optim = _plain_state(fmt, f"{tmp}/ckpt")

    # Into plain PyTorch: the whole state continues like a plain run that never stopped.
    peaks: dict[str, float] = {}
    plain_losses, plain_model = _plain_run(name, None, peaks)
    torch.testing.assert_close(uninterrupted[0], plain_losses, rtol=LOSS_RTOL, atol=0)
    resumed_losses, resumed_model = _plain_run(name, (params, optim))
    torch.testing.assert_close(resumed_losses, plain_losses[BEFORE:], rtol=LOSS_RTOL, atol=0)
    # An attention key bias's exact gradient is zero: Adam turns its rounding noise into lr-sized steps.
    noise_only = frozenset(n for n, g in peaks.items() if g < NOISE_GRAD)
    compare_params(plain_model, resumed_model, "adamw", "plain PyTorch resumed from the checkpoint", noise_only)

    for tp, world in LAYOUTS:
        results = run_distributed(_resume_body, world, name, fmt, tmp, tp)
        where = f"resumed at tp{tp} x dp{world // tp}"
        _assert_same_tensors(results[0]["params"], params, f"{where}: loaded parameters")
        again_params, again_optim = _plain_state(fmt, results[0]["again"])
        _assert_same_tensors(again_params, params, f"{where}: parameters saved again")
        _assert_same_tensors(again_optim, optim, f"{where}: optimizer state saved again")
        assert all(r["losses"] == results[0]["losses"] for r in results), where
        if (tp, world) == (2, 4):
            assert results[0]["losses"] == uninterrupted[0][BEFORE:], where  # the saved layout: bit-equal
        else:
            torch.testing.assert_close(results[0]["losses"], uninterrupted[0][BEFORE:], rtol=LOSS_RTOL, atol=0,
                                       msg=where)


# ---- GPT-2's strided c_attn: saved at tp2, whole in files, loaded at one rank ---------------------------------
def _gpt2_save_body(tmp: str) -> dict:
    model, opt, loss_fn, batches = _wrapped("gpt2", 2)
    losses = _train(model, opt, loss_fn, batches, range(BEFORE))
    for fmt in ("bmt", "dcp"):
        _save(fmt, f"{tmp}/{fmt}/ckpt", model, opt)
    qkv = model.transformer.h[0].attn.c_attn
    # tests/parity.py joins the TP slices block by block, independently of bmt_wrap's own join
    joined = {n: joined_over_tp(p) for n, p in (("weight", qkv.weight), ("bias", qkv.bias))}
    state = model.state_dict()  # a collective: every rank joins
    # A full optimizer state dict (every tensor whole, the strided c_attn's too) loaded into a fresh optimizer
    # of TP-split parameters: each rank keeps its slice (at dp1, its range is all of it); copies, as a file holds
    full = StateDictOptions(full_state_dict=True)
    whole_state = copy.deepcopy(get_optimizer_state_dict(model, opt, options=full))
    fresh, fresh_opt, _, _ = _wrapped("gpt2", 2)
    fresh.load_state_dict(state)
    set_optimizer_state_dict(fresh, fresh_opt, copy.deepcopy(whole_state), options=full)
    again = copy.deepcopy(get_optimizer_state_dict(fresh, fresh_opt, options=full)["state"])
    after = [_train(m, o, loss_fn, batches, range(BEFORE, BEFORE + AFTER)) for m, o in ((model, opt), (fresh, fresh_opt))]
    return {"losses": losses, "joined": joined, "state": state, "local": list(qkv.weight.shape),
            "full_optim": whole_state["state"], "full_again": again, "after": after}


def test_gpt2_strided_qkv_checkpoint_is_whole_and_loads_at_one_rank(tmp_path: Path) -> None:
    tmp = str(tmp_path)
    saved = run_distributed(_gpt2_save_body, 2, tmp)
    assert saved[0]["local"] == [32, 48]  # this rank's heads of q, k and v
    params, optim = _plain_state("bmt", f"{tmp}/bmt/ckpt")
    dcp_params, dcp_optim = _plain_state("dcp", f"{tmp}/dcp/ckpt")
    _assert_same_tensors(dcp_params, params, "DCP's model state")
    _assert_same_tensors(dcp_optim, optim, "DCP's optimizer state")
    _assert_same_tensors({k: v for k, v in saved[0]["state"].items()}, params, "state_dict()")
    name = "transformer.h.0.attn.c_attn"
    for part, joined in saved[0]["joined"].items():
        assert torch.equal(joined, params[f"{name}.{part}"]), part
    assert params[f"{name}.weight"].shape == (32, 96) and optim[f"{name}.weight"]["exp_avg"].shape == (32, 96)
    # DCP's full optimizer state dict holds the same whole state; loaded into TP-split parameters it reads back
    # whole as it was, and training goes on bit-equal to the optimizer that gave it
    _assert_same_tensors(saved[0]["full_optim"], optim, "get_optimizer_state_dict(full_state_dict=True)")
    _assert_same_tensors(saved[0]["full_again"], optim, "a full optimizer state loaded at tp2, read again")
    assert saved[0]["after"][0] == saved[0]["after"][1]

    # Plain PyTorch trained the same steps holds the same whole c_attn (a wrong join would differ by O(1)).
    plain = _plain_run("gpt2", None)
    torch.testing.assert_close(saved[0]["losses"], plain[0][:BEFORE], rtol=LOSS_RTOL, atol=0)
    build, _, loss_fn, batches = _setup("gpt2")
    before = build()
    _train(before, _optimizer(before), loss_fn, batches, range(BEFORE))
    for part in ("weight", "bias"):
        ref = before.state_dict()[f"{name}.{part}"]
        rel = float((params[f"{name}.{part}"] - ref).norm() / ref.norm())
        assert rel <= ADAMW_REL, (part, rel)
    # Into plain PyTorch: the whole state continues like the plain run that never stopped.
    resumed, _ = _plain_run("gpt2", (params, optim))
    torch.testing.assert_close(resumed, plain[0][BEFORE:], rtol=LOSS_RTOL, atol=0)

    # At one rank (no TP) the strided pieces read into whole tensors, and at tp2 back into strided slices,
    # bit for bit, with either format.
    for fmt in ("bmt", "dcp"):
        for tp, world in ((1, 1), (2, 2)):
            where = f"{fmt} loaded at tp{tp} x dp{world // tp}"
            results = run_distributed(_resume_body, world, "gpt2", fmt, f"{tmp}/{fmt}", tp)
            _assert_same_tensors(results[0]["params"], params, where)
            again_params, again_optim = _plain_state(fmt, results[0]["again"])
            _assert_same_tensors(again_params, params, f"{where}, saved again")
            _assert_same_tensors(again_optim, optim, f"{where}, optimizer state saved again")
            torch.testing.assert_close(results[0]["losses"], plain[0][BEFORE:], rtol=LOSS_RTOL, atol=0, msg=where)


# ---- broken checkpoints: a named error on every rank ----------------------------------------------------------
def _broken_body(fmt: str, path: str, tp: int) -> str:
    model, opt, _, _ = _wrapped("toy", tp)
    with pytest.raises(CheckpointError) as info:
        _load(fmt, path, model, opt)
    return f"{type(info.value).__name__}: {info.value}"


def _save_only_body(fmt: str, tmp: str) -> None:
    model, opt, loss_fn, batches = _wrapped("toy", 2)
    _train(model, opt, loss_fn, batches, range(1))
    _save(fmt, f"{tmp}/ckpt", model, opt)


@pytest.mark.parametrize("fmt", ["bmt", "dcp"])
def test_a_corrupt_or_missing_shard_is_named_on_every_rank(tmp_path: Path, fmt: str) -> None:
    run_distributed(_save_only_body, 4, fmt, str(tmp_path))
    shards = sorted((tmp_path / "ckpt").glob("shard-*" if fmt == "bmt" else "*.distcp"))
    assert len(shards) == 4

    corrupt = tmp_path / "corrupt"
    shutil.copytree(tmp_path / "ckpt", corrupt)
    victim = corrupt / shards[3].name
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF  # a flipped byte inside the tensor data: the size is right
    victim.write_bytes(bytes(data))
    for tp, world in ((2, 4), (1, 2)):
        messages = run_distributed(_broken_body, world, fmt, str(corrupt), tp)
        assert len(messages) == world and all(m.startswith(f"{CheckpointCorruptError.__name__}: ") and
                                              victim.name in m for m in messages), messages

    missing = tmp_path / "missing"
    shutil.copytree(tmp_path / "ckpt", missing)
    (missing / shards[1].name).unlink()
    messages = run_distributed(_broken_body, 4, fmt, str(missing), 4)
    assert all(m.startswith(f"{CheckpointError.__name__}: ") and shards[1].name in m for m in messages), messages
    if fmt == "bmt":  # read whole in one process, the same checks
        with pytest.raises(CheckpointError, match=shards[1].name):
            bmt.consolidated_state_dict(missing)
        with pytest.raises(CheckpointCorruptError, match=victim.name):
            bmt.consolidated_state_dict(corrupt)


# ---- the explicit API: BMTrain's TP layers, AdamOptimizer and OptimManager ----------------------------------
def _explicit(tp: int):
    from dist_harness import COMM_TIMEOUT
    from test_tp_parity import TPGPT

    bmt.init_distributed(seed=0, backend="gloo", timeout=COMM_TIMEOUT, tp_size=tp)
    torch.manual_seed(0)
    model = TPGPT()  # VPEmbedding, Column/RowParallelLinear (a row-parallel bias is whole on every TP rank)
    manager = bmt.optim.OptimManager()
    manager.add_optimizer(bmt.optim.AdamOptimizer(model.parameters(), lr=1e-2, weight_decay=0.01))
    return model, manager


def _explicit_save_body(tmp: str) -> None:
    from test_tp_parity import _batches

    model, manager = _explicit(2)
    tokens, targets = _batches()[0]
    manager.backward(model(tokens, targets))
    manager.step()
    bmt.save_checkpoint(f"{tmp}/ckpt", model, optim_manager=manager, step=1)


def _explicit_resume_body(tmp: str, tp: int) -> str:
    model, manager = _explicit(tp)
    bmt.load_checkpoint(f"{tmp}/ckpt", model, optim_manager=manager)
    again = f"{tmp}/again-tp{tp}-w{bmt.world_size()}"
    bmt.save_checkpoint(again, model, optim_manager=manager, step=1)
    return again


def test_explicit_tp_layers_and_adam_state_reshard_exactly(tmp_path: Path) -> None:
    run_distributed(_explicit_save_body, 4, str(tmp_path))
    params, optim = bmt.consolidated_state_dict(tmp_path / "ckpt"), bmt.consolidated_optimizer_state(tmp_path / "ckpt")
    assert {k for st in optim.values() for k in st} >= {"exp_avg", "exp_avg_sq"}
    for tp, world in ((4, 4), (1, 2), (1, 1)):
        again = run_distributed(_explicit_resume_body, world, str(tmp_path), tp)[0]
        where = f"explicit API at tp{tp} x dp{world // tp}"
        _assert_same_tensors(bmt.consolidated_state_dict(again), params, f"{where}: parameters")
        _assert_same_tensors(bmt.consolidated_optimizer_state(again), optim, f"{where}: optimizer state")


# ---- DCP's full (gathered) state dict under TP -------------------------------------------------------------
def _full_state_body(tmp: str) -> dict | None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model, opt, loss_fn, batches = _wrapped("toy", 2)
    _train(model, opt, loss_fn, batches, range(1))
    bmt.save_checkpoint(f"{tmp}/ckpt", model, optimizer=opt, step=1)
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {"model": msd, "optim": osd["state"]} if bmt.rank() == 0 else None


def test_dcp_full_state_dict_under_tp_holds_whole_tensors(tmp_path: Path) -> None:
    got = run_distributed(_full_state_body, 2, str(tmp_path))[0]
    _assert_same_tensors(got["model"], bmt.consolidated_state_dict(tmp_path / "ckpt"), "full model state dict")
    _assert_same_tensors(got["optim"], bmt.consolidated_optimizer_state(tmp_path / "ckpt"), "full optimizer state")
