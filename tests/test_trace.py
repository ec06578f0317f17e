"""Capture: the cheapest working method per model family, block call order, and activation bytes."""

from __future__ import annotations

import functools

import models as M
import pytest
import torch
from torch import nn

from bmt_wrap.passes import (
    CAPTURE_METHODS,
    Capture,
    EagerRecorder,
    capture,
    discover_blocks,
    eager_capture,
    meta_skeleton,
)

ALL = {**M.TOY, **M.HF}


@functools.cache
def captured(name: str, with_inputs: bool) -> Capture:
    factory, inputs, _ = ALL[name]
    model = factory()
    return capture(model, discover_blocks(model), inputs() if with_inputs else None)


def block_calls(c: Capture) -> list[str]:
    return [str(n.target) for n in c.graph.nodes if n.op == "call_module" and n.target in set(c.order)]


@pytest.mark.parametrize("name", list(M.TOY))
def test_toy_models_capture_with_fx_without_inputs(name: str) -> None:
    c = captured(name, False)
    assert c.method == "fx" and c.method in CAPTURE_METHODS
    if name != "shared_layer":  # called twice: see test_shared_layer_is_called_twice
        assert c.order == ALL[name][2]
    assert block_calls(c) == c.order
    assert c.activations is None


@pytest.mark.parametrize("name", list(M.HF))
def test_transformers_models_fall_through_fx_to_export(name: str) -> None:
    without = captured(name, False)
    assert without.method == "none"
    assert any(n.startswith("fx.symbolic_trace failed") for n in without.notes)
    assert without.order == ALL[name][2]  # module order until inputs are known
    c = captured(name, True)
    assert c.method == "export"
    assert c.order == ALL[name][2]
    assert block_calls(c) == c.order, "one call_module node per block call"
    assert c.activations is not None and [a.block for a in c.activations.calls] == c.order


def test_shared_layer_is_called_twice() -> None:
    order = ["layers.0", "layers.1", "layers.2", "layers.3", "layers.0"]
    assert captured("shared_layer", False).order == order
    model = M.SharedLayerGPT()
    exported = capture(model, discover_blocks(model), torch.zeros(1, 8, dtype=torch.long))
    assert exported.method == "fx" and exported.order == order
    assert [a.block for a in exported.activations.calls] == order  # export tells the two calls apart


def _depends(node: torch.fx.Node, on: torch.fx.Node) -> bool:
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n is on:
            return True
        if n not in seen:
            seen.add(n)
            todo += n.all_input_nodes
    return False


def test_export_graph_keeps_root_code_and_only_root_parameters() -> None:
    c = captured("gpt2", True)
    attrs = {str(n.target) for n in c.graph.nodes if n.op == "get_attr"}
    assert {"transformer.wpe.weight", "transformer.ln_f.weight"} <= attrs
    assert {"transformer.wte.weight", "lm_head.weight"} & attrs, "the tied embedding is used by root code"
    assert not any(a.startswith("transformer.h.") for a in attrs), "block parameters stay inside block calls"
    first, second = (n for n in c.graph.nodes if n.op == "call_module")
    assert _depends(second, first) and not _depends(first, second), "data flows from block 0 to block 1"
    assert [n.name for n in c.graph.nodes if n.op == "placeholder"] == ["input_ids"]


class NoFx(M.ToyGPT):
    """fx cannot trace ``int(proxy)``; export and a meta run can."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        steps = int(input_ids.shape[1])
        x = self.embed(input_ids) + self.pos[:steps]
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class ExportRefuses(NoFx):
    """Raises under torch.export; a plain (meta) run works."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if torch.compiler.is_exporting():
            raise RuntimeError("not exportable")
        return super().forward(input_ids)


