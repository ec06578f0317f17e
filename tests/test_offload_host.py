"""``BMTrainModelWrapper(offload="host")``: each rank's shards, gradient shards, no_sync accumulators and
optimizer state in host memory, each shard copied to the device one block ahead of its gather and each
gradient shard copied home when its reduce-scatter ends; training is bit-equal to the same job without
offload.

On CPU the host store runs through its test seam (``offload_option.HOST_ON_CPU``): the same store, the same
read-ahead, device copies, reduce-then-copy-home and chunked optimizer step as on CUDA, with plain copies
in place of pinned memory and a side stream. The CUDA job itself is ``test_cuda_job_is_bit_equal``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import test_offload as disk
import torch
from dist_harness import run_distributed

import bmt_wrap as bmt
from bmt_wrap.optim import host_chunks
from bmt_wrap.runtime.host_store import HostStore
from bmt_wrap.wrapping.offload_option import HOST_ON_CPU

WORLD_SIZES = [1, 2, 4]


def _wrap_on_host(kind: str) -> torch.nn.Module:
    os.environ[HOST_ON_CPU] = "1"
    try:
        return bmt.BMTrainModelWrapper(disk._build(kind), offload="host")
    finally:
        del os.environ[HOST_ON_CPU]


def _parity_body(model_kind: str, optim: str, micro: int, clip: bool) -> dict:
    host_chunks.CHUNK_ELEMS = 1000  # several chunks per run: chunking must change no bit
    batches = disk._batches(3, micro)
    plain = bmt.BMTrainModelWrapper(disk._build(model_kind))
    off = _wrap_on_host(model_kind)
    store = off._bmt_runtime.offload
    assert isinstance(store, HostStore)
    est = next(iter(off.plan.estimates.values()))
    assert off.plan.offload == "host" and est.host_to_device is not None, "model.plan counts the device"
    homes = [b.home for g in off._bmt_runtime.groups for b in g.buffers]
    assert homes and all(h is not None and h.store is store for h in homes), "every buffer's shard in the store"
    a = disk._train(plain, disk._optimizer(optim, plain, "/unused"), model_kind, batches, clip)
    b = disk._train(off, disk._optimizer(optim, off, "/unused"), model_kind, batches, clip)
    # Where things live: parameters and gradients are the store's host tensors, not copies of them.
    in_store = all(store.holds(p.to_local().data_ptr()) for p in off.parameters() if p.to_local().numel())
    b_grads = [p for p in off.parameters() if p.grad is not None and p.grad.to_local().numel()]
    return {"losses_equal": all(torch.equal(x, y) for x, y in zip(a, b, strict=True)),
            "differ": disk._same(plain, off), "progress": float(a[-1 - int(clip)]) < float(a[micro - 1]),
            "params_in_store": in_store, "stats": (store.stats.read_ahead, store.stats.copied_when_needed),
            "grads": len(b_grads)}


def _check(results: list[dict], ahead: bool = True) -> None:
    """Bit-equal, the parameters are the store's, and every gather sent a device copy: ``ahead``, some read
    one block ahead (a model with a block beyond the prefetch depth's gathers)."""
    disk._check(results)
    for rank, res in enumerate(results):
        assert res["params_in_store"], f"rank {rank}: a parameter is not a view of the host store"
        read_ahead, when_needed = res["stats"]
        assert read_ahead + when_needed > 0, f"rank {rank}: no gather went through the store's device copies"
        if ahead:
            assert read_ahead > 0, f"rank {rank}: no gather was served by a copy read one block ahead: {res['stats']}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("optim", ["ours", "torch"])
def test_toy_gpt_is_bit_equal(world_size: int, optim: str) -> None:
    _check(run_distributed(_parity_body, world_size, "toy", optim, 1, False))


@pytest.mark.parametrize("world_size", [1, 2])
def test_transformers_llama_is_bit_equal(world_size: int) -> None:
    _check(run_distributed(_parity_body, world_size, "llama", "ours", 1, False), ahead=False)  # two layers


@pytest.mark.parametrize("world_size,optim", [(1, "ours"), (2, "torch"), (4, "ours")])
def test_no_sync_accumulation_and_clipping_are_bit_equal(world_size: int, optim: str) -> None:
    _check(run_distributed(_parity_body, world_size, "toy", optim, 3, True))


def _refused_body() -> str:
    try:
        bmt.BMTrainModelWrapper(disk._build("toy"), offload="host")
    except bmt.errors.OffloadError as exc:
        return str(exc)
    return "no error"


def test_cpu_job_without_the_seam_is_told_to_use_disk() -> None:
    assert "use offload='disk'" in run_distributed(_refused_body, 1)[0]


_CUDA_JOB = r"""
import sys
sys.path.insert(0, {tests!r})
import torch
import bmt_wrap as bmt
from models import SEQ, VOCAB, ToyGPT, seeded
bmt.init_distributed(seed=0)
g = torch.Generator().manual_seed(1)
batch = [(torch.randint(0, VOCAB, (2, SEQ), generator=g).cuda(), torch.randint(0, VOCAB, (2, SEQ), generator=g).cuda())
         for _ in range(3)]
def train(offload):
    model = bmt.BMTrainModelWrapper(seeded(lambda: ToyGPT(n_layers=3)).cuda(), offload=offload)
    opt = bmt.optim.AdamOptimizer(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(3):
        for i, (idx, tgt) in enumerate(batch):
            if i < len(batch) - 1:
                with model.no_sync():
                    loss = model(idx, tgt) / len(batch)
                    loss.backward()
            else:
                loss = model(idx, tgt) / len(batch)
                loss.backward()
            losses.append(loss.detach().cpu())
        opt.step()
        opt.zero_grad()
    return model, losses
plain, a = train(None)
off, b = train("host")
store = off._bmt_runtime.offload
assert all(p.to_local().is_pinned() for p in off.parameters()), "shards in pinned host memory"
assert store.stats.read_ahead > 0, store.stats
same = all(torch.equal(x, y) for x, y in zip(a, b))
params = all(torch.equal(p.full_tensor().cpu(), q.full_tensor().cpu()) for p, q in zip(plain.parameters(), off.parameters()))
print("BIT_EQUAL", same and params)
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: offload='host' on a CUDA job")
def test_cuda_job_is_bit_equal() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    code = _CUDA_JOB.format(tests=str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "BIT_EQUAL True" in out.stdout, out.stdout + out.stderr[-2000:]
