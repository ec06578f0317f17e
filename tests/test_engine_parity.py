"""The engine against plain PyTorch: sharded training on 1, 2 and 4 ranks equals one-process training."""

from __future__ import annotations

import functools

import pytest
import torch
from dist_harness import run_distributed
from parity import lm_batches, train_side_by_side
from torch import nn
from toy import ToyGPT, manual_plan

from bmt_wrap.apply_plan import apply_plan

WORLD_SIZES = [1, 2, 4]
BLOCKS3 = [f"layers.{i}" for i in range(3)]
# A first step (capture, schedule), a second that replays it and a third in the steady state: what five showed.
STEPS = 3


def _wrap(blocks: list[str], **plan_kwargs):
    def wrap(model):
        return apply_plan(model, manual_plan(model, blocks, **plan_kwargs))
    return wrap


def _toy_body(model_kwargs: dict, plan_kwargs: dict, optimizer: str, blocks: list[str] | None = None,
              micro: int = 1, two_forwards: bool = False, batch: int = 8, steps: int = STEPS,
              frozen: tuple[str, ...] = ()) -> dict:
    def build():
        m = ToyGPT(**model_kwargs)
        for name in frozen:
            m.get_parameter(name).requires_grad_(False)
        return m
    n_layers = model_kwargs.get("n_layers", 3)
    blocks = [f"layers.{i}" for i in range(n_layers)] if blocks is None else blocks
    return train_side_by_side(build, _wrap(blocks, **plan_kwargs), lm_batches(steps, batch),
                              optimizer=optimizer, micro=micro, two_forwards=two_forwards)


CASES = {
    "checkpointed": ({}, {}),
    "not-checkpointed": ({}, {"checkpoint": False}),
    "mixed-checkpointing": ({}, {"checkpoint": [True, False, True]}),
    "zero2": ({}, {"zero_level": 2}),
    "zero2-not-checkpointed": ({}, {"zero_level": 2, "checkpoint": False}),
    "prefetch0": ({}, {"prefetch_depth": 0}),
    "prefetch2": ({}, {"prefetch_depth": 2}),
    "untied": ({"tied": False}, {}),
    "kwargs-and-dict-outputs": ({"dict_layers": True}, {}),
    "blocks-of-different-sizes": ({"widths": [8, 64, 24]}, {}),
}
# Cases that change only the schedule (what is recomputed, when blocks are gathered, how a block is called,
# how many forwards or micro-batches make a step) hand the optimizer the same shards and gradients as the
# base case: SGD's elementwise check of every step's gradients and parameters covers them. AdamW (its state
# made from and stepped on sharded parameters) runs where what it is given differs: the base case, the
# layouts (untied, blocks of different sizes), zero2's kept parameters, frozen parameters and param groups.
SCHEDULE_ONLY = {"not-checkpointed", "mixed-checkpointing", "zero2-not-checkpointed", "prefetch0", "prefetch2",
                 "kwargs-and-dict-outputs"}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize(("case", "optimizer"), [(case, optimizer) for case in CASES for optimizer in ("sgd", "adamw")
                                                 if optimizer == "sgd" or case not in SCHEDULE_ONLY])
def test_parity(case: str, optimizer: str, world_size: int) -> None:
    model_kwargs, plan_kwargs = CASES[case]
    results = run_distributed(_toy_body, world_size, model_kwargs, plan_kwargs, optimizer)
    # AdamW's first steps on random tokens move the loss up and down; its losses equal the reference's,
    # which steps, at every step.
    if optimizer == "sgd":
        assert results[0]["losses"][-1] < results[0]["losses"][0], "training makes progress"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_frozen_parameters_get_no_gradient_and_stay_put(world_size: int, optimizer: str) -> None:
    run_distributed(_toy_body, world_size, {}, {}, optimizer,
                    frozen=("ln_f.weight", "layers.1.fc.weight", "layers.2.ln1.bias"))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gradient_accumulation_over_four_micro_batches(world_size: int) -> None:
    run_distributed(_toy_body, world_size, {}, {}, "sgd", micro=4, batch=16)  # schedule only (SCHEDULE_ONLY)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("checkpoint", [True, False])
