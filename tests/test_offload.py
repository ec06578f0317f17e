"""``BMTrainModelWrapper(offload="disk")``: the same job with each rank's shards, gradient shards and no_sync
accumulators in a file trains bit-equal to the job without offload (bmt's Adam, its disk Adam and torch's
AdamW; a toy GPT and a transformers model), resumes and saves the same, and a full disk or a truncated file
is a named error on every rank."""

from __future__ import annotations

import os
import resource
import subprocess
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_distributed
from models import SEQ, VOCAB, ToyGPT, llama, lm_loss, seeded

import bmt_wrap as bmt
from bmt_wrap.errors import OffloadError, OffloadWarning, UnsupportedError

WORLD_SIZES = [1, 2, 4]


def _build(kind: str) -> torch.nn.Module:
    return seeded(lambda: ToyGPT(n_layers=3)) if kind == "toy" else llama()


def _loss(model: torch.nn.Module, kind: str, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    if kind == "toy":
        return model(idx, tgt)
    return lm_loss(model(input_ids=idx).logits, tgt)


def _optimizer(kind: str, model: torch.nn.Module, tmp: str) -> torch.optim.Optimizer:
    if kind == "ours":
        return bmt.optim.AdamOptimizer(model.parameters(), lr=1e-2, weight_decay=0.1)
    if kind == "disk":
        return bmt.optim.AdamDiskOptimizer(model.parameters(), lr=1e-2, weight_decay=0.1, offload_dir=tmp,
                                           chunk_bytes=64 * 1024)
    if kind == "muon":  # the whole-matrix optimizer on the matrices (owners exchange them), AdamW on the rest
        matrices = [p for p in model.parameters() if p.ndim == 2]
        return _Pair(bmt.optim.Muon(matrices, lr=0.02, weight_decay=0.1),
                     torch.optim.AdamW([p for p in model.parameters() if p.ndim != 2], lr=1e-2))
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


class _Pair:
    """Two optimizers stepped together, as a script with Muon for matrices and AdamW for the rest does."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad()


def _batches(steps: int, micro: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """The same micro-batches every step (so the loss must fall)."""
    g = torch.Generator().manual_seed(1)
    n = bmt.world_size() * 2
    one = [(torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, VOCAB, (n, SEQ), generator=g))
           for _ in range(micro)]
    return [one] * steps


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, kind: str, batches: list, clip: bool) -> list[torch.Tensor]:
    """Steps of micro-batches (all but the last under no_sync), each rank on its slice; the local losses."""
    n, r = bmt.world_size(), bmt.rank()
    losses = []
    for micro in batches:
        for i, (idx, tgt) in enumerate(micro):
            last = i == len(micro) - 1
            with model.no_sync() if not last else _nothing():
                loss = _loss(model, kind, idx.chunk(n)[r], tgt.chunk(n)[r]) / len(micro)
                loss.backward()
            losses.append(loss.detach())
        if clip:
            losses.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).detach())
        opt.step()
        opt.zero_grad()
    return losses


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _same(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    """Names of parameters whose full values differ in any bit (a collective)."""
    return [name for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True)
            if not torch.equal(p.full_tensor(), q.full_tensor())]


def _parity_body(tmp: str, model_kind: str, optim: str, micro: int, clip: bool) -> dict:
    batches = _batches(3, micro)
    plain = bmt.BMTrainModelWrapper(_build(model_kind))
    off = bmt.BMTrainModelWrapper(_build(model_kind), offload="disk", offload_dir=tmp)
    assert all(b.home is not None for g in off._bmt_runtime.groups for b in g.buffers), "every group offloaded"
    a = _train(plain, _optimizer(optim, plain, tmp), model_kind, batches, clip)
    b = _train(off, _optimizer(optim, off, tmp), model_kind, batches, clip)
    return {"losses_equal": all(torch.equal(x, y) for x, y in zip(a, b, strict=True)),
            "differ": _same(plain, off), "progress": float(a[-1 - int(clip)]) < float(a[micro - 1])}


def _check(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        assert res["losses_equal"], f"rank {rank}: losses differ from the job without offload"
        assert res["differ"] == [], f"rank {rank}: parameters differ: {res['differ']}"
        assert res["progress"], "training makes progress"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("optim", ["ours", "torch"])
def test_toy_gpt_is_bit_equal(tmp_path: Path, world_size: int, optim: str) -> None:
    _check(run_distributed(_parity_body, world_size, str(tmp_path), "toy", optim, 1, False))


@pytest.mark.parametrize("world_size", [1, 2])
def test_disk_adam_is_bit_equal(tmp_path: Path, world_size: int) -> None:
    _check(run_distributed(_parity_body, world_size, str(tmp_path), "toy", "disk", 1, False))


@pytest.mark.parametrize("world_size", [1, 2])
def test_muon_is_bit_equal(tmp_path: Path, world_size: int) -> None:
    """Muon's owners gather whole matrices from offloaded shards and write their ranges back."""
    _check(run_distributed(_parity_body, world_size, str(tmp_path), "toy", "muon", 1, False))


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("optim", ["ours", "torch"])
def test_transformers_llama_is_bit_equal(tmp_path: Path, world_size: int, optim: str) -> None:
    _check(run_distributed(_parity_body, world_size, str(tmp_path), "llama", optim, 1, False))


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_no_sync_accumulation_and_clipping_are_bit_equal(tmp_path: Path, world_size: int) -> None:
    _check(run_distributed(_parity_body, world_size, str(tmp_path), "toy", "torch", 3, True))


def _resume_body(tmp: str, optim: str) -> dict:
    """Save at step 2 of an offloaded job, go on 2 steps; a fresh offloaded job loads it and goes the same
    2 steps; the consolidated save and state_dict equal the job's without offload."""
    batches = _batches(4, 1)
    off = bmt.BMTrainModelWrapper(_build("toy"), offload="disk", offload_dir=tmp)
    opt = _optimizer(optim, off, tmp)
    _train(off, opt, "toy", batches[:2], clip=False)
    ckpt = Path(tmp) / "ckpt"
    bmt.save_checkpoint(ckpt, off, optimizer=opt, step=2)
    straight = _train(off, opt, "toy", batches[2:], clip=False)
    again = bmt.BMTrainModelWrapper(_build("toy"), offload="disk", offload_dir=tmp)
    opt2 = _optimizer(optim, again, tmp)
    bmt.load_checkpoint(ckpt, again, optimizer=opt2)
    resumed = _train(again, opt2, "toy", batches[2:], clip=False)
    plain = bmt.BMTrainModelWrapper(_build("toy"))
    _train(plain, _optimizer(optim, plain, tmp), "toy", batches, clip=False)
    consolidated = {}
    for name, model in (("off", off), ("plain", plain)):
        path = Path(tmp) / f"{name}.pt"
        bmt.save(model, str(path))
        consolidated[name] = torch.load(path) if bmt.rank() == 0 else None
    sd_off, sd_plain = off.state_dict(), plain.state_dict()
    return {"resumed_equal": all(torch.equal(x, y) for x, y in zip(straight, resumed, strict=True)),
            "differ": _same(off, again) + _same(off, plain),
            "state_dict_equal": sd_off.keys() == sd_plain.keys()
            and all(torch.equal(sd_off[k], sd_plain[k]) for k in sd_off),
            "save_equal": bmt.rank() != 0 or (consolidated["off"].keys() == consolidated["plain"].keys() and all(
                torch.equal(consolidated["off"][k], consolidated["plain"][k]) for k in consolidated["off"]))}


@pytest.mark.parametrize("world_size,optim", [(1, "ours"), (2, "ours"), (2, "torch"), (4, "disk")])
def test_resume_and_consolidated_save(tmp_path: Path, world_size: int, optim: str) -> None:
    for rank, res in enumerate(run_distributed(_resume_body, world_size, str(tmp_path), optim)):
        assert res == {"resumed_equal": True, "differ": [], "state_dict_equal": True, "save_equal": True}, rank


# ---- failures: a named error on every rank, never a hang --------------------------------------------------
def _raised(fn: Any) -> str:
    try:
        fn()
    except OffloadError as exc:
        return f"OffloadError: {exc}"
    return "no error"


def _full_disk_body(tmp: str, failing: int) -> str:
    """Rank ``failing`` may write files of at most 64 KiB (RLIMIT_FSIZE): its shards do not fit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if bmt.rank() == failing:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        return _raised(lambda: bmt.BMTrainModelWrapper(_build("toy"), offload="disk", offload_dir=tmp))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def _assert_named_on_every_rank(out: list[str], failing: int, why: str, others_name_it: bool) -> None:
    """The failing rank's error says ``why`` and names the file; every rank's is an OffloadError (naming
    the failing rank, where ``others_name_it``)."""
    assert why in out[failing] and "shards.bin" in out[failing], out[failing]
    for rank, msg in enumerate(out):
        assert msg.startswith("OffloadError"), (rank, msg)
        if others_name_it and rank != failing:
            assert f"rank(s) [{failing}]" in msg, msg


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_full_disk_is_a_named_error_on_every_rank(tmp_path: Path, world_size: int) -> None:
    failing = world_size - 1
    out = run_distributed(_full_disk_body, world_size, str(tmp_path), failing)
    _assert_named_on_every_rank(out, failing, "cannot reserve", others_name_it=True)


def _missing_dir_body(tmp: str) -> str:
    where = Path(tmp) / ("missing" if bmt.rank() == bmt.world_size() - 1 else "")
    return _raised(lambda: bmt.BMTrainModelWrapper(_build("toy"), offload="disk", offload_dir=where))


def test_unwritable_directory_is_a_named_error_on_every_rank(tmp_path: Path) -> None:
    out = run_distributed(_missing_dir_body, 2, str(tmp_path))
    assert "cannot create offloaded shards under" in out[1] and "missing" in out[1], out[1]
    assert out[0].startswith("OffloadError") and "rank(s) [1]" in out[0], out[0]


def _trained_then_truncated(tmp: str, truncate: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An offloaded toy model trained one step, its file then cut to one page where ``truncate``."""
    off = bmt.BMTrainModelWrapper(_build("toy"), offload="disk", offload_dir=tmp)
    opt = _optimizer("ours", off, tmp)
    _train(off, opt, "toy", _batches(2, 1)[:1], clip=False)
    if truncate:
        os.truncate(off._bmt_runtime.offload.path, 4096)
    return off, opt


def _truncated_body(tmp: str, failing: int) -> str:
    off, opt = _trained_then_truncated(tmp, bmt.rank() == failing)
    return _raised(lambda: _train(off, opt, "toy", _batches(2, 1)[1:], clip=False))


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_truncated_file_is_a_named_error_on_every_rank(tmp_path: Path, world_size: int) -> None:
    failing = world_size - 1
    out = run_distributed(_truncated_body, world_size, str(tmp_path), failing)
    _assert_named_on_every_rank(out, failing, "truncated or replaced", others_name_it=False)


def _other_optimizer_body(tmp: str) -> list[str]:
    """An offloaded model whose file was truncated, beside another optimizer over plain parameters (another
    model, or a later test in the same process while the broken model waits for the collector)."""
    _, opt = _trained_then_truncated(tmp, truncate=True)
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    plain = torch.optim.SGD([p], lr=0.5)
    other = _raised(plain.step)
    return [other, str(p.detach().tolist()), _raised(opt.step)]


def test_a_truncated_file_stops_only_the_optimizers_that_read_it(tmp_path: Path) -> None:
    other, value, own = run_distributed(_other_optimizer_body, 1, str(tmp_path))[0]
    assert other == "no error" and value == "[0.5, 0.5, 0.5]", (other, value)
    assert own.startswith("OffloadError") and "truncated or replaced" in own, own


def _options_body(tmp: str) -> list[str]:
    out = []
    for kwargs in ({"offload": "host"}, {"offload": "nvme", "offload_dir": tmp}, {"offload_dir": tmp},
                   {"offload": "disk"}):
        try:
            bmt.BMTrainModelWrapper(_build("toy"), **kwargs)
            out.append("no error")
        except (OffloadError, UnsupportedError) as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def test_offload_options_are_checked() -> None:
    host, unknown, dir_only, no_dir = run_distributed(_options_body, 1, "/tmp")[0]
    assert host.startswith("OffloadError") and "use offload='disk'" in host, host
    assert unknown.startswith("OffloadError") and "'nvme'" in unknown, unknown
    assert dir_only.startswith("OffloadError") and "without offload='disk'" in dir_only, dir_only
    assert no_dir.startswith("OffloadError") and "needs offload_dir=" in no_dir, no_dir


# ---- warnings: an offload that saves less than it seems to -------------------------------------------------
def _offload_warnings(fn: Any) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if issubclass(w.category, OffloadWarning)]


