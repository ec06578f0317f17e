"""fused_loss=True: the pass that finds the vocabulary projection and its cross-entropy, the lazy logits
that run them as one chunked op, and wrapped training on 1, 2 and 4 ranks against the plain, unfused
model (transformers Llama untied, GPT-2 and Qwen2 tied, Gemma-2's softcapping, Cohere's logit scale,
padding with -100, num_items_in_batch, label smoothing and a summed loss on a plain PyTorch model; heads with
no nn.Linear: a tied embedding's weight in F.linear or a matmul, as OLMo and research models write them)."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import models
import pytest
import torch
import torch.nn.functional as F
from dist_harness import run_distributed
from parity import train_side_by_side
from test_tp_plan import TOY_PLAN
from torch import nn

import bmt_wrap as bmt
from bmt_wrap import passes
from bmt_wrap.base import fused_loss_plan
from bmt_wrap.base.fused_loss_plan import FusedLossPlan
from bmt_wrap.cli import main
from bmt_wrap.errors import FusedLossWarning, PlanError
from bmt_wrap.loss import linear_cross_entropy as lce
from bmt_wrap.passes.capacity import process_peak, training_phases
from bmt_wrap.passes.export_graph import export_blocks
from bmt_wrap.passes.fused_loss import fused_linear_cross_entropy
from bmt_wrap.plan import WrapPlan
from bmt_wrap.wrapper import BMTrainModelWrapper
from bmt_wrap.wrapping.fused_loss import install_fused_loss


def gemma2() -> nn.Module:
    """transformers Gemma2ForCausalLM (final_logit_softcapping=30 by default, tied), 2 layers."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return models.seeded(lambda: Gemma2ForCausalLM(Gemma2Config(**models._hf_small(), head_dim=8)))


def cohere() -> nn.Module:
    """transformers CohereForCausalLM (logit_scale=0.0625 by default, tied), 2 layers."""
    from transformers import CohereConfig, CohereForCausalLM

    return models.seeded(lambda: CohereForCausalLM(CohereConfig(**models._hf_small(), eos_token_id=0)))


MODELS = str(Path(__file__).with_name("models.py"))
FACTORIES = {"llama": models.llama, "gpt2": models.gpt2, "qwen2": models.qwen2, "gemma2": gemma2, "cohere": cohere}