def test_two_forwards_before_one_backward(world_size: int, checkpoint: bool) -> None:
    run_distributed(_toy_body, world_size, {}, {"checkpoint": checkpoint}, "sgd", two_forwards=True)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_model_without_blocks(world_size: int, optimizer: str) -> None:
    run_distributed(_toy_body, world_size, {}, {}, optimizer, blocks=[])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_name_based_param_groups_with_torch_adamw(world_size: int) -> None:
    run_distributed(_toy_body, world_size, {}, {}, "adamw_groups")


def _shared_block_body(checkpoint: bool) -> dict:
    def build():
        m = ToyGPT(n_layers=2)
        m.layers.append(m.layers[0])  # layer 0 runs twice per forward: ALBERT-style sharing
        return m
    return train_side_by_side(build, _wrap(["layers.0", "layers.1"], checkpoint=checkpoint,
                                           order=["layers.0", "layers.1", "layers.0"]),
                              lm_batches(STEPS, 8), optimizer="sgd")  # its gradient sums two calls: SGD's check


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("checkpoint", [True, False])
def test_shared_block_called_twice(world_size: int, checkpoint: bool) -> None:
    run_distributed(_shared_block_body, world_size, checkpoint)


def _param_shared_by_blocks_body() -> dict:
    def build():
        m = ToyGPT(n_layers=3)
        for layer in m.layers[1:]:
            layer.proj.weight = m.layers[0].proj.weight  # one Parameter inside three blocks
        return m
    return train_side_by_side(build, _wrap(BLOCKS3), lm_batches(STEPS, 8), optimizer="sgd")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_parameter_shared_by_several_blocks_lives_in_root(world_size: int) -> None:
    run_distributed(_param_shared_by_blocks_body, world_size)


def test_dropout_is_bit_exact_to_plain_pytorch_on_one_rank() -> None:
    reference = run_distributed(_dropout_train_body, 1, None)[0]
    for checkpoint in (True, False):
        assert run_distributed(_dropout_train_body, 1, checkpoint)[0] == reference, checkpoint


