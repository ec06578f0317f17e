"""torch.compile with bmt_wrap (docs/compile.md): discovery sees through compiled blocks, a compiled block
runs its own code compiled inside the engine (forward and recompute alike), a whole-model compile never
traces the engine, and wrapping a model without repeated blocks says so.

Compiling on CPU takes seconds per graph, so the models are tiny, the steps few, and every body starts
from a clean dynamo cache (the worker processes live for the whole session).
"""

from __future__ import annotations

import functools
import shutil
import warnings

import models as M
import pytest
import torch
from dist_harness import run_distributed
from parity import lm_batches, train_side_by_side
from torch import nn
from toy import ToyGPT

import bmt_wrap as bmt
from bmt_wrap.passes import discover_blocks
from bmt_wrap.passes.signature import SignatureCache

# Inductor needs a C++ compiler on CPU; without one, aot_eager still runs AOT autograd's saved tensors
# through the executor's hooks, which is what can go wrong.
BACKEND = "inductor" if shutil.which("c++") or shutil.which("g++") else "aot_eager"
STEPS = 3


def _counters() -> dict[str, int]:
    c = torch._dynamo.utils.counters
    return {"graphs": c["stats"]["unique_graphs"], "breaks": sum(c["graph_break"].values())}


def _fresh_dynamo() -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


# ---- discovery -----------------------------------------------------------------------------------------
def _compiled_layers(model: nn.Module, which: list[int]) -> nn.Module:
    for i in which:
        model.layers[i] = torch.compile(model.layers[i], backend="eager")
    return model


@pytest.mark.parametrize("which", [[0], [1], [0, 1, 2, 3]])
def test_torch_compiled_layers_are_the_same_blocks_as_plain_ones(which: list[int]) -> None:
    model = _compiled_layers(M.ToyGPT(n_layers=4), which)
    d = discover_blocks(model)
    expected = [f"layers.{i}._orig_mod" if i in which else f"layers.{i}" for i in range(4)]
    assert d.fqns() == expected, d.notes
    assert [bl.members for bl in d.lists] == [tuple(expected)], "one stack, not a stack and a stray"
    assert len({b.signature for b in d.blocks}) == 1
    sig = SignatureCache()
    assert sig(model.layers[which[0]]) == sig(M.ToyGPT(n_layers=4).layers[0])


def test_layers_compiled_in_place_keep_their_names() -> None:
    model = M.ToyGPT(n_layers=4)
    for layer in model.layers[:2]:
        layer.compile(backend="eager")
    assert discover_blocks(model).fqns() == [f"layers.{i}" for i in range(4)]


def test_a_compiled_transformers_block_is_still_a_block() -> None:
    model = M.gpt2()
    model.transformer.h[0] = torch.compile(model.transformer.h[0], backend="eager")
    assert discover_blocks(model).fqns() == ["transformer.h.0._orig_mod", "transformer.h.1"]


# ---- the wrapped model keeps plain torch's names ---------------------------------------------------------
def _names_body(how: str) -> tuple[list[str], list[str], list[str], list[str]]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        model = ToyGPT(n_layers=3)
        for i in range(3):
            if how == "torch.compile":
                model.layers[i] = torch.compile(model.layers[i], backend="eager")
            else:
                model.layers[i].compile(backend="eager")
        return model

    plain = build()
    model = bmt.BMTrainModelWrapper(build())
    return ([n for n, _ in plain.named_parameters()], [n for n, _ in model.named_parameters()],
            list(plain.state_dict()), list(model.state_dict()))


@pytest.mark.parametrize("how", ["torch.compile", "module.compile"])
def test_wrapped_model_reports_the_names_plain_torch_reports(how: str) -> None:
    plain_params, params, plain_keys, keys = run_distributed(_names_body, 1, how)[0]
    assert params == plain_params and keys == plain_keys
    if how == "torch.compile":
        assert "layers.0._orig_mod.qkv.weight" in params


# ---- the warning when nothing repeats --------------------------------------------------------------------
class _Hidden(nn.Module):
    """Children of different structures: nothing repeats, so everything stays in the root group."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def _warnings_body(case: str) -> list[tuple[str, str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if case == "no blocks":
            bmt.BMTrainModelWrapper(_Hidden())
        elif case == "one layer":
            bmt.BMTrainModelWrapper(nn.Linear(8, 8))  # what BMTrain code wraps: nothing to find
        elif case == "plan given":
            plan = bmt.BMTrainModelWrapper(_Hidden()).plan
            caught.clear()
            bmt.BMTrainModelWrapper(_Hidden(), plan=plan)
        else:
            bmt.BMTrainModelWrapper(_compiled_layers(ToyGPT(n_layers=3), [0]))
    return [(w.category.__name__, str(w.message)) for w in caught if "repeated blocks" in str(w.message)]


def test_wrapping_without_repeated_blocks_warns_once_naming_the_model() -> None:
    found = run_distributed(_warnings_body, 1, "no blocks")[0]
    assert len(found) == 1, found
    category, message = found[0]
    assert category == "UserWarning"
    assert "_Hidden" in message and "layer.compile()" in message and "plan=" in message


@pytest.mark.parametrize("case", ["one layer", "plan given", "compiled layer"])
def test_no_warning_where_there_is_nothing_to_say(case: str) -> None:
    assert run_distributed(_warnings_body, 1, case)[0] == []


# ---- graphs, breaks and recompiles -----------------------------------------------------------------------
# Graphs, breaks and recompiles are dynamo's, decided before any backend runs: these count them under
# aot_eager (AOT autograd, no kernels to build; inductor's C++ builds took a minute of this file on 2 cores),
# and the training tests below run inductor.
GRAPHS_BACKEND = "aot_eager"


def _graphs_body(how: str, n_layers: int) -> dict:
    _fresh_dynamo()
    torch.manual_seed(0)
    model = bmt.BMTrainModelWrapper(ToyGPT(n_layers=n_layers))
    run = model
    if how in ("blocks", "blocks and whole"):
        _compile_blocks(model, backend=GRAPHS_BACKEND)  # the documented way
    if how in ("whole", "blocks and whole"):
        run = torch.compile(model, backend=GRAPHS_BACKEND)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for ids, targets in lm_batches(STEPS, 4):
        loss = run(ids, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, **_counters()}


@functools.cache
def _graphs(how: str) -> dict:
    """``_graphs_body`` on the 3-layer model, run once a session: the block-compiled run is a test's result
    and another's reference."""
    return run_distributed(_graphs_body, 1, how, 3)[0]


