"""The tensor-parallel pass (passes/tensor_parallel.py): pure, one process, no communication."""

from __future__ import annotations

import dataclasses
import inspect
import json

import models
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bmt_wrap import passes
from bmt_wrap.base.plan import WrapPlan
from bmt_wrap.base.tp_plan import TensorParallelPlan, tp_text
from bmt_wrap.errors import TensorParallelPlanError

TOY_PLAN = {"embed": "embedding_rowwise", "layers.*.attn.q": "colwise", "layers.*.attn.k": "colwise",
            "layers.*.attn.v": "colwise", "layers.*.attn.o": "rowwise", "layers.*.fc1": "colwise",
            "layers.*.fc2": "rowwise", "head": "colwise_gather_output"}


def _tp(model: nn.Module, t: int, tp_plan: dict | None = None):
    return passes.plan_tensor_parallel(model, t, passes.discover_blocks(model), tp_plan)


def test_llama_uses_transformers_plan_and_needs_no_head_rewrite() -> None:
    model = models.llama()
    tp = _tp(model, 2)
    assert tp.source == "transformers"
    styles = {e.module: e.style for e in tp.entries}
    assert styles["model.layers.0.self_attn.q_proj"] == "colwise"
    assert styles["model.layers.1.mlp.down_proj"] == "rowwise"
    assert styles["lm_head"] == "colwise_gather"
    assert styles["model.embed_tokens"] == "vocab_embedding"
    assert len(tp.entries) == 2 * 7 + 2
    assert tp.heads == []  # Llama reshapes with -1 and head_dim: nothing to rewrite
    shapes = tp.local_shapes()
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == [32, 16]
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == [32, 32]
    blocks = {e.module: e.block for e in tp.entries}
    assert blocks["lm_head"] is None and blocks["model.layers.1.mlp.up_proj"] == "model.layers.1"


def test_llama_kv_heads_not_divisible_is_named_error() -> None:
    with pytest.raises(TensorParallelPlanError, match="num_key_value_heads = 2"):
        _tp(models.llama(), 4)


def test_user_plan_rewrites_head_counts_and_splits() -> None:
    model = models.ToyGPT()
    tp = _tp(model, 2, TOY_PLAN)
    assert tp.source == "user"
    assert {(h.module, h.attribute, h.full, h.local) for h in tp.heads} == {
        (f"layers.{i}.attn", "heads", 4, 2) for i in range(4)}
    shapes = tp.local_shapes()
    assert shapes["layers.0.attn.q.weight"] == [16, 32] and shapes["layers.0.attn.q.bias"] == [16]
    assert shapes["layers.0.attn.o.weight"] == [32, 16] and shapes["layers.0.attn.o.bias"] == [32]
    assert shapes["embed.weight"] == [48, 32] and shapes["head.weight"] == [48, 32]


def test_user_plan_naming_missing_module_is_named_error() -> None:
    with pytest.raises(TensorParallelPlanError, match="names no module for 'layers.\\*.mlp.up'"):
        _tp(models.ToyGPT(), 2, {**TOY_PLAN, "layers.*.mlp.up": "colwise"})


def test_unknown_style_is_named_error() -> None:
    with pytest.raises(TensorParallelPlanError, match="'sequence_parallel'"):
        _tp(models.ToyGPT(), 2, {"layers.*.fc1": "sequence_parallel"})


@pytest.mark.parametrize("t, what", [(3, "heads = 4"), (8, "heads = 4")])
def test_not_divisible_is_named_error(t: int, what: str) -> None:
    with pytest.raises(TensorParallelPlanError, match=what):
        _tp(models.ToyGPT(), t, TOY_PLAN)


def test_vocab_not_divisible_is_named_error() -> None:
    with pytest.raises(TensorParallelPlanError, match=r"embed.weight \[96, 32\] along dim 0"):
        _tp(models.ToyGPT(), 5, {"embed": "embedding_rowwise"})


