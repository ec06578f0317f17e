"""bmt.save / bmt.load: consolidated files under original names, on real gloo ranks and real files.

Every failure must raise a CheckpointError on every rank (the harness fails a test if any rank hangs or
raises something else) and leave the previous file as it was.
"""

from __future__ import annotations

import copy
import json
import zlib
from pathlib import Path

import models
import pytest
import safetensors
import safetensors.torch
import torch
from dist_harness import run_distributed
from parity import whole
from toy import ToyGPT

import bmt_wrap as bmt
from bmt_wrap.errors import CheckpointCorruptError, CheckpointError


def _toy(seed: int = 0, **kw) -> torch.nn.Module:
    torch.manual_seed(seed)
    return ToyGPT(**kw)


def _wrapped(seed: int = 0, **kw) -> torch.nn.Module:
    return bmt.BMTrainModelWrapper(_toy(seed, **kw))


def _assert_holds(model: torch.nn.Module, ref: dict[str, torch.Tensor]) -> None:
    """Every parameter and buffer of ``model``, read whole, equals the reference's values (a collective)."""
    for name, t in model.state_dict(keep_vars=True).items():
        assert torch.equal(whole(t), ref[name]), name


def _roundtrip_body(tmp: str, suffix: str) -> None:
    ref = _toy(0)
    path = Path(tmp) / f"model{suffix}"
    bmt.save(bmt.BMTrainModelWrapper(copy.deepcopy(ref)), path)
    if bmt.rank() == 0:
        state = (safetensors.torch.load_file(path) if suffix == ".safetensors"
                 else torch.load(path, weights_only=True))
        assert sorted(state) == sorted(ref.state_dict()), "every key, tied alias included"
        plain = _toy(5)
        plain.load_state_dict(state)  # a wrapped model's file loads into the plain model
        for k, v in ref.state_dict().items():
            assert torch.equal(plain.state_dict()[k], v), k
        if suffix == ".safetensors":
            with safetensors.safe_open(path, "pt") as f:
                metadata = f.metadata()
                assert metadata.keys() == {"format", "bmt_wrap.crc32"} and metadata["format"] == "pt", metadata
                # The CRC-32s cover every tensor's bytes, as any reader sees them.
                sums = json.loads(metadata["bmt_wrap.crc32"])
                assert sums == {k: f"{zlib.crc32(v.numpy().tobytes()):08x}" for k, v in state.items()}
    bmt.barrier()
    other = _wrapped(7)
    result = bmt.load(other, path)
    assert result == ([], [])
    _assert_holds(other, ref.state_dict())
    # A meta-device model needs no init: load materialises it, and it computes what the reference does.
    with torch.device("meta"):
        meta = ToyGPT()
    meta = bmt.BMTrainModelWrapper(meta)
    bmt.load(meta, path)
    idx = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(meta(idx), ref(idx), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world_size,suffix", [(1, ".safetensors"), (2, ".safetensors"), (4, ".safetensors"),
                                               (2, ".pt")])
def test_save_load_roundtrip(tmp_path: Path, world_size: int, suffix: str) -> None:
    run_distributed(_roundtrip_body, world_size, str(tmp_path), suffix)


def _without_alias_body(tmp: str) -> None:
    ref = _toy(0)
    path = Path(tmp) / "no_alias.safetensors"
    if bmt.rank() == 0:  # as transformers writes tied models: the alias key left out
        state = {k: v.clone() for k, v in ref.state_dict().items() if k != "head.weight"}
        safetensors.torch.save_file(state, path)
    bmt.barrier()
    model = _wrapped(3)
    assert bmt.load(model, path) == ([], [])
    _assert_holds(model, ref.state_dict())


def test_file_without_tied_alias_loads(tmp_path: Path) -> None:
    run_distributed(_without_alias_body, 2, str(tmp_path))