def test_compiling_every_block_compiles_one_graph_not_one_per_block() -> None:
    result = _graphs("blocks")
    assert result["breaks"] == 0
    assert result["graphs"] == 1, "three blocks of one code share one graph: no recompile per block"


@pytest.mark.parametrize("how", ["whole", "blocks and whole"])
def test_compiling_the_whole_wrapped_model_never_traces_the_engine(how: str) -> None:
    reference = _graphs("eager" if how == "whole" else "blocks")
    result = _graphs(how)
    # The engine is opaque: at most one break per block call and root hook, and no recompile storm (before:
    # 19 graphs and 29 breaks in 3 steps of this model with checkpoint=False, a RecomputeError with it).
    assert result["breaks"] <= STEPS * (3 + 2)
    assert result["graphs"] <= reference["graphs"] + 3
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=0)


# ---- training: compiled and wrapped against plain PyTorch compiled the same way ---------------------------
def _compile_blocks(model: nn.Module, first: int = 0, backend: str = BACKEND) -> nn.Module:
    for layer in model.layers[first:]:
        layer.compile(backend=backend)
    return model


def _parity_body(way: str, dropout: float, checkpoint: bool) -> dict:
    _fresh_dynamo()
    before = way == "compile blocks then wrap"  # else the documented way: wrap, then compile each block

    def build() -> nn.Module:
        # The reference is plain PyTorch compiled the same way. Before wrapping, both ways at once: layer 0
        # through torch.compile (its parameters become layers.0._orig_mod.*), the others in place.
        model = ToyGPT(n_layers=3, dropout=dropout)
        if before:
            model.layers[0] = torch.compile(model.layers[0], backend=BACKEND)
        return _compile_blocks(model, first=1 if before else 0)

    def wrap(model: nn.Module) -> nn.Module:
        # `model` is a deep copy of the reference: in-place compiles did not survive the copy.
        if before:
            return bmt.BMTrainModelWrapper(_compile_blocks(model, first=1), checkpoint=checkpoint)
        return _compile_blocks(bmt.BMTrainModelWrapper(model, checkpoint=checkpoint))

    # On several ranks the reference runs each rank's slice in turn, so every compiled block sees one batch
    # shape: a second would recompile it with a dynamic batch, a whole other set of kernels to build.
    result = train_side_by_side(build, wrap, lm_batches(STEPS, 8), optimizer="sgd",
                                reseed=100 if dropout else None, sliced_reference=bmt.world_size() > 1)
    result.update(_counters())
    return result


@pytest.mark.parametrize("way", ["wrap then compile blocks", "compile blocks then wrap"])
def test_compiled_blocks_train_like_plain_pytorch_on_one_rank(way: str) -> None:
    # Dropout on: a checkpointed block's recompute must draw the forward's masks from the compiled code.
    result = run_distributed(_parity_body, 1, way, 0.1, True)[0]
    assert result["losses"][-1] < result["losses"][0]
    assert result["graphs"] >= 1 and result["breaks"] == 0, "blocks ran compiled; the engine was never traced"


@pytest.mark.parametrize("checkpoint", [True, False])
def test_compiled_blocks_train_like_plain_pytorch_on_two_ranks(checkpoint: bool) -> None:
    results = run_distributed(_parity_body, 2, "wrap then compile blocks", 0.0, checkpoint)
    assert all(r["graphs"] >= 1 and r["breaks"] == 0 for r in results)


def _lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _hf_body(name: str) -> dict:
    _fresh_dynamo()
    factory, _, blocks = M.HF[name]

    def build() -> nn.Module:
        model = factory()
        for block in blocks:
            model.get_submodule(block).compile(backend="aot_eager")
        return model

    def wrap(model: nn.Module) -> nn.Module:
        model = bmt.BMTrainModelWrapper(model)
        for spec in model.plan.blocks():  # the loop docs/compile.md shows
            model.get_submodule(spec.name).compile(backend="aot_eager")
        return model

    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, M.VOCAB, (4, 8), generator=g),) for _ in range(STEPS)]
    result = train_side_by_side(build, wrap, batches, loss_fn=_lm_loss)
    result.update(_counters())
    return result


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_compiled_transformers_blocks_train_like_plain_pytorch(name: str) -> None:
    # aot_eager: AOT autograd's saved tensors and the DynamicCache a block updates (use_cache stays on),
    # without inductor's C++ build time.
    result = run_distributed(_hf_body, 1, name)[0]
    assert result["graphs"] >= 1 and result["breaks"] == 0