class Projection(nn.Module):
    """A custom projection module: its own Parameter and ``F.linear`` in its forward, no ``nn.Linear``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(models.VOCAB, models.DIM) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


#: Heads other than a bias-free nn.Linear, all fused: through the Linear inside them, or as the product the
#: model's own code computes (a custom projection's F.linear, a bare Parameter, a tied embedding's weight as
#: OLMo and research models use it, with no nn.Linear at all).
HEADS = {
    "sequential": lambda: nn.Sequential(nn.Linear(models.DIM, models.DIM), nn.GELU(),
                                        nn.Linear(models.DIM, models.VOCAB)),
    "bias": lambda: nn.Linear(models.DIM, models.VOCAB, bias=True),
    "projection": Projection,
    "matmul": None,  # lm_head is a bare (hidden, vocabulary) Parameter: x @ self.lm_head
    "tied-linear": None,  # F.linear(x, self.embed.weight)
    "tied-matmul": None,  # x @ self.embed.weight.t()
    "tied-T": None,  # torch.matmul(x, self.embed.weight.T)
}
#: The head each form is found as: (module, weight, product).
FOUND = {"sequential": ("head.2", "head.2.weight", None), "bias": ("head", "head.weight", None),
         "projection": (None, "head.weight", "F.linear"), "matmul": (None, "lm_head", "matmul"),
         "tied-linear": (None, "embed.weight", "F.linear"), "tied-matmul": (None, "embed.weight", "matmul"),
         "tied-T": (None, "embed.weight", "matmul")}


class LossGPT(models.ToyGPT):
    """A plain PyTorch LM whose forward computes its loss with an ``nn.CrossEntropyLoss`` (fx captures it);
    ``head`` one of ``HEADS`` replaces its bias-free nn.Linear head."""

    def __init__(self, extra: str = "", tie: bool = False, head: str | None = None, **loss: object) -> None:
        super().__init__(n_layers=2, tie=tie or (head or "").startswith("tied"))
        self.loss_fct = nn.CrossEntropyLoss(**loss)  # type: ignore[arg-type]
        self.extra = extra
        self.form = head if head in ("matmul", "tied-linear", "tied-matmul", "tied-T") else None
        if self.form is not None:
            del self.head
        if head == "matmul":
            self.lm_head = nn.Parameter(torch.randn(models.DIM, models.VOCAB) * 0.02)
        elif head is not None and self.form is None:
            self.head = HEADS[head]()

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.form == "matmul":
            return x @ self.lm_head
        if self.form == "tied-linear":
            return F.linear(x, self.embed.weight)
        if self.form == "tied-matmul":
            return x @ self.embed.weight.t()
        if self.form == "tied-T":
            return torch.matmul(x, self.embed.weight.T)
        return self.head(x)

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids) + self.pos[: input_ids.shape[1]]
        for layer in self.layers:
            x = layer(x)
        logits = self._logits(self.ln_f(x))
        if targets is None:
            return logits
        # As nanoGPT and OLMo flatten: the vocabulary read off the logits' shape.
        loss = self.loss_fct(logits.view(-1, logits.size(-1)), targets.view(-1))
        if self.extra == "argmax":  # the logits read whole besides the loss
            loss = loss + logits.argmax(-1).float().mean() * 0
        return loss


def _padded(ids: torch.Tensor, seed: int) -> torch.Tensor:
    """``ids`` as labels with a random prefix of each row padded with -100 (as collators pad prompts)."""
    g = torch.Generator().manual_seed(seed)
    labels = ids.clone()
    for row, pad in enumerate(torch.randint(0, ids.shape[1] - 2, (ids.shape[0],), generator=g).tolist()):
        labels[row, :pad] = -100
    return labels


def _batches(steps: int, batch: int = 4, seq: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, models.VOCAB, (batch, seq), generator=g) for _ in range(steps)]
    return [(i, _padded(i, s)) for s, i in enumerate(ids)]


def _capture(model: nn.Module, **inputs: torch.Tensor) -> passes.Capture:
    return passes.capture(model, passes.discover_blocks(model), inputs or None)


# ---- the pass -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama", "gpt2", "gemma2"])
def test_pass_finds_the_transformers_head_and_loss(name: str) -> None:
    model = FACTORIES[name]()
    ids = models.token_ids()
    cap = _capture(model, input_ids=ids, labels=_padded(ids, 0))
    graph, section = passes.fuse_loss(cap.graph, model, enabled=True)
    assert section.fused and section.head == "lm_head" and "loss_function" in section.loss
    assert section.steps[-2:] == ["to", "view"]  # transformers' fp32 upcast and flattening
    if name == "gemma2":
        assert section.steps[:3] == ["div(30.0)", "tanh", "mul(30.0)"]
    assert (section.vocab, section.rows) == (models.VOCAB, ids.numel())
    assert section.logits_bytes == ids.numel() * models.VOCAB * 4
    fused = [n for n in graph.nodes if n.target is fused_linear_cross_entropy]
    assert len(fused) == 1 and fused[0].kwargs["ignore_index"] == -100
    assert not any(n.target is torch.ops.aten.linear.default and "lm_head" in str(n.args[1]) for n in graph.nodes)
    output = next(n for n in graph.nodes if n.op == "output")
    assert output.args[0][0] is fused[0] and output.args[0][1] is None  # the loss; no logits
    with pytest.raises(PlanError, match="not run"):
        fused[0].target(None, None, None)


def test_pass_reads_a_plain_models_loss_module_from_fx() -> None:
    model = models.seeded(lambda: LossGPT(label_smoothing=0.1, reduction="sum"))
    cap = _capture(model)
    assert cap.method == "fx"
    graph, section = passes.fuse_loss(cap.graph, model, enabled=True)
    assert section.fused and section.head == "head" and section.weight == "head.weight"
    assert section.loss == "nn.CrossEntropyLoss (loss_fct)" and section.steps == ["view(-1)"]
    assert section.logits_bytes is None  # no input shape under fx
    assert sum(n.target is fused_linear_cross_entropy for n in graph.nodes) == 1


def _exported(model: nn.Module, *args: torch.Tensor) -> passes.Capture:
    """The capture torch.export makes of a call (what a model fx cannot trace gets at its first call)."""
    discovery = passes.discover_blocks(model)
    found = export_blocks(passes.meta_skeleton(model), discovery, *passes.to_meta((args, {})))
    return passes.Capture("export", found.order, found.graph, activations=found.activations)


@pytest.mark.parametrize("head", list(HEADS))
def test_pass_fuses_every_form_of_head(head: str) -> None:
    model = models.seeded(lambda: LossGPT(head=head))
    ids = models.token_ids()
    for cap in (_capture(model), _exported(model, ids, ids)):
        graph, section = passes.fuse_loss(cap.graph, model, enabled=True)
        assert section.fused, (cap.method, section.reason)
        assert (section.head, section.weight, section.product) == FOUND[head], cap.method
        assert sum(n.target is fused_linear_cross_entropy for n in graph.nodes) == 1
        if cap.method == "export":  # shapes known: the logits' bytes at this input
            assert (section.vocab, section.rows, section.logits_bytes) == (models.VOCAB, ids.numel(),
                                                                           ids.numel() * models.VOCAB * 4)
    text = str(WrapPlan(groups=[], fused_loss=section))
    assert f"fused loss: {FOUND[head][0] or FOUND[head][2] + ' with ' + FOUND[head][1]} -> view" in text, text


def test_a_product_head_whose_weight_tp_splits_is_left_unfused_with_the_reason() -> None:
    """The vocabulary-parallel form takes an nn.Linear head split colwise_gather; F.linear on a tied embedding
    split by vocabulary rows would see this rank's rows only. The TP pass keeps such an embedding whole, so
    only a TP section made for another model (``plan=``) can split it."""
    model = models.seeded(lambda: LossGPT(head="tied-linear"))
    no_head = {k: v for k, v in TOY_PLAN.items() if k != "head"}
    tp = passes.plan_tensor_parallel(model, 2, passes.discover_blocks(model), no_head)
    assert "embed.weight" not in tp.split_names()  # the root's F.linear reads it: kept whole, so fused
    assert passes.fused_loss_section(model, _capture(model), enabled=True, tensor_parallel=tp).fused
    other = models.ToyGPT(n_layers=2)  # its head is an nn.Linear: its embedding is split
    split = passes.plan_tensor_parallel(other, 2, passes.discover_blocks(other), no_head)
    assert "embed.weight" in split.split_names()
    section = passes.fused_loss_section(model, _capture(model), enabled=True, tensor_parallel=split)
    assert not section.fused and section.product == "F.linear"
    assert "tensor parallelism splits embed.weight" in section.reason


@pytest.mark.parametrize(("build", "inputs", "reason"), [
    (models.llama, "ids", "computes no cross-entropy"),
    (lambda: models.seeded(lambda: LossGPT(extra="argmax")), None, "also feed argmax"),
    (lambda: models.seeded(lambda: LossGPT(weight=torch.ones(models.VOCAB))), None, "class weights"),
    (lambda: models.seeded(lambda: LossGPT(reduction="none")), None, "one loss per token"),
], ids=["no-labels", "logits-read-whole", "class-weights", "reduction-none"])
def test_pass_leaves_what_it_does_not_recognise_with_the_reason(build, inputs, reason) -> None:
    model = build()
    cap = _capture(model, input_ids=models.token_ids()) if inputs else _capture(model)
    graph, section = passes.fuse_loss(cap.graph, model, enabled=True)
    assert not section.fused and reason in section.reason
    assert graph is cap.graph
    text = "\n".join(str(WrapPlan(groups=[], fused_loss=section)).splitlines())
    assert reason in text


def test_plan_section_round_trips_and_shows_the_saving() -> None:
    model = models.llama()
    ids = models.token_ids(batch=2, seq=16)
    cap = _capture(model, input_ids=ids, labels=ids)
    plan = passes.build_plan(model, passes.discover_blocks(model), world_size=2, capture=cap)
    plan.fused_loss = passes.fused_loss_section(model, cap, enabled=False)
    again = WrapPlan.from_json(plan.to_json())
    assert again.fused_loss == plan.fused_loss and not again.fused_loss.fused
    text = str(again)
    assert "fused loss: lm_head -> to -> view -> cross_entropy" in text
    assert "off (BMTrainModelWrapper(model, fused_loss=True)" in text and "logits at this input: 12.00 KiB" in text
    pending = passes.fused_loss_section(model, None, enabled=True)
    assert pending.pending and not pending.fused and "captured at the first call" in pending.reason


@pytest.mark.parametrize("enabled", [False, True])
def test_plan_counts_the_pairs_peak_as_a_phase_of_training(enabled: bool) -> None:
    """Unfused, the loss's backward holds the gradients of the fp32 log-probabilities and of the logits
    beside the saved log-probabilities; fused, the op holds one chunk and the head's fp32 gradient."""
    model = models.llama()
    ids = models.token_ids(batch=2, seq=16)
    cap = _capture(model, input_ids=ids, labels=ids)
    section = passes.fused_loss_section(model, cap, enabled=enabled)
    plan = passes.build_plan(model, passes.discover_blocks(model), world_size=2,
                             capture=passes.with_fused_loss(cap, section))
    plan.fused_loss = section
    est = plan.estimates["2"]
    tokens, vocab, hidden = ids.numel(), models.VOCAB, models.DIM
    pair = tokens * vocab * 4 + vocab * hidden * 4 if enabled else 2 * tokens * vocab * 4
    held = est.params + est.optimizer + est.gathered + est.activations - est.activations_recompute
    assert training_phases(plan, est)["vocabulary head and loss"] == held + pair
    assert process_peak(plan, est, 0).training >= held + pair


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def _activations(out: str) -> str:
    return next(line for line in out.splitlines() if line.strip().startswith("activations")).split()[-2]


