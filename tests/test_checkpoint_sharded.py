"""bmt.save_checkpoint / load_checkpoint: resume bit-exactly at the same world size, reshard across world
sizes within docs/design.md's AdamW tolerances, and refuse broken or foreign directories on every rank."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import safetensors
import torch
from dist_harness import run_distributed
from parity import ADAMW_REL, LOSS_RTOL, lm_batches, train_managed, wholes
from toy import ToyGPT

import bmt_wrap as bmt
from bmt_wrap.checkpoint.sharded import METADATA
from bmt_wrap.errors import CheckpointCorruptError, CheckpointError

SAVE_AT, STEPS = 3, 6


def _setup(seed: int, optim: str, dropout: float = 0.0) -> tuple:
    torch.manual_seed(seed)
    model = bmt.BMTrainModelWrapper(ToyGPT(dropout=dropout))
    mgr = bmt.optim.OptimManager(loss_scale=2.0 ** 10)
    if optim == "ours":
        opt = bmt.optim.AdamOptimizer(model.parameters(), lr=1e-2, weight_decay=0.1)
        mgr.add_optimizer(opt, bmt.lr_scheduler.Noam(opt, start_lr=1e-2, warmup_iter=2, end_iter=100))
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        mgr.add_optimizer(opt)
    return model, mgr


def _train(model, mgr, steps: range) -> list[float]:
    return train_managed(model, mgr, lm_batches(STEPS, 4), steps)


def _resume_body(tmp: str, optim: str) -> None:
    model, mgr = _setup(0, optim, dropout=0.1)
    _train(model, mgr, range(SAVE_AT))
    bmt.save_checkpoint(Path(tmp) / "ckpt", model, mgr, step=SAVE_AT, extra={"epoch": 1})
    straight = _train(model, mgr, range(SAVE_AT, STEPS))
    resumed_model, resumed_mgr = _setup(1, optim, dropout=0.1)
    info = bmt.load_checkpoint(Path(tmp) / "ckpt", resumed_model, resumed_mgr)
    assert (info.step, info.extra, info.rng_restored) == (SAVE_AT, {"epoch": 1}, True)
    resumed = _train(resumed_model, resumed_mgr, range(SAVE_AT, STEPS))
    assert resumed == straight, "resuming at the same world size is bit-exact (dropout RNG included)"
    for (name, a), b in zip(model.named_parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("world_size,optim", [(1, "ours"), (2, "ours"), (2, "torch")])
def test_resume_is_bit_exact_at_the_same_world_size(tmp_path: Path, world_size: int, optim: str) -> None:
    run_distributed(_resume_body, world_size, str(tmp_path), optim)


def _reference_body(tmp: str, optim: str) -> list[float]:
    model, mgr = _setup(0, optim)
    _train(model, mgr, range(SAVE_AT))
    bmt.save_checkpoint(Path(tmp) / "ckpt", model, mgr, step=SAVE_AT)
    losses = _train(model, mgr, range(SAVE_AT, STEPS))
    bmt.save(model, Path(tmp) / "final.safetensors")
    return losses


def _resharded_body(tmp: str, optim: str, expected: list[float]) -> dict:
    model, mgr = _setup(1, optim)
    info = bmt.load_checkpoint(Path(tmp) / "ckpt", model, mgr)
    assert info.saved_world_size == 2 and not info.rng_restored
    losses = _train(model, mgr, range(SAVE_AT, STEPS))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=LOSS_RTOL, atol=0)
    worst = 0.0
    named = list(model.named_parameters())
    with safetensors.safe_open(Path(tmp) / "final.safetensors", "pt") as f:
        for (name, _), value in zip(named, wholes([(p, p) for _, p in named]), strict=True):
            want = f.get_tensor(name)
            if want.numel():
                rel = float((value - want).norm() / want.norm().clamp_min(1e-12))
                assert rel <= ADAMW_REL, f"{name}: relative difference {rel:.2e}"
                worst = max(worst, rel)
    return {"worst": worst}


@pytest.mark.parametrize("optim", ["ours", "torch"])
def test_a_checkpoint_from_two_ranks_resumes_on_one_and_four(tmp_path: Path, optim: str) -> None:
    expected = run_distributed(_reference_body, 2, str(tmp_path), optim)[0]
    for world_size in (1, 4):
        run_distributed(_resharded_body, world_size, str(tmp_path), optim, expected)


def _faults_body(tmp: str) -> None:
    import resource
    import signal

    root = Path(tmp)
    model, mgr = _setup(0, "ours")
    _train(model, mgr, range(1))
    left_behind = root / "good" / f".{METADATA}.tmp-424242"  # a save whose rank 0 died writing the metadata
    if bmt.rank() == 0:
        left_behind.parent.mkdir()
        left_behind.write_text("{")
    bmt.barrier()
    bmt.save_checkpoint(root / "good", model, mgr, step=1)
    bmt.barrier()  # rank 0 cleans up after the save's last collective
    assert not left_behind.exists(), "the next save removes an interrupted save's temp files"
    before = [p.detach().clone() for p in model.parameters()]
    meta = json.loads((root / "good" / METADATA).read_text())
    shard0 = root / "good" / meta["files"][0]["tensors"]
    state_last = root / "good" / meta["files"][-1]["state"]

    def refused(directory: Path, pattern: str, **kw) -> None:
        fresh, fresh_mgr = kw.pop("model", None) or _setup(2, "ours")
        with pytest.raises(CheckpointError, match=pattern):
            bmt.load_checkpoint(directory, fresh, fresh_mgr)

    # A save that failed (disk full on rank 0 only) raises everywhere and leaves "good" loadable.
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if bmt.rank() == 0:
        resource.setrlimit(resource.RLIMIT_FSIZE, (shard0.stat().st_size // 2, limits[1]))
    try:
        with pytest.raises(CheckpointError, match=r"good/shard-00000.*Errno 27"):
            bmt.save_checkpoint(root / "good", model, mgr, step=2)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    bmt.barrier()
    assert json.loads((root / "good" / METADATA).read_text()) == meta, "the previous checkpoint still rules"

    if bmt.rank() == 0:  # broken copies of "good", one fault each
        for name in ("incomplete", "truncated", "corrupt_meta", "corrupt_shard", "flipped_shard", "flipped_state",
                     "unchecked"):
            (root / name).mkdir()
            for f in (root / "good").iterdir():
                (root / name / f.name).write_bytes(f.read_bytes())
        (root / "incomplete" / METADATA).unlink()
        t = root / "truncated" / shard0.name
        t.write_bytes(t.read_bytes()[:-100])
        (root / "corrupt_meta" / METADATA).write_text('{"format": "bmt_wrap.sharded", "vers')
        c = root / "corrupt_shard" / shard0.name
        data = bytearray(c.read_bytes())
        data[8:24] = b"#" * 16  # the header's JSON
        c.write_bytes(bytes(data))
        for f, at in ((root / "flipped_shard" / shard0.name, -1), (root / "flipped_state" / state_last.name, 200)):
            data = bytearray(f.read_bytes())
            data[at] ^= 0x10  # one bit of a tensor's data (the last one's last byte), of the state's pickle
            f.write_bytes(bytes(data))
        for name in ("unchecked", "corrupt_shard"):  # as saved before checksums existed: headers still checked
            old = json.loads((root / name / METADATA).read_text())
            for entry in old["files"]:
                del entry["tensors_crc32"], entry["state_crc32"]
            (root / name / METADATA).write_text(json.dumps(old))
    bmt.barrier()
    for name, path in (("flipped_shard", shard0), ("flipped_state", state_last)):
        fresh, fresh_mgr = _setup(2, "ours")
        with pytest.raises(CheckpointCorruptError, match=rf"{name}/{path.name} is corrupted: its CRC-32 is [0-9a-f]{{8}}, "
                                                         r"the save wrote [0-9a-f]{8} .* Copy the file again"):
            bmt.load_checkpoint(root / name, fresh, fresh_mgr)
    refused(root / "incomplete", r"incomplete/metadata\.json is missing.*save that did not finish")
    refused(root / "truncated", rf"truncated/{shard0.name}.*truncated")
    refused(root / "corrupt_meta", r"corrupt_meta/metadata\.json is not a bmt_wrap checkpoint")
    refused(root / "corrupt_shard", rf"corrupt_shard/{shard0.name} is not a readable safetensors")
    refused(root / "nowhere", rf"directory not found: {re.escape(str(root / 'nowhere'))}")
    torch.manual_seed(0)
    bigger = bmt.BMTrainModelWrapper(ToyGPT(n_layers=4))
    refused(root / "good", r"model tensors not in the checkpoint: 'layers\.3\.ln1\.weight'",
            model=(bigger, bmt.optim.OptimManager()))
    wider = bmt.BMTrainModelWrapper(ToyGPT(d=32))
    refused(root / "good", r"'wte\.weight' is float32 \[64, 16\] in the checkpoint", model=(wider, None))
    plain, _ = _setup(2, "ours")
    with pytest.raises(CheckpointError, match="state of 1 optimizer"):
        bmt.load_checkpoint(root / "good", plain)  # the optimizer was not passed
    for directory in ("good", "unchecked"):
        after, after_mgr = _setup(2, "ours")
        bmt.load_checkpoint(root / directory, after, after_mgr)
        for a, b in zip(after.parameters(), before, strict=True):
            assert torch.equal(a.detach(), b), directory


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_broken_directories_are_refused_on_every_rank(tmp_path: Path, world_size: int) -> None:
    run_distributed(_faults_body, world_size, str(tmp_path))


def _long_mismatch_body(tmp: str) -> None:
    torch.manual_seed(0)
    bmt.save_checkpoint(Path(tmp) / "three", bmt.BMTrainModelWrapper(ToyGPT()))
    five = bmt.BMTrainModelWrapper(ToyGPT(n_layers=5))  # 22 tensors more, 11 per layer
    with pytest.raises(CheckpointError, match=r"three is not a checkpoint of this model: model tensors not in the "
                                              r"checkpoint: 'layers\.3\.ln1\.weight', .* … and 17 more$"):
        bmt.load_checkpoint(Path(tmp) / "three", five)
    one = bmt.BMTrainModelWrapper(ToyGPT(n_layers=1))
    with pytest.raises(CheckpointError, match=r"the checkpoint has tensors the model lacks: 'layers\.1\.ln1\.weight', "
                                              r".* … and 17 more$"):
        bmt.load_checkpoint(Path(tmp) / "three", one)
    wider = bmt.BMTrainModelWrapper(ToyGPT(d=32))
    with pytest.raises(CheckpointError, match=r"'wte\.weight' is float32 \[64, 16\] in the checkpoint but torch\.float32 "
                                              r"\[64, 32\] in the model; .* … and \d+ more$"):
        bmt.load_checkpoint(Path(tmp) / "three", wider)


def test_long_mismatch_lists_end_with_how_many_more(tmp_path: Path) -> None:
    run_distributed(_long_mismatch_body, 1, str(tmp_path))


def test_a_missing_directory_is_named(tmp_path: Path) -> None:
    from bmt_wrap.checkpoint.dcp import load_directory
    from bmt_wrap.integrations.lightning import ShardedStrategy

    nowhere = tmp_path / "nowhere"
    for load in (lambda: load_directory(nowhere, {}), lambda: ShardedStrategy().load_checkpoint(nowhere)):
        with pytest.raises(CheckpointError, match=rf"^directory not found: {re.escape(str(nowhere))}: check the path"):
            load()