def _transformers_body(tmp: str) -> None:
    from transformers import GPT2LMHeadModel

    ref = models.gpt2()
    model = bmt.BMTrainModelWrapper(copy.deepcopy(ref))
    bmt.save(model, Path(tmp) / "model.safetensors")
    if bmt.rank() == 0:
        ref.config.save_pretrained(tmp)
        loaded = GPT2LMHeadModel.from_pretrained(tmp)
        for k, v in ref.state_dict().items():
            assert torch.equal(loaded.state_dict()[k], v), k


def test_transformers_loads_a_saved_gpt2(tmp_path: Path) -> None:
    run_distributed(_transformers_body, 2, str(tmp_path))


def _mismatch_body(tmp: str) -> dict:
    # A layer is 11 tensors: long lists show their first few and how many more there are.
    path = Path(tmp) / "three.safetensors"
    bmt.save(_wrapped(0, n_layers=3), path)
    two = _wrapped(0, n_layers=2)
    with pytest.raises(CheckpointError, match=r"three\.safetensors does not match the model's \d+ tensors: unexpected "
                                              r"keys 'layers\.2\.[^']+'(, 'layers\.2\.[^']+'){4} … and 6 more \(pass "
                                              r"strict=False to skip them\)\. Is it"):
        bmt.load(two, path)
    result = bmt.load(two, path, strict=False)
    with pytest.raises(CheckpointError, match=r"three\.safetensors does not match the model's \d+ tensors: missing "
                                              r"keys 'layers\.3\.ln1\.weight', .* … and 6 more \(pass strict=False"):
        bmt.load(_wrapped(0, n_layers=4), path)
    with pytest.raises(CheckpointError, match=r"'wte\.weight' is torch\.float32 \[64, 16\] in three\.safetensors "
                                              r"but 'wte\.weight' is torch\.float32 \[64, 32\] in the model; .* … and \d+ "
                                              r"more\. Is it"):
        bmt.load(_wrapped(0, n_layers=3, d=32), path)
    return {"unexpected": result.unexpected_keys}


def test_a_different_model_is_refused_by_name(tmp_path: Path) -> None:
    results = run_distributed(_mismatch_body, 2, str(tmp_path))
    assert all(r["unexpected"][0].startswith("layers.2.") for r in results)


def _bad_files_body(tmp: str) -> None:
    good = Path(tmp) / "good.safetensors"
    bmt.save(_wrapped(0), good)
    data = good.read_bytes()
    bad = {
        "truncated.safetensors": data[:-1000],
        "header.safetensors": data[:8] + b"{garbage" + data[16:],
        "text.safetensors": b"this is not a checkpoint\n",
        "zip.safetensors": None,  # a torch.save file under a safetensors name
        "garbage.pt": b"\x00" * 64,
    }
    if bmt.rank() == 0:
        for name, content in bad.items():
            if content is None:
                torch.save(_toy(0).state_dict(), Path(tmp) / name)
            else:
                (Path(tmp) / name).write_bytes(content)
    bmt.barrier()
    model = _wrapped(3)
    before = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
    for name in [*bad, "missing.safetensors"]:
        with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
            bmt.load(model, Path(tmp) / name)
    with pytest.raises(CheckpointError, match=r"unknown checkpoint format '\.ckpt'"):
        bmt.load(model, Path(tmp) / "model.ckpt")
    for k, v in model.state_dict(keep_vars=True).items():
        assert torch.equal(v.detach(), before[k]), f"{k} changed by a refused load"
    bmt.load(model, good)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_bad_files_raise_on_every_rank_before_reading(tmp_path: Path, world_size: int) -> None:
    run_distributed(_bad_files_body, world_size, str(tmp_path))