def test_cli_plan_shows_the_logits_and_counts_the_fused_op(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("plan", f"{MODELS}:llama", "--world-size", "2", "--input", "input_ids=int64[4,64]",
            "--input", "labels=int64[4,64]")
    plain, fused = _cli(capsys, *argv), _cli(capsys, *argv, "--fused-loss")
    assert "logits at this input: 96.00 KiB (256 tokens x 96 words)" in plain and "off (" in plain
    assert "fused: one chunked op, no logits returned" in fused
    # The unfused loss keeps 256 x 96 fp32 log-probabilities (96 KiB); the fused op the hidden states'
    # gradient, 256 x 32 fp32 (32 KiB).
    assert float(_activations(plain)) - float(_activations(fused)) == 64.0
    drawn = _cli(capsys, "dump", f"{MODELS}:ToyGPT", "--fused-loss", "--input", "int64[2,8]",
                 "--input", "targets=int64[2,8]")
    assert "fused_linear_cross_entropy" in drawn


# ---- the lazy logits, unwrapped ----------------------------------------------------------------------------
def _fused_copy(name: str) -> tuple[nn.Module, nn.Module]:
    ref = FACTORIES[name]()
    model = copy.deepcopy(ref)
    install_fused_loss(model, FusedLossPlan(True, head="lm_head"))
    return ref.train(), model.train()


def _assert_same_grads(model: nn.Module, ref: nn.Module) -> None:
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_a_call_without_labels_and_evaluation_are_untouched() -> None:
    ref, model = _fused_copy("llama")
    ids = models.token_ids()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusedLossWarning)  # whole logits returned is no fallback
        out, want = model(input_ids=ids).logits, ref(input_ids=ids).logits
    assert type(out) is torch.Tensor
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    out.square().mean().backward()
    want.square().mean().backward()
    _assert_same_grads(model, ref)
    model.eval()
    with torch.no_grad():
        assert type(model(input_ids=ids, labels=ids).logits) is torch.Tensor


