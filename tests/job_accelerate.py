"""An accelerate training loop run under torchrun by tests/test_integrations.py, as a user writes one.

Usage: ``torchrun --nproc_per_node=2 job_accelerate.py OUT_DIR [EXAMPLES]``. The same loop (prepare,
backward, ``clip_grad_norm_(…, 1.0)``, AdamW step) over the same data on the same tiny GPT-2:

1. plain model, stock ``accelerate.Accelerator`` (DDP on top): the reference;
2. wrapped model, ``bmt_wrap.integrations.accelerate.Accelerator``; ``save_state`` after step 3;
3. a fresh wrapped model and optimizer that ``load_state`` that folder and run steps 4 and 5;
4. a wrapped model given to the stock ``accelerate.Accelerator``, which puts DDP on it: the error message.

Then gradient accumulation through ``accumulate()`` (``gradient_accumulation_steps=4``, two SGD steps; clip
and step when ``sync_gradients``), plain with the stock Accelerator (DDP's ``no_sync`` on accumulating
steps) and wrapped with ours (``model.no_sync()``), recording each micro-batch's ``sync_gradients`` and
reduce-scatter (calls, bytes). Then the example runs in EXAMPLES (tests/in_job.py), in this job.

Rank 0 writes ``OUT_DIR/results.pt`` (per run: losses, gradient norms, final full weights).
"""

from __future__ import annotations

import sys

import accelerate
import torch
from in_job import run_examples
from job_trainer import build, dataset
from torch.utils.data import DataLoader

import bmt_wrap as bmt
from bmt_wrap.errors import ShardedTensorError
from bmt_wrap.integrations.accelerate import Accelerator

STEPS, SAVE_AT = 5, 3
ACCUMULATE, MICRO_BATCHES = 4, 8


def run(accelerator: accelerate.Accelerator, model: torch.nn.Module, steps: range, save: str | None = None,
        load: str | None = None) -> dict[str, object]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(dataset(), batch_size=2, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if load is not None:
        accelerator.load_state(load)
    losses, norms = [], []
    for step, batch in enumerate(loader):
        if step not in steps:
            continue
        loss = model(**batch).loss
        accelerator.backward(loss)
        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(accelerator.reduce(loss.detach(), "mean")))
        if save is not None and step + 1 == SAVE_AT:
            accelerator.save_state(save)
        if step + 1 == steps.stop:
            break
    return {"losses": losses, "norms": norms, "weights": accelerator.get_state_dict(model)}


def run_accumulating(accelerator: accelerate.Accelerator, model: torch.nn.Module) -> dict[str, object]:
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


def main(out: str, examples: str) -> None:
    bmt.init_distributed(seed=0)
    results = {"ddp": run(accelerate.Accelerator(cpu=True), build(), range(STEPS))}
    results["bmt"] = run(Accelerator(cpu=True), bmt.BMTrainModelWrapper(build()), range(STEPS), save=f"{out}/state")
    results["resumed"] = run(Accelerator(cpu=True), bmt.BMTrainModelWrapper(build()), range(SAVE_AT, STEPS),
                             load=f"{out}/state")
    try:
        accelerate.Accelerator(cpu=True).prepare(bmt.BMTrainModelWrapper(build()))
        results["stock"] = "prepared"
    except ShardedTensorError as exc:
        results["stock"] = str(exc)
    results["accumulate"] = {
        "ddp": run_accumulating(accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE), build()),
        "bmt": run_accumulating(Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE),
                                bmt.BMTrainModelWrapper(build()))}
    if bmt.rank() == 0:
        torch.save(results, f"{out}/results.pt")
    bmt.barrier()
    run_examples(examples)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "[]")
