"""One rank of a small training job that checkpoints every step and resumes from the last checkpoint
(tests/test_restart.py runs it under ``torchrun --max-restarts``).

Usage: ``torchrun --nproc_per_node=2 --max-restarts=2 job_restart.py OUT STEPS KILL_STEP``. Rank 1 kills
itself (SIGKILL: a lost node, no exit hooks) twice at step KILL_STEP: in the first attempt after its
forward, in the second after writing its shard of the checkpoint but before the save completes. torchrun
relaunches every rank each time, and they resume from OUT/ckpt. Rank 0 writes each finished step's loss to
OUT/losses-<attempt>.json and, at the end, the final parameters to OUT/final.safetensors.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from parity import lm_batches  # noqa: E402
from toy import ToyGPT  # noqa: E402

import bmt_wrap as bmt  # noqa: E402
from bmt_wrap.save_load import sharded  # noqa: E402


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _dying_after_own_shard(write: Callable[..., int]) -> Callable[..., int]:
    """``sharded._write_tensors`` that kills this rank once its shard file is written."""
    def write_then_die(*args: Any) -> int:
        size = write(*args)
        _die()
        return size
    return write_then_die


def train(out: str, steps: int, kill_step: int) -> dict[int, float]:
    """Train ``steps`` steps from the last checkpoint in ``out`` (if any), saving one after every step;
    returns this run's losses by step."""
    out_dir = Path(out)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, world = bmt.rank(), bmt.world_size()
    torch.manual_seed(0)
    model = bmt.BMTrainModelWrapper(ToyGPT(d=16, n_layers=2, dropout=0.1))
    opt = bmt.optim.AdamOptimizer(model.parameters(), lr=1e-2, weight_decay=0.1)
    mgr = bmt.optim.OptimManager(loss_scale=None)
    mgr.add_optimizer(opt)
    ckpt = out_dir / "ckpt"
    start = bmt.load_checkpoint(ckpt, model, mgr).step if (ckpt / "metadata.json").is_file() else 0
    batches = lm_batches(steps, 4)
    losses = {}
    for step in range(start, steps):
        idx, tgt = batches[step]
        loss = model(idx.chunk(world)[rank], tgt.chunk(world)[rank])
        dying = step == kill_step and rank == 1
        if dying and attempt == 0:
            _die()
        mgr.backward(loss)
        mgr.step()
        mgr.zero_grad()
        losses[step] = float(bmt.sum_loss(loss))
        if dying and attempt == 1:
            sharded._write_tensors = _dying_after_own_shard(sharded._write_tensors)
        bmt.save_checkpoint(ckpt, model, mgr, step=step + 1)
        if rank == 0:
            (out_dir / f"losses-{attempt}.json").write_text(json.dumps(losses))
    bmt.save(model, out_dir / "final.safetensors")
    return losses


if __name__ == "__main__":
    bmt.init_distributed(seed=0, backend="gloo", timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    train(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
