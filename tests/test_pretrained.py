"""Streaming initialisation: ``bmt.from_pretrained`` builds on the meta device, wraps, and has each rank read
only its own ranges of a ``save_pretrained`` directory (one file or index-named shards).

Parity is against plain transformers' ``from_pretrained`` on the same directory; memory is measured by the
kernel (the process's peak RSS, VmHWM), not by the engine's accounting.
"""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import models
import pytest
import torch
from dist_harness import raised, run_distributed
from parity import train_side_by_side, whole
from proc_status import status_bytes
from torch import nn

import bmt_wrap as bmt


def _lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _batches(steps: int = 3) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, models.VOCAB, (4, 8), generator=g),) for _ in range(steps)]


def _model_class(name: str) -> type:
    import transformers

    return {"gpt2": transformers.GPT2LMHeadModel, "auto": transformers.AutoModelForCausalLM}[name]


def _save(directory: Path, build, shard_size: str | None) -> None:
    kw = {"max_shard_size": shard_size} if shard_size else {}
    build().save_pretrained(directory, **kw)


# ---- loaded values and training equal plain transformers' ----------------------------------------------
def _parity_body(directory: str, cls_name: str) -> dict:
    cls = _model_class(cls_name)
    model = bmt.from_pretrained(cls, directory)
    plain = cls.from_pretrained(directory)
    assert not model.training and not plain.training, "eval mode after loading, as transformers gives"
    loaded = {n: whole(t) for n, t in model.state_dict(keep_vars=True).items()}
    for name, t in plain.state_dict().items():
        assert torch.equal(loaded[name], t), name
    result = train_side_by_side(lambda: cls.from_pretrained(directory).train(),
                                lambda _copy: bmt.from_pretrained(cls, directory).train(),
                                _batches(), optimizer="adamw", loss_fn=_lm_loss, sliced_reference=True)
    return {"losses": result["losses"], "ref_losses": result["ref_losses"]}


@pytest.mark.parametrize("build,cls_name,shard_size",
                         [(models.gpt2, "gpt2", "30KB"), (models.llama, "auto", None)],
                         ids=["gpt2-sharded", "llama-auto-one-file"])
def test_from_pretrained_equals_transformers_and_trains_alike(tmp_path: Path, build, cls_name: str,
                                                              shard_size: str | None) -> None:
    _save(tmp_path, build, shard_size)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    if shard_size:
        assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").is_file(), files
    else:
        assert files == ["model.safetensors"], files
    for r in run_distributed(_parity_body, 2, str(tmp_path), cls_name):
        assert len(r["losses"]) == 3
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=1e-5,
                                   atol=0)


def _load_directory_body(directory: str) -> bool:
    # bmt.load takes the directory too, into a model the user built on the meta device and wrapped.
    with torch.device("meta"):
        model = models.gpt2()
    model = bmt.BMTrainModelWrapper(model)
    assert bmt.load(model, directory) == ([], [])
    plain = _model_class("gpt2").from_pretrained(directory)
    reference = plain.state_dict()
    return all(torch.equal(whole(t), reference[n]) for n, t in model.state_dict(keep_vars=True).items())


def test_load_reads_a_sharded_directory_into_a_meta_model(tmp_path: Path) -> None:
    _save(tmp_path, models.gpt2, "30KB")
    assert all(run_distributed(_load_directory_body, 2, str(tmp_path)))


def _strict_false_body(directory: str) -> dict:
    # A classification head the checkpoint lacks: initialised as construction would, the rest loaded.
    from transformers import GPT2ForSequenceClassification

    model = bmt.from_pretrained(GPT2ForSequenceClassification, directory, strict=False)
    plain = GPT2ForSequenceClassification.from_pretrained(directory)
    state = {n: whole(t) for n, t in model.state_dict(keep_vars=True).items()}
    body = [n for n in plain.state_dict() if n.startswith("transformer.")]
    head = state["score.weight"]
    return {"body_equal": all(torch.equal(state[n], plain.state_dict()[n]) for n in body),
            "head_set": bool(torch.isfinite(head).all() and head.abs().sum() > 0)}


def test_strict_false_initialises_what_the_checkpoint_lacks(tmp_path: Path) -> None:
    _save(tmp_path, models.gpt2, None)
    for r in run_distributed(_strict_false_body, 2, str(tmp_path)):
        assert r == {"body_equal": True, "head_set": True}


