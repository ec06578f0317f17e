"""The experts pass (passes/experts.py, pure, one process): mixture-of-experts layers found by structure in
transformers' MoE families from their default configs shrunk, their placement over EP ranks, what stays
dense and why, the plan section, ``bmt-wrap plan --ep-size`` and the pass's errors."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
from torch import nn

from bmt_wrap.cli import main
from bmt_wrap.errors import ExpertParallelError
from bmt_wrap.passes import plan_experts
from bmt_wrap.plan import WrapPlan
from tests import models

# family -> (MoE layer modules, their router child, dense children beside the experts)
FAMILIES = {
    "mixtral": (["model.layers.0.mlp", "model.layers.1.mlp"], "gate", []),
    "qwen3_moe": (["model.layers.0.mlp", "model.layers.1.mlp"], "gate", []),
    "qwen2_moe": (["model.layers.0.mlp", "model.layers.1.mlp"], "gate", ["shared_expert", "shared_expert_gate"]),
    "deepseek_v3": (["model.layers.1.mlp"], "gate", ["shared_experts"]),  # layer 0 is a dense MLP
    "gpt_oss": (["model.layers.0.mlp", "model.layers.1.mlp"], "router", []),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_transformers_moe_layers_are_found_and_placed(family: str) -> None:
    model = getattr(models, family)()
    modules, router, dense = FAMILIES[family]
    section = plan_experts(model, ep_size=2)
    assert [la.module for la in section.layers] == modules and not section.dense
    for layer in section.layers:
        experts = model.get_submodule(layer.experts)
        assert layer.router == f"{layer.module}.{router}" and layer.experts == f"{layer.module}.experts"
        assert (layer.layout, layer.num_experts, layer.top_k) == ("packed", 4, 2)
        assert layer.hidden == models.DIM and layer.activation_dtype == "float32"
        assert layer.dense == [f"{layer.module}.{d}" for d in dense]
        assert layer.params == {f"{layer.experts}.{n}": list(p.shape) for n, p in experts.named_parameters()}
        assert all(s[0] == 4 for s in layer.params.values())
        assert layer.expert_bytes == sum(p.numel() * 4 for p in experts.parameters())
        assert [list(layer.owned(r, 2)) for r in range(2)] == [[0, 1], [2, 3]]
    # The probe ran on a meta copy: the model is untouched (no hooks left, weights where they were).
    assert all(not m._forward_pre_hooks for m in model.modules())
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_plan_section_prints_and_round_trips() -> None:
    section = plan_experts(models.qwen2_moe(), ep_size=2)
    plan = WrapPlan(groups=[], experts=section)
    text = str(plan)
    assert "experts: 2 mixture-of-experts layer(s), ep_size=2" in text
    assert ("model.layers.0.mlp: router model.layers.0.mlp.gate picks 2 of 4 experts in model.layers.0.mlp.experts"
            in text)
    assert "ep rank 0: experts 0-1; ep rank 1: experts 2-3" in text
    assert "dense beside them: model.layers.0.mlp.shared_expert, model.layers.0.mlp.shared_expert_gate" in text
    again = WrapPlan.from_json(plan.to_json())
    assert again.experts == section and str(again) == text
    # ep_capacity_factor= is the section's: printed with its rule, kept by the JSON; capacity per rank's call
    capped = replace(section, capacity_factor=1.25)
    assert "capacity factor 1.25 (each expert takes at most ceil(1.25 x tokens x k / experts)" in str(
        WrapPlan(groups=[], experts=capped))
    assert WrapPlan.from_json(WrapPlan(groups=[], experts=capped).to_json()).experts == capped
    layer = section.layers[0]  # top-2 of 4: 10 tokens' 20 pairs, 5 an expert on average
    assert capped.capacity(layer, 10) == 7 and section.capacity(layer, 10) is None


def test_a_router_that_hands_a_dispatch_mask_stays_dense() -> None:
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    cfg = SwitchTransformersConfig(vocab_size=models.VOCAB, d_model=models.DIM, d_kv=8, d_ff=64, num_layers=2,
                                   num_decoder_layers=2, num_heads=4, num_experts=4, num_sparse_encoder_layers=1,
                                   num_sparse_decoder_layers=1)
    model = models.seeded(lambda: SwitchTransformersForConditionalGeneration(cfg))
    section = plan_experts(model)
    assert not section.layers and section.dense
    for d in section.dense:  # the router passes a one-hot [tokens, 1, experts] mask, not top-k indices
        assert d.module.endswith("mlp") and "not top-k expert indices" in d.reason, d
    text = str(WrapPlan(groups=[], experts=section))
    assert f"{len(section.dense)} left dense" in text and f"  dense {section.dense[0].module}: " in text
    with pytest.raises(ExpertParallelError, match="no mixture-of-experts layer was found.*left dense: .*mlp"):
        plan_experts(model, ep_size=2)


def test_a_list_of_expert_mlps_is_found() -> None:
    model = nn.Sequential(nn.Linear(8, 8), models.ListMoE(8))
    (layer,) = plan_experts(model, ep_size=4).layers
    assert (layer.module, layer.layout, layer.num_experts, layer.top_k) == ("1", "list", 4, 2)
    assert layer.params == {"1.experts.*.0.weight": [4, 16, 8], "1.experts.*.0.bias": [4, 16],
                            "1.experts.*.2.weight": [4, 8, 16], "1.experts.*.2.bias": [4, 8]}


def test_ep_size_errors_name_the_fix() -> None:
    with pytest.raises(ExpertParallelError, match=r"ep_size=3 does not divide the experts of .*model.layers.0.mlp "
                                                  r"\(4\).*ep_size in \[2, 4\]"):
        plan_experts(models.mixtral(), ep_size=3)
    # a suggestion also divides the ranks EP borrows from: 4 would not divide 6 ranks
    with pytest.raises(ExpertParallelError, match=r"\(4\): .*ep_size in \[2\] \(they divide every layer's experts "
                                                  r"and the 6 ranks it borrows from\)"):
        plan_experts(models.mixtral(), ep_size=3, shard_size=6)
    with pytest.raises(ExpertParallelError, match="no mixture-of-experts layer was found in LlamaForCausalLM"):
        plan_experts(models.llama(), ep_size=2)
    with pytest.raises(ExpertParallelError, match="positive int"):
        plan_experts(models.mixtral(), ep_size=0)
    tied = models.mixtral()
    tied.model.layers[1].mlp.experts.down_proj = tied.model.layers[0].mlp.experts.down_proj
    plain = plan_experts(tied)  # without EP a shared expert weight is only a layer left dense, with why
    assert [d.module for d in plain.dense] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert "is the same Parameter as 'model.layers.1.mlp.experts.down_proj'" in plain.dense[0].reason
    with pytest.raises(ExpertParallelError, match=r"model.layers.0.mlp.experts.down_proj is the same Parameter as "
                                                  r"'model.layers.1.mlp.experts.down_proj'.*Untie it"):
        plan_experts(tied, ep_size=2)


def test_cli_plan_prints_expert_bytes_and_all_to_all(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "tests/models.py:mixtral", "--world-size", "2", "4", "--ep-size", "2",
                 "--input", "input_ids=int64[2,16]"]) == 0
    out = capsys.readouterr().out
    model = models.mixtral()
    experts = [model.get_submodule(f"model.layers.{i}.mlp.experts") for i in range(2)]
    total = sum(p.numel() * 4 for e in experts for p in e.parameters())
    # 32 tokens x top-2 x 32 wide x 4 bytes, half to the other EP rank; dispatch and combine in forward,
    # backward and the checkpointed blocks' recompute; two layers.
    a2a = 32 * 2 * models.DIM * 4 // 2 * 6 * 2

    def row(label: str) -> list[str]:
        line = next(x for x in out.splitlines() if x.startswith(label))
        return re.split(r"\s{2,}", line[len(label):].strip())

    kib = lambda n: f"{n / 1024:.2f} KiB"  # noqa: E731
    assert row("expert bytes per rank (EP)") == [kib(total / 2), kib(total / 4)]
    assert row("all-to-all / step (EP)") == [kib(a2a), kib(a2a)]
    assert row("experts' ZeRO among owners / step (EP)") == ["0 B", kib(3 * total / 4)]
    assert row("experts' ZeRO-3 gathers / step (no EP)") == [kib(3 * total / 2), kib(3 * total / 4 * 3)]
    assert "ep rank 1: experts 2-3" in out


def test_cli_plan_ep_with_tp_shards_experts_over_their_owners_and_splits_attention(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "tests/models.py:mixtral", "--world-size", "4", "8", "--ep-size", "2", "--tp-size", "2",
                 "--input", "input_ids=int64[2,16]"]) == 0
    out = capsys.readouterr().out
    model = models.mixtral()
    total = plan_experts(model, ep_size=2).expert_bytes()
    every = sum(p.numel() * 4 for p in model.parameters())
    kib = lambda n: f"{n / 1024:.2f} KiB"  # noqa: E731

    def row(label: str) -> list[str]:
        line = next(x for x in out.splitlines() if x.strip().startswith(label))
        return re.split(r"\s{2,}", line.strip()[len(label):].strip())

    # Attention split over the 2 TP peers, experts over the 2 EP ranks; the N / 2 owners of an EP rank's
    # experts are its TP peers too (mesh.expert_shard_group), so each rank holds 1/N of every parameter.
    assert "split model.layers.0.self_attn.q_proj: colwise" in out and "parameters per TP and EP rank" in out
    for got, n in zip(row("parameters (shard)"), (4, 8), strict=True):
        assert abs(float(got.split()[0]) * 1024 - every / n) <= 0.03 * every / n, (got, n)
    assert row("expert bytes per rank (EP)") == [kib(total / 4), kib(total / 8)]
    # each TP rank routes its data-parallel slice's 32 tokens within its EP group: as without TP
    assert row("all-to-all / step (EP)") == [kib(32 * 2 * models.DIM * 4 // 2 * 6 * 2)] * 2
    assert row("experts' ZeRO among owners / step (EP)") == [kib(3 * total / 4), kib(3 * total / 8 * 3)]
    # what the wrapper refuses is refused naming the fix
    for extra, says in ((["--world-size", "4", "--ep-size", "4"], "--ep-size 4 must divide every --world-size's "
                         "data-parallel ranks (N / --tp-size 2); [4] do not"),
                        (["--world-size", "4", "--ep-size", "2", "--sequence-parallel"], "drop --shard-size, "
                         "--pp-size and --sequence-parallel"),
                        (["--world-size", "4", "--ep-size", "4", "--memory", "1GiB", "--baseline", "0", "--input",
                          "input_ids=int64[2,16]"], "--ep-size 4 must divide the 2 data-parallel ranks of "
                                                    "--world-size 4 / --tp-size 2")):
        assert main(["plan", "tests/models.py:mixtral", "--tp-size", "2", *extra]) == 2
        assert says in capsys.readouterr().err


def test_the_plan_lays_experts_out_in_local_shapes_sharded_over_their_owners() -> None:
    from bmt_wrap.passes import build_plan, discover_blocks

    model = models.mixtral()
    experts = plan_experts(model, ep_size=2)
    total = experts.expert_bytes()
    dense = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." not in n)
    for world in (2, 4):  # ep2 alone, then ep2 x dp2: each expert shard is split over world / 2 owners
        plan = build_plan(model, discover_blocks(model), world_size=world, experts=experts)
        bufs = [b for g in plan.groups for b in g.buffers if b.ep_split]
        assert {s.fqn: s.shape for b in bufs for s in b.slots} == experts.local_shapes()
        assert all(b.ep_split == 2 and b.ranks(world, 1) == world // 2 for b in bufs)
        assert {s[0] for s in experts.local_shapes().values()} == {2}
        shard = plan.estimates[str(world)].params
        # every rank: 1/world of the dense parameters and 1/world of all experts (half of them, over world/2)
        assert abs(shard - (dense + total) / world) <= 0.02 * shard, (shard, dense, total)
        assert plan.experts is experts or plan.experts == experts


def _memory_answer(capsys: pytest.CaptureFixture[str], *extra: str, world: int = 4,
                   factory: str = "tests/models.py:mixtral") -> dict:
    import json

    assert main(["plan", factory, "--world-size", str(world), "--baseline", "100MiB", "--json",
                 "--prefetch-depth", "1", "--input", "input_ids=int64[2,16]", "--input", "labels=int64[2,16]",
                 *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_memory_counts_each_ranks_experts_and_the_all_to_all_buffers(capsys: pytest.CaptureFixture[str]) -> None:
    dense = _memory_answer(capsys, "--memory", "1GiB")
    model = models.mixtral()
    layer = sum(p.numel() * 4 for p in model.model.layers[0].mlp.experts.parameters())  # one block's experts
    rows = 4 * (2 * 16) * 2 * models.DIM * 4  # 32 tokens x top-2 x 32 wide x fp32: sent, received, twice
    for ep in (2, 4):
        got = _memory_answer(capsys, "--memory", "1GiB", "--ep-size", str(ep))
        assert got["ep_size"] == ep and got["all_to_all_buffers"] == rows
        # Shards, gradient shards and Adam state of the experts are 1/4 of them per rank with or without EP (each
        # EP rank's experts over the 4/ep ranks owning them); what shrinks is each block's gathered experts:
        # the pool's prefetch depth + 2 buffers of a block and its one gradient in flight, to 1/ep of them.
        saved = layer * (1 - 1 / ep)
        phases, before = got["training_phases"], dense["training_phases"]
        assert before["backward start"] - phases["backward start"] == 3 * saved
        assert before["blocks' backward end"] - phases["blocks' backward end"] == 4 * saved - rows
        assert got["peak_per_rank"] < dense["peak_per_rank"] and got["fits"]
    grown = _memory_answer(capsys, "--memory", "420MiB", "--grow", "num_hidden_layers", "--ep-size", "2")
    assert grown["layers"] >= 2 and grown["fits"] and grown["peak_per_rank"] <= grown["limit_per_rank"]
    assert grown["all_to_all_buffers"] == rows  # and the count keeps its 4% margin (capacity.MARGIN)
    assert grown["peak_per_rank"] == grown["counted_per_rank"] + round(0.04 * grown["counted_per_rank"])
    assert main(["plan", "tests/models.py:mixtral", "--world-size", "2", "--memory", "1GiB", "--baseline", "0",
                 "--ep-size", "2", "--input", f"inputs_embeds=float32[2,16,{models.DIM}]"]) != 0
    assert "give the token ids in --input" in capsys.readouterr().err


def test_plan_memory_under_tp_counts_the_split_layout_and_the_model_as_built(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    model = models.mixtral()
    full = sum(p.numel() * 4 for p in model.parameters())
    # Mixtral's TP plan: q, k, v columns and o rows of every attention, the embedding's rows, the head's columns
    attention = sum(p.numel() * 4 for p in model.model.layers[0].self_attn.parameters())
    head = model.lm_head.weight.numel() * 4
    root = model.model.embed_tokens.weight.numel() * 4 + head
    for world, ep in ((2, ()), (4, ("--ep-size", "2"))):  # tp2 alone, then ep2 with tp2
        plain = _memory_answer(capsys, "--memory", "1GiB", *ep, world=world)
        split = _memory_answer(capsys, "--memory", "1GiB", "--tp-size", "2", *ep, world=world)
        assert split["tp_size"] == 2 and split["fits"]
        # Each TP rank routes its data-parallel slice's tokens: the same all-to-all buffers as without TP.
        assert split["all_to_all_buffers"] == plain["all_to_all_buffers"] == (4 * 32 * 2 * models.DIM * 4 if ep
                                                                              else None)
        # Each rank holds 1/world of every parameter (and of every expert) with or without TP; TP halves what a
        # rank gathers of each attention (the pool's prefetch depth + 2 block buffers), of the root's embedding
        # and head, and the head's gradient, the root's first in backward.
        before, after = plain["training_phases"], split["training_phases"]
        assert before["backward start"] - after["backward start"] == 3 * attention / 2 + root / 2 + head / 2
        # The model is built whole on every rank before TP (and EP) cut it: wrapping holds it all at least.
        assert split["wrapping"] >= full
    # --grow under ep2 with tp2: the answer fits, and the CLI reports one layer more beyond the limit.
    grown = _memory_answer(capsys, "--memory", "420MiB", "--grow", "num_hidden_layers", "--tp-size", "2",
                           "--ep-size", "2")
    k = grown["layers"]
    assert k >= 2 and grown["fits"] and grown["peak_per_rank"] <= grown["limit_per_rank"]
    (tmp_path / "above.py").write_text(f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                                       f"from models import mixtral\n\n\ndef build():\n    return mixtral({k + 1})\n")
    above = _memory_answer(capsys, "--memory", "420MiB", "--tp-size", "2", "--ep-size", "2",
                           factory=f"{tmp_path / 'above.py'}:build")
    assert not above["fits"] and above["peak_per_rank"] > grown["limit_per_rank"] >= grown["peak_per_rank"]


def test_memory_budget_counts_the_all_to_all_buffers_under_ep() -> None:
    import torch

    from bmt_wrap.errors import MemoryBudgetError
    from bmt_wrap.passes import build_plan, capture, discover_blocks
    from bmt_wrap.passes.capacity import training_peak

    model = models.mixtral()
    experts, blocks = plan_experts(model, ep_size=2), discover_blocks(model)
    ids = torch.zeros(2, 16, dtype=torch.long)
    cap = capture(model, blocks, {"input_ids": ids, "labels": ids})
    plan = build_plan(model, blocks, world_size=2, capture=cap, experts=experts)
    est = plan.estimates["2"]
    # one MoE layer's (token, expert) rows of 32 tokens x top-2 x 32 wide x fp32: sent and received, twice
    assert est.exchange == experts.exchange_bytes(32) == 4 * 32 * 2 * models.DIM * 4
    assert training_peak(plan, replace(est, exchange=0)) < est.peak  # they are held at the step's peak
    # memory_budget= fits the same count: a budget one byte below the least schedule's peak is refused
    with pytest.raises(MemoryBudgetError, match=f"needs at least {est.peak} B"):
        build_plan(model, blocks, world_size=2, capture=cap, experts=experts, memory_budget=est.peak - 1)
    fitted = build_plan(model, blocks, world_size=2, capture=cap, experts=experts, memory_budget=est.peak)
    assert fitted.estimates["2"].exchange == est.exchange and fitted.estimates["2"].peak <= est.peak
    # without token ids the buffers are not counted, and the plan says so
    embeds = capture(model, blocks, {"inputs_embeds": torch.zeros(2, 16, models.DIM)})
    blind = build_plan(model, blocks, world_size=2, capture=embeds, experts=experts)
    assert blind.estimates["2"].exchange == 0
    assert any("all-to-all buffers are not counted: the inputs hold no token ids" in n for n in blind.notes)
