"""init_parameters on meta-device models: the values construction would have given, shard by shard;
and a meta model + bmt.load needs no init (lost non-persistent buffers rebuilt)."""

from __future__ import annotations

from pathlib import Path

import models
import pytest
import torch
from dist_harness import run_distributed
from parity import whole
from torch import nn

import bmt_wrap as bmt
from bmt_wrap.errors import InitError


def _builders() -> dict:
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        LlamaConfig,
        LlamaForCausalLM,
        T5Config,
        T5ForConditionalGeneration,
    )

    return {
        "llama": lambda: LlamaForCausalLM(LlamaConfig(**models._hf_small())),
        "bert": lambda: BertForSequenceClassification(BertConfig(
            vocab_size=models.VOCAB, hidden_size=models.DIM, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=64, num_labels=3)),
        "t5": lambda: T5ForConditionalGeneration(T5Config(
            vocab_size=models.VOCAB, d_model=models.DIM, d_kv=8, d_ff=64, num_layers=3, num_decoder_layers=3,
            num_heads=4, decoder_start_token_id=0)),
        "classifier": models.Classifier,
        "sequential": models.SequentialGPT,
        "resnet_stage": models.ResNetStage,
        "tied_gpt": lambda: _TiedGPT(),
    }


class _TiedGPT(nn.Module):
    """Every parameter set by reset_parameters; the head tied to the embedding after construction."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(models.VOCAB, models.DIM)
        self.layers = nn.Sequential(*(models.Block() for _ in range(3)))
        self.head = nn.Linear(models.DIM, models.VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.embed(ids)))


def _assert_equals_construction(model: nn.Module, ref: nn.Module) -> None:
    ref_state = ref.state_dict()
    mine = model.state_dict(keep_vars=True)
    assert list(mine) == list(ref_state)
    for name, t in mine.items():
        assert not t.is_meta, name
        assert torch.equal(whole(t), ref_state[name]), name


def _meta_init_body(name: str) -> None:
    build = _builders()[name]
    torch.manual_seed(11)
    ref = build()
    with torch.device("meta"):
        model = build()
    model = bmt.BMTrainModelWrapper(model)
    assert all(p.is_meta for p in model.parameters()), "wrapping a meta model allocates no parameter"
    torch.manual_seed(11)
    bmt.init_parameters(model)
    _assert_equals_construction(model, ref)


@pytest.mark.parametrize("name,world_size", [("llama", 2), ("bert", 2), ("t5", 1), ("classifier", 2),
                                             ("sequential", 4), ("resnet_stage", 2), ("tied_gpt", 1),
                                             ("tied_gpt", 2)])
def test_meta_init_equals_construction(name: str, world_size: int) -> None:
    run_distributed(_meta_init_body, world_size, name)


def _gpt2_body() -> None:
    # GPT-2's Conv1D draws in its constructor, outside reset_parameters: not replayable bit for bit, but
    # every tensor is set through _init_weights, identically on every rank, and the model runs.
    with torch.device("meta"):
        model = models.gpt2()
    model = bmt.BMTrainModelWrapper(model)
    bmt.init_parameters(model)
    state = model.state_dict()
    ref = models.gpt2().state_dict()
    for k, v in state.items():
        assert v.shape == ref[k].shape and torch.isfinite(v).all(), k
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])
    assert abs(float(state["transformer.h.0.attn.c_attn.weight"].std()) - 0.02) < 0.005
    out = model(input_ids=models.token_ids()).logits
    assert torch.isfinite(out).all()


def test_gpt2_is_initialised_through_init_weights() -> None:
    run_distributed(_gpt2_body, 2)


class _WithPos(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(models.VOCAB, models.DIM)
        self.pos = nn.Parameter(torch.randn(8, models.DIM) * 0.02)  # drawn outside any reset_parameters
        self.register_buffer("scale", torch.linspace(0, 1, models.DIM), persistent=False)


def _not_reproducible_body() -> None:
    with torch.device("meta"):
        model = _WithPos()
    model = bmt.BMTrainModelWrapper(model)
    with pytest.raises(InitError, match=r"'<root>' \(\w*_WithPos\) parameters \['pos'\].*init_fn"):
        bmt.init_parameters(model)

    def init_fn(m: nn.Module) -> None:
        if isinstance(m, _WithPos):
            nn.init.normal_(m.pos, std=0.02)
        elif isinstance(m, nn.Embedding):
            m.reset_parameters()

    with pytest.raises(InitError, match=r"buffers \['scale'\] are still on the meta device"):
        bmt.init_parameters(model, init_fn=init_fn)

    def with_buffer(m: nn.Module) -> None:
        init_fn(m)
        if isinstance(m, _WithPos):
            m.scale.copy_(torch.linspace(0, 1, models.DIM))

    bmt.init_parameters(model, init_fn=with_buffer)
    assert torch.equal(model.scale, torch.linspace(0, 1, models.DIM))
    assert all(not p.is_meta for p in model.parameters())


def test_what_cannot_be_reproduced_is_named() -> None:
    run_distributed(_not_reproducible_body, 2)


def _data_writes_body() -> None:
    with torch.device("meta"):
        model = _WithPos()
    model = bmt.BMTrainModelWrapper(model)

    def init_fn(m: nn.Module) -> None:  # old-style init: writes through .data leave _version unchanged
        for p in m.parameters(recurse=False):
            p.data.normal_(0, 0.02)
        for b in m.buffers(recurse=False):
            b.data.copy_(torch.linspace(0, 1, models.DIM))

    torch.manual_seed(0)
    bmt.init_parameters(model, init_fn=init_fn)
    state = model.state_dict()
    assert abs(float(state["pos"].std()) - 0.02) < 0.01 and abs(float(state["embed.weight"].std()) - 0.02) < 0.01
    assert torch.equal(model.scale, torch.linspace(0, 1, models.DIM))


def test_writes_through_data_count_as_set() -> None:
    run_distributed(_data_writes_body, 2)


def _meta_load_body(tmp: str) -> None:
    build = _builders()["llama"]
    torch.manual_seed(0)
    ref = build()
    path = Path(tmp) / "llama.safetensors"
    bmt.save(_wrap_copy(ref), path)
    with torch.device("meta"):
        model = build()
    model = bmt.BMTrainModelWrapper(model)
    bmt.load(model, path)  # materialises, reads slices, rebuilds rotary inv_freq: no init_parameters
    _assert_equals_construction(model, ref)
    ids = models.token_ids()
    torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def _wrap_copy(model: nn.Module) -> nn.Module:
    import copy

    return bmt.BMTrainModelWrapper(copy.deepcopy(model))


def test_meta_model_loads_without_init(tmp_path: Path) -> None:
    run_distributed(_meta_load_body, 2, str(tmp_path))


def _gpt2_seeded_init_body(tp_size: int | None) -> dict | None:
    with torch.device("meta"):
        model = models.gpt2()
    model = bmt.BMTrainModelWrapper(model, tp_size=tp_size)
    torch.manual_seed(11)
    bmt.init_parameters(model)
    state = model.state_dict()  # whole tensors: TP slices joined (a collective)
    return state if bmt.rank() == 0 else None


def test_gpt2_init_at_tp2_holds_the_values_one_rank_draws() -> None:
    # Each TP rank draws the whole tensor and keeps its slice: c_attn's strided one (its heads of q, k
    # and v), so the joined value is what one rank without TP draws under the same seed, bit for bit.
    one = run_distributed(_gpt2_seeded_init_body, 1, None)[0]
    tp2 = run_distributed(_gpt2_seeded_init_body, 2, 2)[0]
    assert list(tp2) == list(one)
    for name, value in one.items():
        assert torch.equal(tp2[name], value), name
