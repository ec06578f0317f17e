"""Sharded checkpoints of expert-parallel models (#51): transformers Mixtral (4 packed experts a layer, top-2,
labels, ``output_router_logits=True``) and an LM whose experts are a ModuleList of MLPs (4 a layer, each EP rank
holding its own under their names) saved with ``bmt.save_checkpoint`` and with DCP at ep2 (2 ranks) and at
ep4 (4 ranks); both resumed at ep2 x dp2 (4 ranks), the ep2 one also at one rank (no EP) and at its saved
layout; both read whole into plain PyTorch. The ModuleList LM is also saved at ep2 with tp2 (TP splits its
embedding and head; 4 ranks) and resumed at ep2 x dp2, and its ep4 save is resumed at ep2 with tp2.

As in tests/test_checkpoint_tp.py, "resumes exactly" means: after the load every whole parameter and every
AdamW state tensor equals the saved one bit for bit at every layout (through ``state_dict()`` and by saving
again at the new layout); continued training is bit-equal to the uninterrupted run at the saved layout and
within the Contracts' tolerances at the others (the experts' rows are summed in another order there). Every
rank trains on the whole batch, so every layout trains the same model.
"""

from __future__ import annotations

import copy
import gc

import models
import pytest
import torch
from dist_harness import run_distributed
from parity import ADAMW_REL, LOSS_RTOL
from test_checkpoint_tp import _assert_same_tensors, _plain_state

import bmt_wrap as bmt
from bmt_wrap.save_load import dcp as bmt_dcp

BEFORE, AFTER = 2, 2  # steps before the save, and after it
FORMATS = ("bmt", "dcp")
LOSSES = {"mixtral": lambda m, ids: m(input_ids=ids, labels=ids, output_router_logits=True).loss,
          "list_moe": lambda m, ids: m(ids, ids)}  # packed experts, and a ModuleList of expert MLPs
