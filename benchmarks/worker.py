"""One rank of one benchmarked system (run by ``torchrun``; the harness launches it): train, measure, write JSON.

Every system builds the same seeded model, trains it on this rank's slice of the same global batches
(the single-process system on the whole batch) with ``torch.optim.AdamW(fused=True)`` (or the system's own
optimizer: ``systems.OPTIMIZERS``), and times each step between barriers. Communication is read from
``bmt.comm_stats()`` around the step only.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist
from systems import OPTIMIZERS, OURS, PIPE_SIZES, SYSTEMS, TP_SIZES
from workloads import WORKLOADS

import bmt_wrap as bmt
from bmt_wrap import passes
from bmt_wrap.runtime.pipeline import action_times, reset_transfer_time, transfer_time


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _step_comm_bytes() -> int:
    # Bytes a rank sends: collectives' algorithmic bytes, and point to point what it sent (not received).
    return sum(v["bytes"] for op, v in bmt.comm_stats().items() if op != "recv")


def run(system: str, workload: str, steps: int, warmup: int, seq: int, global_batch: int) -> dict:
    """Train ``steps + warmup`` steps; return this rank's measurements."""
    bmt.init_distributed(seed=0, pipe_size=PIPE_SIZES.get(system, 1))
    rank, n = bmt.rank(), bmt.world_size()
    wl = WORKLOADS[workload]
    model = wl.build(seq)
    n_params = sum(p.numel() for p in model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # Ψ of the ZeRO-3 bound
    batches = wl.batches(warmup + steps, global_batch, seq)
    # TP peers compute one batch together: the data is split over the data-parallel ranks only.
    tp = TP_SIZES.get(system, 1)
    dp_rank, dp = rank // tp, n // tp
    if system in PIPE_SIZES:  # the stages of a pipeline take the same slice
        dp_rank, dp = bmt.data_parallel_rank(), bmt.data_parallel_size()
    share = global_batch // dp
    rows = slice(None) if dp == 1 else slice(dp_rank * share, (dp_rank + 1) * share)
    model = SYSTEMS[system](model, wl, (batches[0][0][rows], batches[0][1][rows]))
    opt = (OPTIMIZERS[system](model) if system in OPTIMIZERS
           else torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))
    times, losses, comm, idle, actions = [], [], [], [], []
    schedule = os.environ.get("BMT_PP_SCHEDULE")  # pipeline stages: model.pipeline_step(schedule=) if set
    for i, (idx, tgt) in enumerate(batches):
        _barrier()
        bmt.reset_comm_stats()
        reset_transfer_time()
        t0 = time.perf_counter()
        if schedule:  # one whole step in the order of torch's schedule
            args, kwargs = wl.call(idx[rows], tgt[rows])
            loss = model.pipeline_step(*args, schedule=schedule, **kwargs)
        else:
            loss = wl.loss(model, idx[rows], tgt[rows])
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - t0
        step_bytes = _step_comm_bytes()
        losses.append(float(bmt.sum_loss(loss.detach())))
        if i >= warmup:
            times.append(elapsed)
            comm.append(step_bytes)
            idle.append(transfer_time())  # pipeline stages: waiting for (or moving) activations
            actions.append(action_times())  # a torch schedule's actions and their CPU seconds
    plan = getattr(model, "plan", None)
    estimate = plan.estimates.get(str(dp)) if plan is not None else None
    if plan is not None and plan.tensor_parallel is not None:  # TP traffic needs the batch's token count
        estimate = passes.estimate_tp(plan, dp, tokens=batches[0][0][rows].numel())
    return {"system": system, "rank": rank, "world_size": n, "params": n_params, "times": times, "losses": losses,
            "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "comm_bytes": sum(comm) / len(comm) if system in OURS and comm else None,
            "plan_comm_bytes": estimate.comm_total if estimate is not None else None, "param_bytes": param_bytes,
            "kept": _kept(plan), "disk_io": vars(opt.last_step_io) if hasattr(opt, "last_step_io") else None,
            "offload_reads": _offload_reads(model),
            "stage": bmt.parallel_layout().pp_rank, "idle": idle, **_pipeline(model, schedule, actions)}


def _pipeline(model: torch.nn.Module, schedule: str | None, actions: list) -> dict:
    """Pipeline stages: the plan's split (blocks per stage), this rank's pipeline (its data-parallel rank) and,
    under a torch schedule, each step's actions in the order they ran, with their thread CPU seconds."""
    if getattr(model, "_bmt_pipeline", None) is None:
        return {}
    return {"split": [len(s.blocks) for s in model.plan.pipeline.stages], "pipeline": bmt.data_parallel_rank(),
            "actions": actions if schedule else None}


def _offload_reads(model: torch.nn.Module) -> dict | None:
    """A model wrapped with offload="disk": its shard files' read-ahead statistics over the run."""
    shards = getattr(getattr(model, "_bmt_runtime", None), "offload", None)
    return vars(shards.stats) if shards is not None else None


def _kept(plan: bmt.WrapPlan | None) -> dict | None:
    """Which blocks the executed plan let keep activations (no recompute) and parameters (no re-gather)."""
    if plan is None:
        return None
    blocks = plan.blocks()
    return {"blocks": len(blocks), "activations": [g.name for g in blocks if not g.checkpoint],
            "parameters": [g.name for g in blocks if g.zero_level == 2], "prefetch_depth": plan.prefetch_depth,
            "memory_budget": plan.memory_budget}


def main() -> None:
    """Parse the harness's arguments, run, write ``<out-dir>/<system>-<rank>.json``."""
    p = argparse.ArgumentParser()
    p.add_argument("--system", required=True, choices=list(SYSTEMS))
    p.add_argument("--workload", required=True, choices=list(WORKLOADS))
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--out-dir", required=True)
    args = p.parse_args()
    result = run(args.system, args.workload, args.steps, args.warmup, args.seq, args.global_batch)
    Path(args.out_dir, f"{args.system}-{result['rank']}.json").write_text(json.dumps(result))
    _barrier()


if __name__ == "__main__":
    main()