class DataDependent(NoFx):
    """Branches on a value: no fx, no export, no meta run; only a real call tells the order."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x = self.embed(input_ids)
        layers = self.layers if input_ids.sum().item() >= 0 else reversed(self.layers)
        for layer in layers:
            x = layer(x)
        return x


def test_capture_falls_through_every_method_without_raising() -> None:
    ids = torch.zeros(2, 8, dtype=torch.long)
    order = [f"layers.{i}" for i in range(4)]
    for cls, method in ((NoFx, "export"), (ExportRefuses, "eager"), (DataDependent, "none")):
        model = cls()
        d = discover_blocks(model)
        c = capture(model, d, ids)
        assert c.method == method, (cls.__name__, c.notes)
        assert c.order == order
        assert any("fx.symbolic_trace failed" in n for n in c.notes)
    assert any("torch.export failed" in n for n in c.notes) and any("meta run failed" in n for n in c.notes)
    # The wrapper records the first real call instead.
    with EagerRecorder(model, d) as recorder:
        model(ids)
    eager = eager_capture(recorder, c.notes)
    assert eager.method == "eager" and eager.order == order
    assert not model.layers[0]._forward_pre_hooks, "hooks are removed"


def test_eager_recorder_sees_every_call_of_a_shared_layer() -> None:
    model = M.SharedLayerGPT()
    d = discover_blocks(model)
    with EagerRecorder(model, d) as recorder:
        model(torch.zeros(1, 8, dtype=torch.long))
    assert recorder.order == ["layers.0", "layers.1", "layers.2", "layers.3", "layers.0"]


def test_meta_skeleton_copies_structure_not_storage() -> None:
    model = M.ToyGPT(tie=True)
    model.cache = torch.ones(3)  # a plain tensor attribute
    before = {n: p.clone() for n, p in model.named_parameters()}
    skeleton = meta_skeleton(model)
    assert all(p.is_meta for p in skeleton.parameters())
    assert skeleton.cache.is_meta and not model.cache.is_meta
    assert skeleton.head.weight is skeleton.embed.weight, "ties survive"
    assert all(torch.equal(p, before[n]) and not p.is_meta for n, p in model.named_parameters())
    assert meta_skeleton(skeleton) is skeleton


def test_capture_never_runs_real_compute() -> None:
    model = M.ToyGPT()
    calls = []
    model.layers[0].register_forward_hook(lambda m, a, out: calls.append(out.device.type))
    capture(model, discover_blocks(model), torch.zeros(2, 8, dtype=torch.long))
    assert set(calls) <= {"meta"}, "only meta tensors flow through the model during capture"


def test_activations_scale_with_batch_and_checkpointing_saves_memory() -> None:
    model = M.ToyGPT()
    d = discover_blocks(model)
    small = capture(model, d, torch.zeros(2, 16, dtype=torch.long)).activations
    large = capture(model, d, torch.zeros(4, 16, dtype=torch.long)).activations
    assert small is not None and large is not None
    blocks = set(d.fqns())
    for a in (small, large):
        assert a.total(blocks) < a.total(set())
        assert all(c.input_bytes == 2 * 16 * 32 * 4 * (1 if a is small else 2) for c in a.calls)  # [B, T, D] fp32
    assert large.total(set()) == 2 * small.total(set())
    assert large.total(blocks) == 2 * small.total(blocks)


def test_attention_counted_as_a_fused_kernel_not_as_score_matrices() -> None:
    # Meta attention falls back to the math kernel (L x L fp32 scores); the estimate must not grow as L^2.
    model = M.llama()
    d = discover_blocks(model)
    short = capture(model, d, {"input_ids": torch.zeros(1, 32, dtype=torch.long)}).activations
    long = capture(model, d, {"input_ids": torch.zeros(1, 64, dtype=torch.long)}).activations
    assert long.calls[0].saved_bytes == 2 * short.calls[0].saved_bytes


def test_capture_of_t5_without_decoder_inputs_does_not_raise() -> None:
    model = M.t5()
    c = capture(model, discover_blocks(model), {"input_ids": torch.zeros(1, 8, dtype=torch.long)})
    assert c.method in ("eager", "none")
    assert any("torch.export failed" in n for n in c.notes)


def test_unexported_kv_cache_outputs_are_dropped() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    model = M.seeded(lambda: LlamaForCausalLM(LlamaConfig(**{**M._hf_small(), "use_cache": True})))
    c = capture(model, discover_blocks(model), {"input_ids": torch.zeros(1, 8, dtype=torch.long)})
    assert c.method == "export", c.notes


def test_model_returning_a_dict_is_exported() -> None:
    class DictOut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = M.ToyGPT()

        def forward(self, ids: torch.Tensor) -> dict[str, object]:
            return {"logits": self.body(ids), "note": "hello", "n": ids.shape[0]}

    model = DictOut()
    d = discover_blocks(model)
    c = capture(model, d, (torch.zeros(1, 8, dtype=torch.long),))
    assert c.activations is not None and len(c.activations.calls) == 4