# The attention-free ModuleList LM has no TP plan of its own: TP splits its embedding's rows and head's columns.
TP_PLAN = {"embed": "embedding_rowwise", "head": "colwise_gather_output"}


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, models.VOCAB, (2, 8), generator=g) for _ in range(BEFORE + AFTER)]


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train(kind: str, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    losses, batches = [], _batches()
    for s in steps:
        loss = LOSSES[kind](model, batches[s])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _wrapped(kind: str, ep: int, tp: int = 1) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = bmt.BMTrainModelWrapper(getattr(models, kind)(), ep_size=ep,
                                    **({"tp_size": tp, "tp_plan": TP_PLAN} if tp > 1 else {}))
    return model, _optimizer(model)


def _label(ep: int, tp: int) -> str:
    """A saved layout's directory name: ``ep2``, ``ep2tp2``."""
    return f"ep{ep}" + (f"tp{tp}" if tp > 1 else "")


def _save(fmt: str, path: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    if fmt == "bmt":
        bmt.save_checkpoint(path, model, optimizer=opt, step=BEFORE)
    else:
        bmt_dcp.save_sharded(path, model, opt)


def _load(fmt: str, path: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    if fmt == "bmt":
        bmt.load_checkpoint(path, model, optimizer=opt)
    else:
        bmt_dcp.load_sharded(path, model, opt)


def _resume(kind: str, fmt: str, path: str, ep: int, tp: int = 1) -> dict:
    """Load ``path`` at ``ep_size=ep`` (and ``tp_size=tp``) on this group, save it again beside it, train on."""
    gc.collect()  # the models before go first: one of another layout may not be wrapped beside them
    model, opt = _wrapped(kind, ep, tp)
    _load(fmt, path, model, opt)
    params = {k: v.clone() for k, v in model.state_dict().items()}  # whole experts: a collective
    again = f"{path}-again-{_label(ep, tp)}-w{bmt.world_size()}"
    _save(fmt, again, model, opt)
    losses = _train(kind, model, opt, range(BEFORE, BEFORE + AFTER))
    final = model.state_dict()
    return {"params": params if bmt.rank() == 0 else None, "again": again, "losses": losses,
            "final": final if bmt.rank() == 0 else None}


def _resume_body(kind: str, fmt: str, path: str, ep: int) -> dict:
    return _resume(kind, fmt, path, ep)


def _save_body(kind: str, tmp: str, saves: list[tuple[int, int]], resumes: list[tuple[str, int, int]]) -> dict:
    """For each of ``saves`` ((ep_size, tp_size)): train, save in both formats (``{tmp}/{kind}/{label}-{fmt}``),
    train on; then each of ``resumes`` ((saved label, ep_size, tp_size)) in both formats."""
    runs = {}
    for ep, tp in saves:
        model, opt = _wrapped(kind, ep, tp)
        losses = _train(kind, model, opt, range(BEFORE))
        for fmt in FORMATS:
            _save(fmt, f"{tmp}/{kind}/{_label(ep, tp)}-{fmt}", model, opt)
        losses += _train(kind, model, opt, range(BEFORE, BEFORE + AFTER))
        final = model.state_dict()
        runs[_label(ep, tp)] = {"losses": losses, "final": final if bmt.rank() == 0 else None,
                                "world": bmt.world_size()}
        del model, opt
        gc.collect()  # the saved layout's model goes before one of another layout is wrapped
    resumed = {(path, fmt, ep, tp, bmt.world_size()): _resume(kind, fmt, f"{tmp}/{kind}/{path}-{fmt}", ep, tp)
               for path, ep, tp in resumes for fmt in FORMATS}
    return {"runs": runs, "resumed": resumed}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict, dict]:
    """(directory, the ep2 run's rank-0 results by model kind, the ep4 run's): ep2 on 2 ranks, resumed there at
    ep2; ep4 on 4 ranks, then both saves resumed there at ep2 x dp2; the ModuleList LM also saved at ep2 with
    tp2 on 4 ranks, resumed at ep2 x dp2, and its ep4 save resumed at ep2 with tp2."""
    tmp = str(tmp_path_factory.mktemp("ep-ckpt"))
    with_tp = {"list_moe": ([(2, 2)], [("ep2tp2", 2, 1), ("ep4", 2, 2)])}
    # one call per model kind on each worker group (no extra start-up), each inside the harness's time-out
    ep2 = {kind: run_distributed(_save_body, 2, kind, tmp, [(2, 1)], [("ep2", 2, 1)]) for kind in LOSSES}
    ep4 = {kind: run_distributed(_save_body, 4, kind, tmp, [(4, 1), *with_tp.get(kind, ([], []))[0]],
                                 [("ep2", 2, 1), ("ep4", 2, 1), *with_tp.get(kind, ([], []))[1]]) for kind in LOSSES}
    for results in [*ep2.values(), *ep4.values()]:
        for label, run in results[0]["runs"].items():
            assert all(r["runs"][label]["losses"] == run["losses"] for r in results), label
    return tmp, {k: r[0] for k, r in ep2.items()}, {k: r[0] for k, r in ep4.items()}


def _close(got: dict, want: dict, where: str) -> None:
    """Parameters within AdamW's tolerance of the Contracts (per-tensor relative norm)."""
    assert set(got) == set(want), where
    for k, w in want.items():
        rel = float((got[k] - w).norm() / w.norm().clamp_min(1e-12))
        assert rel <= ADAMW_REL, f"{where}: {k} relative difference {rel:.2e}"


def _plain(kind: str, start: tuple[dict, dict] | None) -> tuple[list[float], dict]:
    """Plain PyTorch in this process: every step, or the steps after the save from ``start``."""
    model = getattr(models, kind)()
    opt = _optimizer(model)
    steps = range(BEFORE + AFTER)
    if start is not None:
        params, states = start
        model.load_state_dict(params)
        osd = opt.state_dict()
        osd["state"] = {i: copy.deepcopy(states[n]) for i, (n, _) in enumerate(model.named_parameters())}
        opt.load_state_dict(osd)
        steps = range(BEFORE, BEFORE + AFTER)
    return _train(kind, model, opt, steps), model.state_dict()


@pytest.mark.parametrize("kind", list(LOSSES))
def test_expert_parallel_checkpoints_resume_at_other_ep_sizes_and_in_plain_pytorch(saved, kind: str) -> None:
    tmp, ep2, ep4 = saved
    tmp, ep2, ep4 = f"{tmp}/{kind}", ep2[kind], ep4[kind]
    plain_losses, plain_final = _plain(kind, None)
    runs = {**ep2["runs"], **ep4["runs"]}
    assert set(runs) == {"ep2", "ep4"} | ({"ep2tp2"} if kind == "list_moe" else set())
    for run in runs.values():  # every layout trains the plain model
        torch.testing.assert_close(run["losses"], plain_losses, rtol=LOSS_RTOL, atol=0)
        _close(run["final"], plain_final, "uninterrupted")
    states = {label: _plain_state("bmt", f"{tmp}/{label}-bmt") for label in runs}
    for label, (params, optim) in states.items():
        # whole expert tensors under their names (a list's: each expert, whichever rank held it; under TP the
        # embedding and head joined too); DCP holds the same whole tensors
        if kind == "mixtral":
            assert params["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 4
            assert optim["model.layers.0.mlp.experts.gate_up_proj"]["exp_avg"].shape[0] == 4
        else:
            assert {k: v.shape for k, v in params.items()} == {k: v.shape for k, v in
                                                               models.list_moe().state_dict().items()}
            assert optim["layers.1.moe.experts.3.2.weight"]["exp_avg"].shape == (16, 32)
            assert optim["head.weight"]["exp_avg"].shape == (models.VOCAB, 16)
        dcp_params, dcp_optim = _plain_state("dcp", f"{tmp}/{label}-dcp")
        _assert_same_tensors(dcp_params, params, f"{label}: DCP's model state")
        _assert_same_tensors(dcp_optim, optim, f"{label}: DCP's optimizer state")
        # into plain PyTorch: it continues like the plain run that never stopped
        losses, final = _plain(kind, (params, optim))
        torch.testing.assert_close(losses, plain_losses[BEFORE:], rtol=LOSS_RTOL, atol=0)
        _close(final, plain_final, f"plain PyTorch resumed from the {label} save")

    one_rank = {("ep2", fmt, 1, 1, 1): run_distributed(_resume_body, 1, kind, fmt, f"{tmp}/ep2-{fmt}", 1)[0]
                for fmt in FORMATS}
    resumed = {**ep2["resumed"], **ep4["resumed"], **one_rank}
    assert len(resumed) == 2 * (4 if kind == "mixtral" else 6)
    for (path, fmt, ep, tp, world), got in resumed.items():
        params, optim = states[path]
        uninterrupted = runs[path]["losses"][BEFORE:]
        where = f"{fmt} saved at {path}, resumed at {_label(ep, tp)} on {world} rank(s)"
        _assert_same_tensors(got["params"], params, f"{where}: loaded parameters")
        again_params, again_optim = _plain_state(fmt, got["again"])
        _assert_same_tensors(again_params, params, f"{where}: parameters saved again")
        _assert_same_tensors(again_optim, optim, f"{where}: optimizer state saved again")
        if path == _label(ep, tp) and world == runs[path]["world"]:
            assert got["losses"] == uninterrupted, where  # the saved layout: bit-equal
        else:
            torch.testing.assert_close(got["losses"], uninterrupted, rtol=LOSS_RTOL, atol=0, msg=where)
        _close(got["final"], plain_final, where)


# ---- a full (gathered) optimizer state dict loaded back under expert parallelism ----------------------------
def _full_optimizer_state_body() -> dict:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True)
    model, opt = _wrapped("mixtral", 2)
    _train("mixtral", model, opt, range(BEFORE))
    # Copies, as a file would hold: torch's optimizers hand out their own state tensors and a loaded one steps
    # what it was given in place (plain torch's too)
    saved = copy.deepcopy(get_optimizer_state_dict(model, opt, options=full))
    kept = copy.deepcopy(saved["state"])
    fresh, fresh_opt = _wrapped("mixtral", 2)
    fresh.load_state_dict(model.state_dict())
    set_optimizer_state_dict(fresh, fresh_opt, saved, options=full)  # every tensor whole, experts included
    again = copy.deepcopy(get_optimizer_state_dict(fresh, fresh_opt, options=full))
    losses = [_train("mixtral", m, o, range(BEFORE, BEFORE + AFTER)) for m, o in ((model, opt), (fresh, fresh_opt))]
    return {"saved": kept, "again": again["state"], "losses": losses}


def test_a_full_optimizer_state_dict_loads_back_at_ep2_as_plain_pytorch_holds_it() -> None:
    got = run_distributed(_full_optimizer_state_body, 2)[0]
    ref = models.mixtral()
    opt = _optimizer(ref)
    _train("mixtral", ref, opt, range(BEFORE))
    plain = {name: opt.state[p] for name, p in ref.named_parameters()}
    assert got["saved"]["model.layers.0.mlp.experts.gate_up_proj"]["exp_avg"].shape[0] == 4  # every expert
    for key in ("exp_avg", "exp_avg_sq"):  # the gathered state is plain PyTorch's, whole (AdamW's tolerance)
        _close({n: s[key] for n, s in got["saved"].items()}, {n: s[key] for n, s in plain.items()}, key)
    # loaded into a fresh wrapped optimizer, each rank keeps its part: read back whole, it is what was saved, and
    # training continues exactly as the optimizer that saved it
    _assert_same_tensors(got["again"], got["saved"], "full optimizer state loaded and read again")
    assert got["losses"][0] == got["losses"][1]