# ---- errors name the file and the key, on every rank ---------------------------------------------------
def _error_body(directory: str) -> tuple[str, str]:
    return raised(lambda: bmt.from_pretrained(_model_class("gpt2"), directory))


def _same_everywhere(results: list[tuple[str, str]]) -> tuple[str, str]:
    """Rank 0's error, after checking every rank raised it (others quote it as ``rank 0: ...``)."""
    kind, message = results[0]
    assert all(k == kind and m in (message, f"rank 0: {message}") for k, m in results), results
    return kind, message


def _errors_of(directory: Path) -> tuple[str, str]:
    return _same_everywhere(run_distributed(_error_body, 2, str(directory)))


def test_a_key_the_index_misplaces_is_named_with_its_file(tmp_path: Path) -> None:
    _save(tmp_path, models.gpt2, "30KB")
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    files = sorted(set(data["weight_map"].values()))
    data["weight_map"]["transformer.h.1.mlp.c_fc.weight"] = next(
        f for f in files if f != data["weight_map"]["transformer.h.1.mlp.c_fc.weight"])
    index.write_text(json.dumps(data))
    kind, message = _errors_of(tmp_path)
    assert kind == "CheckpointError"
    assert "model.safetensors.index.json names tensors its files do not hold" in message
    assert "'transformer.h.1.mlp.c_fc.weight' (in model-0000" in message


def _wider_body(directory: str, n_embd: int) -> tuple[str, str]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config.from_pretrained(directory, n_embd=n_embd)
    return raised(lambda: bmt.from_pretrained(GPT2LMHeadModel, directory, config=config))


def test_a_tensor_of_another_shape_is_named_with_its_file(tmp_path: Path) -> None:
    _save(tmp_path, models.gpt2, "30KB")
    kind, message = _same_everywhere(run_distributed(_wider_body, 2, str(tmp_path), 2 * models.DIM))
    assert kind == "CheckpointError"
    assert "'transformer.wte.weight' is torch.float32 [96, 32] in model-0000" in message
    assert "but 'transformer.wte.weight' is torch.float32 [96, 64] in the model" in message


def test_a_directory_without_weights_or_config_is_named(tmp_path: Path) -> None:
    kind, message = _errors_of(tmp_path)
    assert (kind, message) == ("CheckpointError", f"{tmp_path} has no config.json to build GPT2LMHeadModel "
                                                  "from: pass a save_pretrained directory, or config=")
    models.gpt2().config.save_pretrained(tmp_path)
    kind, message = _errors_of(tmp_path)
    assert kind == "CheckpointError"
    assert message.startswith(f"{tmp_path} is a directory without model.safetensors.index.json")


# ---- memory: a rank's peak grows by its shard, not by the model ----------------------------------------
_LIBC = ctypes.CDLL("libc.so.6")


def _peak_body(directory: str) -> dict:
    from transformers import GPT2LMHeadModel

    _LIBC.malloc_trim(0)  # freed heap goes back to the OS, so new storage shows in RSS
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from the current RSS
    before = status_bytes("VmRSS")
    model = bmt.from_pretrained(GPT2LMHeadModel, directory)
    peak = status_bytes("VmHWM")
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    shard += sum(b.numel() * b.element_size() for b in model.buffers())
    block = sum(p.numel() * p.element_size() for p in model.transformer.h[0].parameters())
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"grew": peak - before, "shard": shard, "block": block, "full": full}


def test_streaming_load_peak_is_a_shard_plus_two_blocks(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=4096, n_positions=128, n_embd=512, n_layer=16, n_head=8, bos_token_id=0,
                        eos_token_id=0)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(tmp_path, max_shard_size="60MB")
    for r in run_distributed(_peak_body, 2, str(tmp_path)):
        bound = r["shard"] + 2 * r["block"]
        assert r["full"] > 1.4 * bound, f"a full copy of the model must exceed the bound clearly: {r}"
        assert r["grew"] <= bound, f"peak RSS grew {r['grew'] / 2**20:.1f} MiB > shard + 2 blocks " \
                                   f"({bound / 2**20:.1f} MiB): {r}"