def _kept_state_body(tmp: str) -> dict[str, list[str]]:
    """Two steps of each optimizer on an offloaded toy GPT; the OffloadWarnings each one gave."""
    out = {}
    for kind in ("ours", "managed", "torch", "before_wrap", "momentum", "disk", "sgd"):
        model = _build("toy")
        early = torch.optim.AdamW(model.parameters(), lr=1e-2) if kind == "before_wrap" else None
        model = bmt.BMTrainModelWrapper(model, offload="disk", offload_dir=tmp)
        if early is not None:  # moved onto the sharded parameters at its first step
            opt: Any = early
        elif kind in ("momentum", "sgd"):
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9 if kind == "momentum" else 0.0)
        else:
            opt = _optimizer("ours" if kind == "managed" else kind, model, tmp)
        if kind == "managed":
            mgr = bmt.optim.OptimManager()
            mgr.add_optimizer(opt)
            opt = mgr
        out[kind] = _offload_warnings(lambda: _train(model, opt, "toy", _batches(2, 1), clip=False))  # noqa: B023
    return out


def test_optimizer_state_kept_in_memory_is_said_once(tmp_path: Path) -> None:
    """offload='disk' with an optimizer whose state stays in memory: one OffloadWarning at the first step,
    naming AdamDiskOptimizer and the state's size against the offloaded shards; none for AdamDiskOptimizer
    (its moments are in its file) or a stateless SGD."""
    out = run_distributed(_kept_state_body, 1, str(tmp_path))[0]
    for kind, name, ratio in (("ours", "AdamOptimizer", "2.0x"), ("managed", "AdamOptimizer", "2.0x"),
                              ("torch", "AdamW", "2.0x"), ("before_wrap", "AdamW", "2.0x"),
                              ("momentum", "SGD", "1.0x")):
        assert len(out[kind]) == 1, (kind, out[kind])
        msg = out[kind][0]
        assert msg.startswith(f"{name} keeps ") and f"{ratio} the " in msg, (kind, msg)
        assert "bmt.optim.AdamDiskOptimizer(" in msg and "offload='disk'" in msg, msg
    assert out["disk"] == [] and out["sgd"] == [], out