def test_error_leaves_model_unchanged() -> None:
    model = models.ToyGPT()
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(TensorParallelPlanError):
        _tp(model, 3, TOY_PLAN)
    assert model.layers[0].attn.heads == 4
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())


def test_derived_pairs_split_mlp_and_keep_attention_replicated() -> None:
    model = models.ToyGPT()
    tp = _tp(model, 2)
    assert tp.source == "derived"
    assert {(e.module, e.style) for e in tp.entries} == {
        *((f"layers.{i}.fc1", "colwise") for i in range(4)),
        *((f"layers.{i}.fc2", "rowwise") for i in range(4))}
    replicated = {r.module: r.reason for r in tp.replicated}
    assert "layers.0.attn.q" in replicated and "not proven safe" in replicated["layers.0.attn.q"]
    assert tp.heads == []  # the MLP's parent holds no head count


class GatedMLPBlock(nn.Module):
    """Llama-style gated MLP (two column Linears meeting in a product) beside a residual Linear."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, 32), nn.Linear(d, 32), nn.Linear(32, d)
        self.skip = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.skip(x) + self.down(nn.functional.silu(self.gate(x)) * self.up(x))


def test_derived_gated_pair_and_residual_linear() -> None:
    model = nn.Sequential(*(GatedMLPBlock() for _ in range(3)))
    tp = _tp(model, 2)
    assert {(e.module, e.style) for e in tp.entries if e.module.startswith("0.")} == {
        ("0.gate", "colwise"), ("0.up", "colwise"), ("0.down", "rowwise")}
    assert "0.skip" in {r.module for r in tp.replicated}


class FusedBlock(nn.Module):
    """The benchmarks' block: one fused qkv Linear reshaped with a head count, beside an MLP."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.heads = 4
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 64), nn.Linear(64, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        x = x + self.proj(nn.functional.scaled_dot_product_attention(q, k, v).reshape(b, t, d))
        return x + self.out(nn.functional.gelu(self.fc(x)))


@pytest.mark.parametrize("tp_plan", [None, {"*.fc": "colwise", "*.out": "rowwise"}])
def test_head_count_of_a_replicated_attention_is_kept(tp_plan: dict | None) -> None:
    # A regression: the MLP's parent also holds the attention's head count; rewriting it changed the model.
    model = nn.Sequential(*(FusedBlock() for _ in range(3)))
    tp = _tp(model, 2, tp_plan)
    split = {e.module for e in tp.entries}
    assert split >= {"0.fc", "0.out"} and "0.qkv" not in split
    assert tp.heads == []
    assert tp_plan is None or any("0.heads" in n and "kept" in n for n in tp.notes)


def test_tied_weights_split_differently_stay_replicated() -> None:
    model = models.ToyGPT(tie=True)
    tp = _tp(model, 2, {"head": "colwise", "layers.*.fc1": "colwise", "layers.*.fc2": "rowwise"})
    assert "head" in {r.module for r in tp.replicated}
    both = _tp(models.ToyGPT(tie=True), 2, {"head": "colwise_gather_output", "embed": "embedding_rowwise"})
    assert {e.module for e in both.entries} == {"head", "embed"}  # both split rows: the same slice


class UntraceableMatmulGPT(models.FunctionalTiedGPT):
    """The tied head as ``h @ W.t()`` through a local alias, in a method of a forward fx cannot trace (it
    compares the length with the positions'): read from their source."""

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if input_ids.shape[1] > self.pos.shape[0]:
            raise ValueError("the sequence is longer than the positions")
        x = self.embed(input_ids) + self.pos[: input_ids.shape[1]]
        for layer in self.layers:
            x = layer(x)
        logits = self._logits(self.ln_f(x))
        return logits if targets is None else models.lm_loss(logits, targets)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        embed = self.embed
        return h @ embed.weight.t()


def tied_logits(h: torch.Tensor, embedding: nn.Embedding) -> torch.Tensor:
    return F.linear(h, embedding.weight)


class HelperHeadGPT(UntraceableMatmulGPT):
    """The same head through a function given the embedding module: no read in the model's source to see."""

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return tied_logits(h, self.embed)


class FunctionalMLPBlock(models.Block):
    """A block whose forward applies ``fc1``'s weight itself (``F.linear``) instead of calling ``fc1``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(F.linear(self.ln2(x), self.fc1.weight, self.fc1.bias)))


def _functional_mlp_gpt() -> nn.Module:
    model = models.ToyGPT(n_layers=2)
    model.layers = nn.ModuleList(FunctionalMLPBlock() for _ in range(2))
    return model


_lines, _first = inspect.getsourcelines(UntraceableMatmulGPT._logits)
UNTRACEABLE_READ = _first + next(i for i, line in enumerate(_lines) if "weight.t()" in line)
NO_HEAD_PLAN = {k: v for k, v in TOY_PLAN.items() if k != "head"}


@pytest.mark.parametrize(("build", "kept", "why", "partner"), [
    (models.FunctionalTiedGPT, "embed", "the root's forward (FunctionalTiedGPT) reads embed.weight itself (fx: "
     "linear(...))", None),
    (UntraceableMatmulGPT, "embed", "the root's forward (UntraceableMatmulGPT) reads embed.weight itself "
     f"(UntraceableMatmulGPT._logits at test_tp_plan.py:{UNTRACEABLE_READ}, read from source: fx cannot trace "
     "it)", None),
    (_functional_mlp_gpt, "layers.0.fc1", "layers.0's forward reads layers.0.fc1.weight itself (fx: linear(...))",
     "layers.0.fc2"),
], ids=["root-F.linear", "root-untraceable-matmul", "block-F.linear"])
def test_a_split_weight_read_outside_its_module_stays_replicated(build, kept: str, why: str,
                                                                 partner: str | None) -> None:
    # Before: split, so that read saw this TP rank's slice only (the root's logits over half the vocabulary).
    tp = _tp(build(), 2, NO_HEAD_PLAN)
    reasons = {r.module: r.reason for r in tp.replicated}
    assert reasons[kept] == f"{why}, so split it would see this TP rank's slice only"
    assert f"{kept}.weight" not in tp.split_names() and "layers.1.attn.q.weight" in tp.split_names()
    if partner is not None:  # the row Linear its column partner feeds stays whole with it
        assert reasons[partner] == f"its column/row partner beside it, {kept!r}, is kept whole"
    assert f"  replicated {kept}: {why}" in "\n".join(tp_text(tp))


def test_a_split_weight_read_where_the_pass_cannot_see_is_refused_from_the_captured_graph() -> None:
    # fx cannot trace the root and its source reads no weight (a function given the module reads it): the
    # pass splits the embedding; the first call's export graph (here: example inputs) shows the root reads it.
    model = HelperHeadGPT()
    tp = _tp(model, 2, NO_HEAD_PLAN)
    assert "embed.weight" in tp.split_names()
    cap = passes.capture(model, passes.discover_blocks(model), (models.token_ids(),))
    assert cap.method == "export" and cap.readers["embed.weight"] == ["", "embed"]
    with pytest.raises(TensorParallelPlanError, match="embed.weight \\(split by 'embed'\\) is also read by the "
                       "root's forward .* Leave those modules out of tp_plan="):
        passes.check_captured_reads(model, tp, cap.readers)
    passes.check_captured_reads(model, _tp(models.ToyGPT(n_layers=2), 2, NO_HEAD_PLAN), {"embed.weight": ["embed"]})


def test_a_given_plan_splitting_a_weight_read_elsewhere_is_refused() -> None:
    # plan= skips the pass: a section made for a model whose head is an nn.Linear splits the embedding.
    with pytest.raises(TensorParallelPlanError, match="plan= splits 'embed' .* the root's forward "
                       "\\(FunctionalTiedGPT\\) reads embed.weight itself"):
        passes.refuse_outside_reads(models.FunctionalTiedGPT(), _tp(models.ToyGPT(n_layers=2), 2, NO_HEAD_PLAN))


def test_gpt2s_tied_lm_head_stays_split_with_its_embedding() -> None:
    # transformers' forwards are untraceable: read from source, GPT-2's calls lm_head and wte, never reads
    # their weight, so the tie (both split by vocabulary rows) stays split.
    tp = _tp(models.gpt2(), 2, {"transformer.wte": "embedding_rowwise", "lm_head": "colwise_gather_output"})
    assert {e.module for e in tp.entries} == {"transformer.wte", "lm_head"} and tp.replicated == []


class ScaledLinear(nn.Linear):
    """A Linear subclass with a forward of its own (a quantised or adapted layer): not split as a Linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


def test_unsplittable_module_keeps_its_partners_whole() -> None:
    model = models.ToyGPT()
    for layer in model.layers:
        layer.fc1 = ScaledLinear(layer.fc1.in_features, layer.fc1.out_features)
    tp = _tp(model, 2, {"layers.*.fc1": "colwise", "layers.*.fc2": "rowwise"})
    assert tp.entries == []
    reasons = {r.module: r.reason for r in tp.replicated}
    assert "needs an nn.Linear or transformers' Conv1D, this is ScaledLinear" in reasons["layers.0.fc1"]
    assert "a module beside it" in reasons["layers.0.fc2"]


def test_gpt2_conv1d_mlp_is_split_like_a_linear_pair_with_its_weight_transposed() -> None:
    # No tp plan in GPT-2's config: fx traces the MLP (the block and attention it cannot) and finds
    # c_fc -> gelu_new -> c_proj; a Conv1D's weight is [in, out], so column splits dim 1, row dim 0.
    model = models.gpt2()
    tp = _tp(model, 2)
    assert tp.source == "derived"
    entries = {e.module: e for e in tp.entries}
    assert set(entries) == {f"transformer.h.{i}.{n}" for i in range(2)
                            for n in ("mlp.c_fc", "mlp.c_proj", "attn.c_attn", "attn.c_proj")}
    fc, proj = entries["transformer.h.0.mlp.c_fc"], entries["transformer.h.0.mlp.c_proj"]
    assert (fc.style, fc.kind, fc.split_dims, fc.in_features, fc.out_features) == (
        "colwise", "conv1d", {"weight": 1, "bias": 0}, 32, 128)
    assert (proj.style, proj.split_dims, proj.in_features, proj.out_features) == (
        "rowwise", {"weight": 0}, 128, 32)
    shapes = tp.local_shapes()
    assert [shapes[f"transformer.h.0.mlp.{n}"] for n in ("c_fc.weight", "c_fc.bias", "c_proj.weight",
                                                         "c_proj.bias")] == [[32, 64], [64], [64, 32], [32]]
    assert fc.parts == 1 and tp.replicated == []
    # A user plan splits Conv1D wherever it would split a Linear.
    user = _tp(models.gpt2(), 2, {"transformer.h.*.mlp.c_fc": "colwise",
                                  "transformer.h.*.mlp.c_proj": "rowwise"})
    assert sorted((e.module, e.style, e.split_dims) for e in user.entries) == sorted(
        (e.module, e.style, e.split_dims) for e in tp.entries if ".mlp." in e.module)


class TwiceCalledMLP(nn.Module):
    """A column -> row pair whose row Linear is called a second time on a whole input: one split cannot
    serve both calls (split, the second call would get 64 features where its slice takes 32)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc, self.pre, self.out = nn.Linear(d, 64), nn.Linear(d, 64), nn.Linear(64, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(nn.functional.gelu(self.fc(x))) + self.out(self.pre(x))


def test_a_linear_called_twice_is_not_paired() -> None:
    tp = _tp(nn.Sequential(*(TwiceCalledMLP() for _ in range(3))), 2)
    assert tp.entries == []
    assert sorted(r.module for r in tp.replicated if r.module.startswith("0.")) == ["0.fc", "0.out", "0.pre"]


def test_plan_section_round_trips_and_shows() -> None:
    model = models.ToyGPT()
    discovery = passes.discover_blocks(model)
    tp = passes.plan_tensor_parallel(model, 2, discovery, TOY_PLAN)
    plan = passes.build_plan(model, discovery, world_size=2, tensor_parallel=tp)
    # ln1 whole, in the buffer sharded over shard x tp ranks (#38 item 5); split parameters in the other
    whole = [b for b in plan.group("layers.0").buffers if b.over_tp]
    assert len(whole) == 1 and [s.shape for s in whole[0].slots][:2] == [[32], [32]]
    assert all(s.fqn.startswith("layers.0.ln") or s.fqn.endswith((".o.bias", ".fc2.bias")) for s in whole[0].slots)
    q = next(s for _, s in plan.group("layers.0").slots() if s.fqn == "layers.0.attn.q.weight")
    assert q.shape == [16, 32]
    again = WrapPlan.from_json(plan.to_json())
    assert again.tensor_parallel == tp and again.groups == plan.groups
    text = str(plan)
    assert "tensor parallel: tp_size=2, plan from user" in text
    assert "heads layers.0.attn.heads: 4 -> 2" in text
    assert "TP 2 x DP 2" in text


def test_tp_traffic_estimate_counts_recompute() -> None:
    model = models.ToyGPT()
    discovery = passes.discover_blocks(model)
    tp = passes.plan_tensor_parallel(model, 2, discovery, TOY_PLAN)
    plan = passes.build_plan(model, discovery, world_size=1, tensor_parallel=tp)
    est = passes.estimate_tp(plan, 1, tokens=10)
    # Per layer: q,k,v,fc1 backward all-reduce of the input (d each), o and fc2 forward all-reduce (d) twice
    # (forward + recompute); embed one forward all-reduce; head: gather of its half + backward all-reduce;
    # the inputs' digest (one int64 per TP rank) once.
    d, v, per = 32, 96, 10 * 4
    layer = 4 * round(2 * per * d / 2) + 2 * 2 * round(2 * per * d / 2)
    digest = round(2 * 2 * 8 / 2)
    expected = 4 * layer + round(2 * per * d / 2) + per * v // 2 + round(2 * per * d / 2) + digest
    assert est.comm_tp == expected
    assert est.tp_size == 2 and est.world_size == 2
    assert plan.estimates["1"].comm_tp is None  # no batch shape, no guess


def test_cli_plan_tp_size(capsys: pytest.CaptureFixture[str]) -> None:
    from bmt_wrap.cli import main

    assert main(["plan", "tests/models.py:llama", "--world-size", "4", "--tp-size", "2",
                 "--input", "input_ids=int64[2,8]"]) == 0
    out = capsys.readouterr().out
    assert "N=4 TP 2 x DP 2" in out and "of which TP activations" in out
    assert "split model.layers.0.self_attn.o_proj: rowwise" in out
    assert main(["plan", "tests/models.py:llama", "--world-size", "6", "--tp-size", "4"]) == 2
    assert "--tp-size 4 must divide every --world-size" in capsys.readouterr().err
    assert main(["plan", "tests/models.py:llama", "--world-size", "4", "--tp-size", "4"]) == 1
    assert "num_key_value_heads = 2" in capsys.readouterr().err


GPT2_ATTN_PLAN = {"transformer.h.*.attn.c_attn": "colwise", "transformer.h.*.attn.c_proj": "rowwise"}


def _gpt2_attention_entries(tp) -> dict:
    return {e.module: e for e in tp.entries if ".attn." in e.module}


def test_gpt2_attention_is_split_like_megatrons_fused_qkv() -> None:
    # No tp plan in GPT-2's config, and fx cannot trace GPT2Attention: its forward is known
    # (passes.FUSED_ATTENTIONS). c_attn's outputs are q, k, v of split_size each: a strided column split
    # (each rank its heads' slice of each block), c_proj by rows (its input is the heads, concatenated),
    # and the split size and head count GPT2Attention reshapes with become this rank's.
    tp = _tp(models.gpt2(), 2)
    attn = _gpt2_attention_entries(tp)
    qkv, proj = attn["transformer.h.0.attn.c_attn"], attn["transformer.h.0.attn.c_proj"]
    assert (qkv.style, qkv.kind, qkv.split_dims, qkv.parts, qkv.out_features) == (
        "colwise", "conv1d", {"weight": 1, "bias": 0}, 3, 96)
    assert (proj.style, proj.split_dims, proj.parts) == ("rowwise", {"weight": 0}, 1)
    shapes = tp.local_shapes()
    assert shapes["transformer.h.1.attn.c_attn.weight"] == [32, 48] and shapes["transformer.h.1.attn.c_attn.bias"] == [48]
    assert shapes["transformer.h.1.attn.c_proj.weight"] == [16, 32] and shapes["transformer.h.1.attn.c_proj.bias"] == [32]
    assert {(h.module, h.attribute, h.full, h.local) for h in tp.heads} == {
        (f"transformer.h.{i}.attn", a, 32 if a == "split_size" else 4, 16 if a == "split_size" else 2)
        for i in range(2) for a in ("split_size", "num_heads")}
    again = TensorParallelPlan.from_dict(json.loads(json.dumps(dataclasses.asdict(tp))))
    assert again == tp  # parts survive the plan's JSON
    assert "split transformer.h.0.attn.c_attn: colwise (strided: each of 3 fused blocks cut)" in "\n".join(tp_text(tp))


GPT2_ATTN_PLAN = {"transformer.h.*.attn.c_attn": "colwise", "transformer.h.*.attn.c_proj": "rowwise"}


def test_a_user_plan_splitting_gpt2s_fused_qkv_splits_it_strided() -> None:
    # Before: refused with "a column split would give each TP rank whole parts instead of a slice of each".
    tp = _tp(models.gpt2(), 2, GPT2_ATTN_PLAN)
    assert tp.source == "user"
    assert {(m, e.parts) for m, e in _gpt2_attention_entries(tp).items()} == {
        (f"transformer.h.{i}.attn.{n}", 3 if n == "c_attn" else 1) for i in range(2) for n in ("c_attn", "c_proj")}
    assert sorted(h.attribute for h in tp.heads) == ["num_heads", "num_heads", "split_size", "split_size"]


def test_a_fused_qkv_split_beside_a_whole_output_projection_is_named_error() -> None:
    model = models.gpt2()
    with pytest.raises(TensorParallelPlanError) as info:
        _tp(model, 2, {"transformer.h.*.attn.c_attn": "colwise"})
    message = str(info.value)
    assert "transformer.h.0.attn.c_attn (a fused q/k/v" in message and "'transformer.h.0.attn.c_proj'" in message
    assert "split it rowwise too" in message
    assert type(model.transformer.h[0].attn.c_attn.weight) is nn.Parameter  # raised before any change


@pytest.mark.parametrize("plan", [None, GPT2_ATTN_PLAN])
def test_gpt2_heads_not_divisible_by_tp_size_is_named_error(plan: dict | None) -> None:
    # 4 heads of width 8 over 8 ranks: 32 features divide, the heads do not (each rank computes whole heads).
    with pytest.raises(TensorParallelPlanError, match="transformer.h.0.attn.num_heads = 4") as info:
        _tp(models.gpt2(), 8, plan)
    assert "tp_size=8" in str(info.value)


def test_a_models_own_plan_splitting_a_fused_qkv_splits_it_strided() -> None:
    model = models.gpt2()
    model._tp_plan = {**GPT2_ATTN_PLAN, "transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"}
    tp = _tp(model, 2)
    assert tp.source == "transformers" and tp.replicated == []
    assert sorted((e.module, e.parts) for e in tp.entries) == sorted(
        (f"transformer.h.{i}.{n}", 3 if n == "attn.c_attn" else 1) for i in range(2)
        for n in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))
    assert len(tp.heads) == 4


