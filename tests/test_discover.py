"""Block discovery on toy and transformers models: exactly the expected blocks, by structure alone."""

from __future__ import annotations

import models as M
import pytest
import torch
from torch import nn

from bmt_wrap.passes import discover_blocks
from bmt_wrap.passes.discover import MIN_BLOCK_FRACTION
from bmt_wrap.passes.signature import SignatureCache, near_identical

ALL = {**M.TOY, **M.HF}


@pytest.mark.parametrize("name", list(ALL))
def test_discovers_exactly_the_expected_blocks(name: str) -> None:
    factory, _, expected = ALL[name]
    d = discover_blocks(factory())
    assert d.fqns() == expected
    fqns = d.fqns()
    assert not any(a != b and b.startswith(a + ".") for a in fqns for b in fqns), "blocks are nested"


@pytest.mark.parametrize("name", ["toy_gpt", "encoder_decoder", "t5", "llama", "classifier"])
def test_meta_model_discovers_the_same_blocks(name: str) -> None:
    factory, _, expected = ALL[name]
    with torch.device("meta"):
        model = factory()
    assert next(model.parameters()).is_meta
    assert discover_blocks(model).fqns() == expected


def test_inner_same_shape_siblings_are_not_blocks() -> None:
    # q/k/v/o are same-signature siblings inside every layer: the outer run (layers) wins.
    model = M.ToyGPT()
    sig = SignatureCache()
    attn = model.layers[0].attn
    assert sig(attn.q) == sig(attn.k) == sig(attn.v)
    assert not any(".attn." in f for f in discover_blocks(model).fqns())


def test_encoder_decoder_has_two_block_lists() -> None:
    d = discover_blocks(M.EncoderDecoder())
    assert [(bl.container, bl.members) for bl in d.lists] == [
        ("encoder", ("encoder.0", "encoder.1")), ("decoder", ("decoder.0", "decoder.1"))]


def test_t5_block_zero_is_near_identical_block_of_its_own() -> None:
    model = M.t5()
    sig = SignatureCache()
    b0, b1, b2 = model.encoder.block
    assert sig(b0) != sig(b1) == sig(b2)
    assert near_identical(b0, b1)
    d = discover_blocks(model)
    assert [bl.members for bl in d.lists] == [tuple(f"encoder.block.{i}" for i in range(3)),
                                             tuple(f"decoder.block.{i}" for i in range(3))]
    assert any("encoder.block.0" in n and "differs slightly" in n for n in d.notes)


def test_resnet_stage_first_block_is_a_block() -> None:
    model = M.ResNetStage()
    assert SignatureCache()(model.stage[0]) != SignatureCache()(model.stage[1])
    assert discover_blocks(model).fqns() == ["stage.0", "stage.1", "stage.2"]


def test_no_repeated_blocks_means_root_only_with_a_note() -> None:
    d = discover_blocks(M.MLP())
    assert d.blocks == []
    assert d.notes == ["no repeated blocks: every parameter stays in the root group"]


def test_signature_sees_dtype_shape_and_buffers() -> None:
    sig = SignatureCache()
    assert sig(nn.Linear(4, 4)) == sig(nn.Linear(4, 4))
    assert sig(nn.Linear(4, 4)) != sig(nn.Linear(4, 5))
    assert sig(nn.Linear(4, 4)) != sig(nn.Linear(4, 4).double())
    bn = nn.BatchNorm1d(4)
    assert sig(bn) != sig(nn.BatchNorm1d(4, track_running_stats=False))  # buffers differ
    assert sig(nn.Sequential(nn.Linear(4, 4))) != sig(nn.ModuleList([nn.Linear(4, 4)]))  # class differs


def test_runs_below_the_size_threshold_stay_in_the_parent() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.big = nn.Linear(400, 400)  # 160k params: each tiny block below is < 0.5%
            self.tiny = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    d = discover_blocks(Model())
    assert d.blocks == []
    assert 20 / (160_400 + 60) < MIN_BLOCK_FRACTION
    assert any("'tiny.0'" in n and "kept in the parent's group" in n for n in d.notes)


def test_module_registered_twice_is_one_block_with_an_alias() -> None:
    model = M.ToyGPT(n_layers=3)
    model.extra = model.layers[1]  # same object under a second name
    d = discover_blocks(model)
    assert d.fqns() == ["layers.0", "layers.1", "layers.2"]
    assert d.blocks[1].aliases == ("extra",)
    assert d.owner("extra.fc1.weight") == "layers.1"
    assert d.owner("head.weight") is None


def test_discovery_is_deterministic_and_numel_counts_unique_parameters() -> None:
    a, b = discover_blocks(M.ToyGPT(tie=True)), discover_blocks(M.ToyGPT(tie=True))
    assert a == b
    model = M.ToyGPT(tie=True)
    assert a.total_numel == sum(p.numel() for p in model.parameters())
    assert a.blocks[0].numel == sum(p.numel() for p in model.layers[0].parameters())


@pytest.mark.parametrize("name", ["toy_gpt", "resnet_stage", "gpt2", "t5", "classifier"])
def test_factories_are_deterministic_and_leave_the_callers_rng_alone(name: str) -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a = ALL[name][0]()
    assert torch.equal(torch.rand(1), expected_next)
    b = ALL[name][0]()
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