def _tmpfs_body(tmp: str) -> tuple[list[str], list[str], list[str], list[str]]:
    def wrap_and_step() -> None:  # the half offload's warning too (AdamW's moments stay), at its first step
        model = bmt.BMTrainModelWrapper(_build("toy"), offload="disk", offload_dir="/dev/shm")
        _train(model, _optimizer("torch", model, tmp), "toy", _batches(1, 1), clip=False)

    both = _offload_warnings(wrap_and_step)
    shm = [m for m in both if m.startswith("offload_dir=")]
    kept = [m for m in both if not m.startswith("offload_dir=")]
    adam = _offload_warnings(lambda: bmt.optim.AdamDiskOptimizer([torch.nn.Parameter(torch.ones(4))],
                                                                 offload_dir="/dev/shm"))
    disk = _offload_warnings(lambda: bmt.BMTrainModelWrapper(_build("toy"), offload="disk", offload_dir=tmp))
    return shm, adam, disk, kept


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs a tmpfs at /dev/shm")
def test_offload_dir_on_tmpfs_is_said(tmp_path: Path) -> None:
    (shm, adam, disk, kept), other = run_distributed(_tmpfs_body, 2, str(tmp_path))
    # Said once per node (local rank 0), not by each of its ranks alike; the half offload's warning too.
    assert other == ([], [], [], []), other
    assert len(kept) == 1 and kept[0].startswith("AdamW keeps "), kept
    for msg, what in ((shm, "offloaded shards"), (adam, "optimizer state")):
        assert len(msg) == 1 and msg[0].startswith("offload_dir='/dev/shm' is on tmpfs (mounted at /dev/shm)"), msg
        assert f"the {what} written there stay in memory" in msg[0] and "docs/offload.md" in msg[0], msg
    # pytest's tmp_path, on a disk here; where it is a tmpfs, that is said too (coreutils' statfs answers which).
    fs = subprocess.run(["stat", "-f", "-c", "%T", tmp_path], capture_output=True, text=True, check=True).stdout
    assert len(disk) == (fs.strip() in ("tmpfs", "ramfs")), (fs, disk)


