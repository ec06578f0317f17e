"""BMTrain's explicit API on our engine: DistributedParameter, DistributedModule, CheckpointBlock,
TransformerBlockList, init_parameters — trained against the same model in plain PyTorch."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from dist_harness import run_distributed
from parity import LOSS_RTOL, compare_grads, compare_params, lm_batches
from torch import nn
from toy import Layer

import bmt_wrap as bmt
from bmt_wrap.block import CheckpointBlock, TransformerBlockList
from bmt_wrap.gathered import gathered
from bmt_wrap.init import init_parameters
from bmt_wrap.module import DistributedModule
from bmt_wrap.runtime.param import DistributedParameter

VOCAB, D, LAYERS = 64, 16, 3


class PlainGPT(nn.Module):
    """The reference: the same computation with plain parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Parameter(torch.randn(VOCAB, D) * 0.02)
        self.transformers = nn.ModuleList(Layer(D) for _ in range(LAYERS))
        self.ln_w = nn.Parameter(torch.ones(D))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = F.embedding(idx, self.emb)
        for layer in self.transformers:
            x = layer(x)
        logits = F.layer_norm(x, (D,), self.ln_w) @ self.emb.t()
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class BmtGPT(DistributedModule):
    """What a BMTrain user writes: DistributedParameters at the root, blocks in a TransformerBlockList."""

    def __init__(self, use_checkpoint: bool = True, zero_level: int = 3) -> None:
        super().__init__()
        self.emb = DistributedParameter(torch.randn(VOCAB, D) * 0.02, init_method=_normal)
        self.transformers = TransformerBlockList([
            CheckpointBlock(Layer(D), use_checkpoint=use_checkpoint, zero_level=zero_level) for _ in range(LAYERS)])
        self.ln_w = DistributedParameter(torch.ones(D), init_method=nn.init.ones_)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = F.embedding(idx, self.emb)
        x = self.transformers(x)
        logits = F.layer_norm(x, (D,), self.ln_w) @ self.emb.t()  # the embedding read twice: tied
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _normal(t: torch.Tensor) -> None:
    nn.init.normal_(t, std=0.02)


def _parity_body(use_checkpoint: bool, zero_level: int, optimizer: str) -> dict:
    torch.manual_seed(0)
    ref = PlainGPT()
    torch.manual_seed(0)
    model = BmtGPT(use_checkpoint, zero_level)
    model.load_state_dict(ref.state_dict())  # full tensors in, each rank keeps its slices
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1) if optimizer == "sgd" else \
        torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if optimizer == "sgd" else \
        torch.optim.AdamW(model.parameters(), lr=1e-3)
    n, r = bmt.world_size(), bmt.rank()
    losses = []
    for step, (idx, tgt) in enumerate(lm_batches(5, 8)):
        ref_loss = ref(idx, tgt)
        ref_loss.backward()
        loss = model(idx.chunk(n)[r], tgt.chunk(n)[r])
        loss.backward()
        compare_grads(ref, model, f"step {step}")
        got = float(bmt.sum_loss(loss.detach()))
        assert math.isclose(got, float(ref_loss), rel_tol=LOSS_RTOL), (step, got, float(ref_loss))
        losses.append(got)
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
    compare_params(ref, model, optimizer, "after training")
    return {"losses": losses, "keys": list(model.state_dict())}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("use_checkpoint,zero_level", [(True, 3), (False, 3), (True, 2)])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_bmtrain_style_model_matches_plain_pytorch(world_size: int, use_checkpoint: bool, zero_level: int,
                                                   optimizer: str) -> None:
    results = run_distributed(_parity_body, world_size, use_checkpoint, zero_level, optimizer)
    ref_keys = list(PlainGPT().state_dict())
    assert results[0]["keys"] == ref_keys, "state_dict keys are the inner modules' (no extra infix)"