def test_logits_read_whole_inside_the_forward_warn_and_stay_exact() -> None:
    ref = models.seeded(lambda: LossGPT(extra="argmax"))
    model = copy.deepcopy(ref)
    install_fused_loss(model, FusedLossPlan(True, head="head"))
    ids = models.token_ids()
    with pytest.warns(FusedLossWarning, match="argmax"):
        loss = model(ids, ids)
    want = ref(ids, ids)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=0)
    loss.backward()
    want.backward()
    _assert_same_grads(model, ref)


def test_bf16_autocast_gives_the_unfused_loss() -> None:
    ref, model = _fused_copy("llama")
    ids = models.token_ids()
    labels = _padded(ids, 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, want = model(input_ids=ids, labels=labels).loss, ref(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=0)  # the same bf16 logits, an fp32 loss
    loss.backward()
    want.backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1.6e-2, atol=1e-4)  # bf16's rounding


# ---- wrapped, against plain PyTorch on 1, 2 and 4 ranks ------------------------------------------------------
CHUNK_ROWS = 5


def _wrapped_body(name: str, steps: int, num_items: bool = False, tp_size: int | None = None) -> dict:
    head = name.partition("-")[2] or None
    factory = FACTORIES[name] if name in FACTORIES else (lambda: models.seeded(
        # Under TP and with other heads, mean: a summed loss's gradients (up to ~40 here) take SGD's steps of
        # lr 0.1 to weights whose step-1 gradients then differ past atol by rounding alone, fused or not
        # (the step-0 gradients of a bias head are as close to fp64's as the unfused run's).
        lambda: LossGPT(label_smoothing=0.1, reduction="mean" if tp_size or head else "sum",
                        tie=tp_size is not None, head=head)))
    seen: dict = {}
    wrap_kw: dict = {}
    dp = None
    if tp_size is not None:  # the head split by vocabulary rows (a plain model's by TOY_PLAN, tied to the embedding)
        wrap_kw = {"tp_size": tp_size, "tp_plan": None if name in FACTORIES else TOY_PLAN}
        dp = (bmt.rank() // tp_size, bmt.world_size() // tp_size)

    def wrap(m: nn.Module) -> nn.Module:
        seen["model"] = BMTrainModelWrapper(m, fused_loss=True, **wrap_kw)
        return seen["model"]

    def loss_fn(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if name not in FACTORIES:
            return model(ids, labels.clamp(min=0))
        kw = {"num_items_in_batch": (labels[:, 1:] != -100).sum()} if num_items else {}
        out = model(input_ids=ids, labels=labels, **kw)
        if model is seen["model"]:
            seen.setdefault("logits", []).append(out.logits)
        return out.loss

    chunks: list[int] = []  # rows of logits each chunk of the fused op made
    chunk_grads = lce._chunk_grads

    def spy(z: torch.Tensor, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
        chunks.append(z.shape[0])
        return chunk_grads(z, *args)

    # A plain model's heads: chunks of CHUNK_ROWS rows, so each call's logits are never whole.
    elements = fused_loss_plan.CHUNK_ELEMENTS
    fused_loss_plan.CHUNK_ELEMENTS = CHUNK_ROWS * models.VOCAB if head else elements
    lce._chunk_grads = spy
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FusedLossWarning)
            result = train_side_by_side(factory, wrap, _batches(steps), optimizer="sgd", loss_fn=loss_fn,
                                        sliced_reference=True, data_parallel=dp)
    finally:
        lce._chunk_grads, fused_loss_plan.CHUNK_ELEMENTS = chunk_grads, elements
    section = seen["model"].plan.fused_loss
    return {"losses": result["losses"], "fused": section.fused, "head": section.head, "reason": section.reason,
            "logits": [x is None for x in seen.get("logits", [])], "chunks": chunks}


@pytest.mark.parametrize(("name", "world_size", "options"), [
    ("llama", 1, {}), ("llama", 2, {"num_items": True}), ("llama", 4, {}),
    ("gpt2", 2, {}), ("qwen2", 4, {}),
    ("gemma2", 1, {}), ("cohere", 1, {}),
    ("plain", 2, {}),
    ("llama", 2, {"tp_size": 2}), ("llama", 4, {"tp_size": 2}),
    # Label smoothing under the vocabulary-parallel form (each softmax from exp(x - max) / sum: from
    # exp(x - lse), ln_f's gradient was 1.35e-6 off at tp2, past atol 1e-6).
    ("plain", 1, {"tp_size": 1}), ("plain", 2, {"tp_size": 2}), ("plain", 4, {"tp_size": 2}), ("plain", 4, {"tp_size": 4}),
    # Heads other than a bias-free nn.Linear: fused through the Linear inside, or as the product the model's
    # code computes (a tied embedding's weight sharded over 2 ranks: F.linear, matmul with .t() and .T).
    ("plain-sequential", 2, {}), ("plain-bias", 1, {}), ("plain-bias", 4, {}),
    ("plain-projection", 2, {}), ("plain-matmul", 1, {}),
    ("plain-tied-linear", 1, {}), ("plain-tied-linear", 2, {}), ("plain-tied-matmul", 2, {}), ("plain-tied-T", 1, {}),
])
def test_fused_training_matches_the_unfused_model(name: str, world_size: int, options: dict) -> None:
    results = run_distributed(_wrapped_body, world_size, name, 2, **options)
    assert results[0]["fused"], results[0]
    assert all(results[0]["logits"]), "a call that computes the loss returns no logits"
    for r in results:  # every rank's every call ran the chunked op
        assert r["chunks"], r
        if "-" in name:
            assert max(r["chunks"]) == CHUNK_ROWS and len(r["chunks"]) > 2, r["chunks"]


def test_memory_budget_does_not_fuse_by_itself() -> None:
    results = run_distributed(_budget_body, 1)
    assert results[0] == (False, "head")


def _budget_body() -> tuple[bool, str | None]:
    model = BMTrainModelWrapper(models.seeded(lambda: LossGPT()), memory_budget=1 << 40)
    section = model.plan.fused_loss
    return section.fused, section.head
