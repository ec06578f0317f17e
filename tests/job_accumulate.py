"""Gradient accumulation through accelerate's ``accumulate()``, run under torchrun by tests/test_integrations.py.

Usage: ``torchrun --nproc_per_node=2 job_accumulate.py OUT_DIR``. The same loop (``with
accelerator.accumulate(model)``: backward, clip and SGD step when ``sync_gradients``) over the same data on
the same tiny GPT-2, ``gradient_accumulation_steps=4``, two optimizer steps:

1. plain model, stock ``accelerate.Accelerator`` (DDP on top, its ``no_sync`` on accumulating steps);
2. wrapped model, ``bmt_wrap.integrations.accelerate.Accelerator``: accumulate() enters ``model.no_sync()``.

Rank 0 writes ``OUT_DIR/results.pt``: per run the losses, the final full weights and, for ours, each
micro-batch's ``sync_gradients`` and reduce-scatter (calls, bytes).
"""

from __future__ import annotations

import sys

import accelerate
import torch
from job_trainer import build, dataset
from torch.utils.data import DataLoader

import bmt_wrap as bmt
from bmt_wrap.integrations.accelerate import Accelerator

ACCUMULATE, MICRO_BATCHES = 4, 8


def run(accelerator: accelerate.Accelerator, model: torch.nn.Module) -> dict[str, object]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(dataset(), batch_size=2, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, synced, reduce_scatters = [], [], []
    for step, batch in enumerate(loader):
        if step == MICRO_BATCHES:
            break
        bmt.reset_comm_stats()
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            seen = bmt.comm_stats().get("reduce_scatter", {"calls": 0, "bytes": 0})
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        synced.append(accelerator.sync_gradients)
        reduce_scatters.append((seen["calls"], seen["bytes"]))
        losses.append(float(accelerator.reduce(loss.detach(), "mean")))
    return {"losses": losses, "synced": synced, "reduce_scatters": reduce_scatters,
            "weights": accelerator.get_state_dict(model)}


def main(out: str) -> None:
    bmt.init_distributed(seed=0)
    results = {"ddp": run(accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE), build())}
    results["bmt"] = run(Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE),
                         bmt.BMTrainModelWrapper(build()))
    if bmt.rank() == 0:
        torch.save(results, f"{out}/results.pt")
    bmt.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