def _layerdrop_body(wrap: bool) -> list[float]:
    """Dropout and layer-drop drawn from the global generator; the wrapper captures at the first call."""
    import bmt_wrap as bmt
    torch.manual_seed(0)
    model = ToyGPT(dropout=0.2, layerdrop=0.3)
    if wrap:
        model = bmt.BMTrainModelWrapper(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(100)
    out = []
    for idx, tgt in lm_batches(4, 8):
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(float(loss))
    return out


def test_first_call_capture_leaves_the_random_stream_alone() -> None:
    # Capturing the first call traces a meta copy whose layer-drop draws real CPU numbers: they must not
    # come out of the user's stream (m2m_100, NLLB, SeamlessM4T drew other dropout masks before).
    assert run_distributed(_layerdrop_body, 1, True)[0] == run_distributed(_layerdrop_body, 1, False)[0]


@functools.cache
def _dropout_run(world_size: int, checkpoint: bool) -> list[list[float]]:
    """``_dropout_train_body``'s losses on every rank, run once a session: one test's result, another's reference."""
    return run_distributed(_dropout_train_body, world_size, checkpoint)


@pytest.mark.parametrize("world_size", [2, 4])
def test_dropout_checkpointed_equals_not_checkpointed(world_size: int) -> None:
    assert _dropout_run(world_size, True) == _dropout_run(world_size, False)


def _dropout_train_body(checkpoint: bool | None) -> list[float]:
    """Train with dropout; ``checkpoint=None`` trains the plain model (the reference)."""
    import bmt_wrap as bmt
    torch.manual_seed(0)
    model = ToyGPT(dropout=0.2)
    if checkpoint is not None:
        model = apply_plan(model, manual_plan(model, BLOCKS3, checkpoint=checkpoint))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    torch.manual_seed(100 + bmt.rank())
    for idx, tgt in lm_batches(STEPS, 8):
        loss = model(idx.chunk(bmt.world_size())[bmt.rank()], tgt.chunk(bmt.world_size())[bmt.rank()])
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(float(bmt.sum_loss(loss.detach())))
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_rerun_is_bit_identical(world_size: int) -> None:
    assert run_distributed(_dropout_train_body, world_size, True) == _dropout_run(world_size, True)


class _SideOutputLayer(torch.nn.Module):
    """A layer whose second output (a router's logits, an auxiliary head) the model may ignore."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(d, d)
        self.side = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x + torch.tanh(self.fc(x)), self.side(x)


class _PartlyUsedNet(torch.nn.Module):
    """Parameters no step differentiates: an unused tower, a probe whose output is dropped, block outputs
    nothing reads. torch leaves their ``.grad`` None, so AdamW neither decays nor moves them."""

    def __init__(self, d: int = 16, vocab: int = 64) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(_SideOutputLayer(d) for _ in range(3))
        self.tower = torch.nn.Linear(d, d)  # never called (a multimodal model's audio tower on text input)
        self.probe = torch.nn.Linear(d, d)  # called, output dropped
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h, _ = layer(h)
        self.probe(h)
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def _partly_used_body(checkpoint: bool, optimizer: str) -> dict:
    def build():
        return _PartlyUsedNet()
    out = train_side_by_side(build, _wrap(BLOCKS3, checkpoint=checkpoint), lm_batches(3, 8), optimizer=optimizer)
    model = _wrap(BLOCKS3, checkpoint=checkpoint)(build())
    model(*lm_batches(1, 8)[0]).backward()
    out["none"] = sorted(n for n, p in model.named_parameters() if p.grad is None)
    return out


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("checkpoint", [True, False])
def test_parameters_nothing_differentiates_keep_grad_none(world_size: int, checkpoint: bool) -> None:
    results = run_distributed(_partly_used_body, world_size, checkpoint, "adamw")
    expected = sorted(f"{p}.{w}" for p in ["tower", "probe", *[f"layers.{i}.side" for i in range(3)]]
                      for w in ["weight", "bias"])
    assert all(r["none"] == expected for r in results), results[0]["none"]


class _EncDec(nn.Module):
    """Encoder output read by every decoder block (cross-attention's shape of data flow)."""

    class Enc(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.tanh(self.fc(x))

    class Dec(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.key, self.value = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
            # The memory is read twice per block (keys and values): plain autograd adds each read's
            # gradient in turn, a per-block node would add each block's pre-summed pair.
            attn = torch.softmax(self.fc(x) @ self.key(memory).transpose(1, 2), -1)
            return x + attn @ self.value(memory)

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.enc = nn.ModuleList(self.Enc() for _ in range(2))
        self.dec = nn.ModuleList(self.Dec() for _ in range(4))

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        memory = self.inp(src)
        for block in self.enc:
            memory = block(memory)
        x = self.inp(tgt)
        for block in self.dec:
            x = block(x, memory)
        return x.square().mean()


def _shared_input_grads_body(checkpoint: bool) -> int:
    import copy

    import bmt_wrap as bmt

    torch.manual_seed(0)
    ref = _EncDec()
    model = bmt.BMTrainModelWrapper(copy.deepcopy(ref), checkpoint=checkpoint)
    src, tgt = torch.randn(4, 9, 8), torch.randn(4, 7, 8)
    ref(src, tgt).backward()
    model(src, tgt).backward()
    theirs = dict(ref.named_parameters())
    differ = [n for n, p in model.named_parameters() if not torch.equal(p.grad, theirs[n].grad)]
    assert not differ, differ
    return len(theirs)


@pytest.mark.parametrize("checkpoint", [True, False])
def test_tensor_read_by_several_blocks_gets_bit_exact_gradients_on_one_rank(checkpoint: bool) -> None:
    # Autograd must sum the gradients of the encoder output in plain PyTorch's order: a node per block
    # handing back a pre-summed input gradient changed the order, and the last bits (DESIGN: N=1 exact).
    assert run_distributed(_shared_input_grads_body, 1, checkpoint)[0] > 0