def _api_shape_body() -> dict:
    torch.manual_seed(0)
    model = BmtGPT()
    n = bmt.world_size()
    emb = model.emb
    assert isinstance(emb, DistributedParameter) and emb.shape == (VOCAB, D) and emb.dim() == 2
    assert isinstance(model.transformers[0], CheckpointBlock) and isinstance(model.transformers[0], Layer)
    assert len(model.transformers) == LAYERS and isinstance(model.transformers[-1], Layer)
    # each rank holds 1/N of the model (up to padding); parameters() count the whole model, as in torch
    local = sum(p.to_local().numel() for p in model.parameters())
    full = sum(math.prod(p.shape) for p in model.parameters())
    assert local <= full // n + 64 * len(list(model.parameters())), (local, full)
    # init_parameters: every rank's slice of identical full tensors
    torch.manual_seed(5)
    init_parameters(model)
    with gathered(model):
        w = model.emb.detach().clone()
        assert w.shape == (VOCAB, D)
        model.ln_w.data.fill_(2.0)  # written back on exit
    everyone = torch.zeros(n, *w.shape)
    everyone[bmt.rank()] = w
    bmt.get_state().comm.all_reduce(everyone.view(-1))
    assert all(torch.equal(everyone[0], everyone[k]) for k in range(n)), "ranks agree on full values"
    torch.manual_seed(5)
    expected = torch.empty(VOCAB, D)
    _normal(expected)
    torch.testing.assert_close(w, expected)
    assert torch.all(model.ln_w.detach() == 2.0)
    return {"local": local, "full": full}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_api_surface_init_and_gathered(world_size: int) -> None:
    run_distributed(_api_shape_body, world_size)


def _return_hidden_states_body() -> None:
    torch.manual_seed(0)
    blocks = TransformerBlockList([Layer(D) for _ in range(LAYERS)])
    x = torch.randn(2, 4, D)
    out, hidden = blocks(x, return_hidden_states=True)
    assert hidden.shape == (LAYERS, 2, 4, D)
    assert torch.equal(hidden[0], x)
    torch.testing.assert_close(out, blocks(x))


def test_transformer_block_list_return_hidden_states() -> None:
    run_distributed(_return_hidden_states_body, 2)


def _inference_body() -> list[float]:
    torch.manual_seed(0)
    model = BmtGPT()
    model.eval()
    idx = torch.randint(0, VOCAB, (2, 6))
    with torch.no_grad():
        a = model(idx, idx)
    with torch.inference_mode():
        b = model(idx, idx)
    assert all(p.grad is None for p in model.parameters()), "inference does no gradient work"
    return [float(a), float(b)]


@pytest.mark.parametrize("world_size", [1, 2])
def test_inference_gathers_without_gradient_work(world_size: int) -> None:
    results = run_distributed(_inference_body, world_size)
    assert results[0][0] == results[0][1] and all(r == results[0] for r in results)


class _Scale(DistributedModule):
    """BMTrain-style leaf module: a DistributedModule with its own DistributedParameter."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = DistributedParameter(torch.ones(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class _LayerWithScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = Layer(D)
        self.scale = _Scale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(self.layer(x))


def _nested_distributed_module_body(use_checkpoint: bool) -> float:
    torch.manual_seed(0)
    blocks = TransformerBlockList([CheckpointBlock(_LayerWithScale(), use_checkpoint=use_checkpoint)
                                   for _ in range(2)])
    x = torch.randn(2, 4, D, requires_grad=True)
    blocks(x).pow(2).mean().backward()
    assert all(p.grad is not None for p in blocks.parameters())
    return float(x.grad.abs().sum())


@pytest.mark.parametrize("use_checkpoint", [True, False])
def test_distributed_module_inside_a_checkpointed_block(use_checkpoint: bool) -> None:
    # BMTrain's own GPT example nests DistributedModules (Linear, LayerNorm) inside CheckpointBlocks:
    # the recompute in backward must not be taken for a new outermost forward.
    results = run_distributed(_nested_distributed_module_body, 2, use_checkpoint)
    assert results[0] == results[1]
