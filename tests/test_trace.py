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


def _kept_by_an_eager_call(model: nn.Module, kwargs: dict[str, torch.Tensor]) -> tuple[int, list[tuple[int, int]]]:
    """What a real call of a transformers causal LM keeps, as the profile counts it: the bytes autograd saves
    outside the layers, and per layer call the tensors entering it (all a checkpointed call keeps) and those
    autograd saves inside it, each storage counted once among the inputs and once among the saved, for its
    first holder, parameters and buffers never."""
    state = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    entered: set[int] = set()
    saved: set[int] = set()
    calls: list[list[int]] = []
    current: list[int | None] = [None]
    root = [0]

    def first(t: torch.Tensor, seen: set[int]) -> int:
        ptr = t.untyped_storage().data_ptr()
        if ptr in state or ptr in seen:
            return 0
        seen.add(ptr)
        return t.untyped_storage().nbytes()

    def enter(m: nn.Module, args: tuple, kw: dict) -> None:
        calls.append([sum(first(t, entered) for t in torch.utils._pytree.tree_leaves((args, kw))
                          if isinstance(t, torch.Tensor)), 0])
        current[0] = len(calls) - 1

    def pack(t: torch.Tensor) -> torch.Tensor:
        if current[0] is None:
            root[0] += first(t, saved)
        else:
            calls[current[0]][1] += first(t, saved)
        return t

    layers = model.model.layers
    hooks = [layer.register_forward_pre_hook(enter, with_kwargs=True) for layer in layers]
    hooks += [layer.register_forward_hook(lambda *a: current.__setitem__(0, None)) for layer in layers]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(**kwargs)
    finally:
        for h in hooks:
            h.remove()
    del out
    return root[0], [(a, b) for a, b in calls]


@pytest.mark.parametrize("padded", [False, True])
def test_llama_activations_are_what_an_eager_call_keeps(padded: bool) -> None:
    # Export makes transformers build its [B, 1, S, S] causal mask, which an eager call without padding leaves
    # to SDPA's is_causal (and then runs grouped-query attention without repeating K/V); with padding the
    # eager call builds it too, and CPU SDPA saves a float copy of it. SDPA's output comes back in the fused
    # kernels' [B, S, H, D] layout, so the transpose after it copies nothing. At 256 tokens of width 32 the
    # mask is twice a layer's hidden states: each of these shows.
    model, seq = M.llama(), 256
    ids = torch.randint(0, M.VOCAB, (1, seq), generator=torch.Generator().manual_seed(0))
    kwargs = {"input_ids": ids, "labels": ids}
    if padded:
        kwargs["attention_mask"] = (torch.arange(seq) < seq - 7).long().unsqueeze(0)
    root, calls = _kept_by_an_eager_call(model, kwargs)
    profile = capture(model, discover_blocks(model), kwargs).activations
    assert profile is not None
    assert profile.root_bytes == root
    assert [c.saved_bytes for c in profile.calls] == [saved for _, saved in calls]
    # The layers also receive position_ids (int64, 8 bytes a token), which the exported graph's layers never read.
    assert [c.input_bytes for c in profile.calls] == [entered - (8 * seq if i == 0 else 0)
                                                      for i, (entered, _) in enumerate(calls)]


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