# ---- memory: the kernel's count of the offload file's pages this process holds -----------------------------
def _resident_file_bytes(path: str) -> int:
    """Bytes of ``path``'s mappings resident in this process (/proc/self/smaps, the kernel's count)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's header line
            inside = line.endswith(path)
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def _memory_body(tmp: str, optim: str) -> dict:
    model = bmt.BMTrainModelWrapper(seeded(lambda: ToyGPT(n_layers=8, dim=128)), offload="disk", offload_dir=tmp)
    path = model._bmt_runtime.offload.path
    after_wrap = _resident_file_bytes(path)
    groups = model._bmt_runtime.groups
    shard_bytes = [sum(b.shard.numel() * b.shard.element_size() for b in g.buffers) for g in groups]
    samples: list[int] = []
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda *_: samples.append(_resident_file_bytes(path)))
    opt = _optimizer(optim, model, tmp)
    step_peak = []
    opt.register_step_pre_hook(lambda *_: step_peak.append(_resident_file_bytes(path)))
    batches = _batches(2, 1)
    _train(model, opt, "toy", batches, clip=False)
    est = model.plan.estimates[str(bmt.world_size())]
    return {"plan_offload": model.plan.offload, "plan_params": est.params, "plan_read": est.disk_read,
            "after_wrap": after_wrap, "in_blocks": max(samples), "largest_group": max(shard_bytes), "all_shards": sum(shard_bytes),
            "before_step": max(step_peak), "after_step": _resident_file_bytes(path)}


@pytest.mark.parametrize("world_size,optim", [(1, "ours"), (2, "torch")])
def test_offloaded_pages_leave_the_process(tmp_path: Path, world_size: int, optim: str) -> None:
    for res in run_distributed(_memory_body, world_size, str(tmp_path), optim):
        page = 4096
        assert res["after_wrap"] <= 8 * page, res  # each shard left memory once written
        # model.plan counts the shards in flight, not all of them, and the bytes read per step
        assert res["plan_offload"] == "disk" and res["plan_params"] < res["all_shards"] < res["plan_read"], res
        # While blocks run: the root's shard and a few blocks' (gathering, read ahead), never all of them.
        assert res["in_blocks"] <= 4 * res["largest_group"] + 8 * page, res
        assert res["in_blocks"] < res["all_shards"] / 2, res
        # Gradient shards left as their reduce-scatters ended; the optimizer step dropped what it touched.
        assert res["before_step"] <= 2 * res["largest_group"] + 8 * page, res
        assert res["after_step"] == 0, res


def _generate_body(tmp: str) -> bool:
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(bmt.rank()))
    settings = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": VOCAB - 1}
    plain = bmt.BMTrainModelWrapper(llama()).eval()
    off = bmt.BMTrainModelWrapper(llama(), offload="disk", offload_dir=tmp).eval()
    plain(ids), off(ids)  # first calls capture the schedule (as tests/test_generate.py does)
    return torch.equal(plain.generate(ids, **settings), off.generate(ids, **settings))


def test_generate_reads_offloaded_parameters(tmp_path: Path) -> None:
    assert run_distributed(_generate_body, 2, str(tmp_path)) == [True, True]
