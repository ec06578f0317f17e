"""The collective-order check compares what defines an operation, not text that may differ by rank (a save
path); when ranks do disagree, the message names each side's call and a hint that fits it."""

from __future__ import annotations

import re
import time
from datetime import timedelta
from pathlib import Path

import pytest
import safetensors.torch
import torch
from dist_harness import raised, run_distributed
from toy import ToyGPT

import bmt_wrap as bmt
from bmt_wrap.distributed import get_state
from bmt_wrap.runtime.comm import FingerprintCommunicator, collective_purpose

DEADLINE_S = 30  # every rank has its error within this


def _save_to_a_path_per_rank(directory: str) -> bool:
    torch.manual_seed(0)
    model = bmt.BMTrainModelWrapper(ToyGPT())
    path = Path(directory) / f"model_rank{bmt.rank()}.safetensors"
    bmt.save(model, path)
    full = model.state_dict()
    if not path.exists():
        return False
    saved = safetensors.torch.load_file(path)
    assert saved.keys() == full.keys(), (sorted(saved), sorted(full))
    for name, value in full.items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=0, msg=name)
    return True


def test_a_save_path_may_differ_by_rank_and_rank_0_writes_it(tmp_path: Path) -> None:
    results = run_distributed(_save_to_a_path_per_rank, 2, str(tmp_path))
    assert results == [True, False]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model_rank0.safetensors"]


def _save_on_rank_0_only(directory: str) -> tuple[str, str]:
    get_state().comm.timeout = timedelta(seconds=20)
    torch.manual_seed(0)
    model = bmt.BMTrainModelWrapper(ToyGPT())
    idx = torch.randint(0, 64, (2, 8))

    def step() -> None:
        if bmt.rank() == 0:
            bmt.save(model, Path(directory) / "model.safetensors")
        model(idx, idx).backward()
        bmt.synchronize()

    return raised(step)


def test_a_save_on_one_rank_only_names_the_save(tmp_path: Path) -> None:
    start = time.monotonic()
    results = run_distributed(_save_on_rank_0_only, 2, str(tmp_path), timeout=120)
    assert time.monotonic() - start < DEADLINE_S, results
    assert [name for name, _ in results] == ["CollectiveMismatchError"] * 2, results
    for _, message in results:
        assert "bmt.save" in message and "every rank" in message, message
        assert "layer drop" not in message, message


def _save_checkpoint_to_a_directory_per_rank(directory: str) -> tuple[str, str]:
    get_state().comm.timeout = timedelta(seconds=20)
    torch.manual_seed(0)
    model = bmt.BMTrainModelWrapper(ToyGPT())
    return raised(lambda: bmt.save_checkpoint(Path(directory) / f"rank{bmt.rank()}", model))


def test_a_sharded_save_needs_one_directory(tmp_path: Path) -> None:
    # Every rank writes its shard where rank 0 writes the metadata, so here the path must not differ: the
    # save checks that itself, now that the order check no longer compares paths.
    results = run_distributed(_save_checkpoint_to_a_directory_per_rank, 2, str(tmp_path), timeout=120)
    assert [name for name, _ in results] == ["CheckpointError"] * 2, results
    for _, message in results:
        assert re.search(r"bmt.save_checkpoint.*rank 0: '.*rank0'; rank 1: '.*rank1'.*same directory", message), \
            message
    assert not list(tmp_path.rglob("*.safetensors"))  # refused before any rank wrote


def _same_op_other_text(mode: str) -> tuple[str, str]:
    state = get_state()
    inner = state.comm.inner
    state.comm.timeout = timedelta(seconds=20)
    if mode == "debug":  # as on NCCL: the fingerprint round trip is the only check
        state.comm.inner = FingerprintCommunicator(inner)
        inner.check_order = False
    try:
        with collective_purpose("save", f"model_rank{bmt.rank()}.safetensors"):
            state.comm.all_reduce(torch.ones(3), label="save verdict")
        with collective_purpose("save" if bmt.rank() == 0 else "load", "model.safetensors"):
            return raised(lambda: state.comm.all_reduce(torch.ones(3), label="verdict"))
    finally:
        state.comm.inner = inner
        inner.check_order = True


@pytest.mark.parametrize("mode", ["default", "debug"])
def test_order_check_compares_operations_not_their_text(mode: str) -> None:
    results = run_distributed(_same_op_other_text, 2, mode, timeout=120)
    assert [name for name, _ in results] == ["CollectiveMismatchError"] * 2, results
    for _, message in results:
        assert "bmt.save" in message and "bmt.load" in message and "every rank" in message, message