def _flip(path: Path, name: str) -> None:
    """Flip one byte in the middle of tensor ``name``'s data in ``path`` (either format), in place."""
    data = bytearray(path.read_bytes())
    value = (safetensors.torch.load_file(path) if path.suffix == ".safetensors" else torch.load(path))[name]
    raw = value.contiguous().view(torch.uint8).numpy().tobytes()
    at = data.index(raw) + len(raw) // 2  # the bytes as saved, uncompressed in either format
    assert data.count(raw) == 1
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def _corrupt_body(tmp: str, suffix: str) -> None:
    ref = _toy(0)
    path, plain = Path(tmp) / f"model{suffix}", Path(tmp) / f"plain{suffix}"
    bmt.save(bmt.BMTrainModelWrapper(copy.deepcopy(ref)), path)
    if bmt.rank() == 0:
        _flip(path, "layers.1.fc.weight")
        # Files without CRC-32s (saved before they existed, or by another writer) load as before.
        state = {k: v.clone() for k, v in ref.state_dict().items()}  # safetensors refuses shared storage
        safetensors.torch.save_file(state, plain) if suffix == ".safetensors" else torch.save(state, plain)
    bmt.barrier()
    model = _wrapped(3)
    before = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
    with pytest.raises(CheckpointCorruptError, match=rf"model\{suffix} is corrupted: tensor 'layers\.1\.fc\.weight' "
                                                     r"has CRC-32 [0-9a-f]{8}, the save wrote [0-9a-f]{8}"):
        bmt.load(model, path)
    for k, v in model.state_dict(keep_vars=True).items():
        assert torch.equal(v.detach(), before[k]), f"{k} changed by a refused load"
    assert bmt.load(model, plain) == ([], [])
    _assert_holds(model, ref.state_dict())


@pytest.mark.parametrize("world_size,suffix", [(1, ".pt"), (2, ".safetensors")])
def test_flipped_bytes_raise_naming_the_tensor_on_every_rank(tmp_path: Path, world_size: int, suffix: str) -> None:
    run_distributed(_corrupt_body, world_size, str(tmp_path), suffix)


def _disk_full_body(tmp: str, suffix: str) -> None:
    import resource
    import signal

    path = Path(tmp) / f"model{suffix}"
    old = _wrapped(0)
    bmt.save(old, path)
    saved = path.read_bytes()
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so write() fails with EFBIG instead
    if bmt.rank() == 0:
        resource.setrlimit(resource.RLIMIT_FSIZE, (len(saved) // 2, limits[1]))
    try:
        with pytest.raises(CheckpointError, match=rf"model\{suffix}.*Errno 27.*file size limit"):
            bmt.save(_wrapped(1), path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    assert path.read_bytes() == saved, "the previous file is intact"
    assert not [f for f in Path(tmp).iterdir() if ".tmp-" in f.name], "no temp file left behind"
    fresh = _wrapped(9)
    bmt.load(fresh, path)
    _assert_holds(fresh, _toy(0).state_dict())


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_disk_full_keeps_the_previous_file(tmp_path: Path, suffix: str) -> None:
    run_distributed(_disk_full_body, 2, str(tmp_path), suffix)


def _unwritable_body(tmp: str) -> None:
    blocker = Path(tmp) / "file"
    if bmt.rank() == 0:
        blocker.write_text("a regular file")
    bmt.barrier()
    model = _wrapped(0)
    with pytest.raises(CheckpointError, match=r"file/model\.safetensors.*Errno 20.*not a directory"):
        bmt.save(model, blocker / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"file/ckpt.*Errno 20"):
        bmt.save_checkpoint(blocker / "ckpt", model)
    with pytest.raises(CheckpointError, match="still on the meta device"):
        with torch.device("meta"):
            meta = ToyGPT()
        bmt.save(bmt.BMTrainModelWrapper(meta), Path(tmp) / "meta.safetensors")


@pytest.mark.parametrize("world_size", [1, 2])
def test_unwritable_destination_raises_on_every_rank(tmp_path: Path, world_size: int) -> None:
    run_distributed(_unwritable_body, world_size, str(tmp_path))
