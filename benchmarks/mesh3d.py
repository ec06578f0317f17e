"""A 3-D mesh (HSDP replicas x ZeRO-3 shard group x TP) against TP x DP without HSDP, side by side.

    torchrun --nproc_per_node=8 benchmarks/mesh3d.py [--model toy-gpt-small] [--shard-size 2] [--tp-size 2]
                                                     [--steps 5] [--warmup 2] [--rounds 2] [--out table.md]

Systems, in one torchrun job, each wrapped afresh in every round and the rounds alternating (one layout per
process at a time: a model is dropped before the other is wrapped): ``tp x dp`` is
``BMTrainModelWrapper(model, tp_size=T, tp_plan=...)`` (ZeRO-3 over the N/T data-parallel ranks) and
``3-D`` is ``BMTrainModelWrapper(model, mesh=init_device_mesh(..., (N/(S T), S, T), mesh_dim_names=
("replicate", "shard", "tp")), tp_plan=...)``. Both train the same global batches with
``torch.optim.AdamW(fused=True)``. Per mesh axis, the bytes each rank's communicator moved in a step
(``bmt.comm_stats(by_group=True)``: the algorithmic bytes, what a ring sends) beside the plan's
(``passes.estimate_mesh`` with a node of S x T ranks), checked equal on every rank; and the median step
time of each system, with the ratio. Writes ``--out`` (default ``benchmarks/results/mesh3d_<model>.md``),
which RESULTS.md quotes.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from pathlib import Path

import torch
from report import publish
from systems import TOY_TP_PLAN
from workloads import WORKLOADS

import bmt_wrap as bmt
from bmt_wrap import passes
from bmt_wrap.base.plan import fmt_bytes

AXES = ("replicate", "shard", "dp", "tp", "world")  # "dp": the shard group of a TP x DP layout


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, loss_fn, batch) -> float:
    bmt.synchronize()
    start = time.perf_counter()
    loss_fn(model, *batch).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def _run(system: str, args: argparse.Namespace, batches: list) -> dict:
    """Wrap the workload as ``system``, train ``warmup + steps`` steps; times, bytes per axis, plan's."""
    from torch.distributed.device_mesh import init_device_mesh

    wl, n, t, s = WORKLOADS[args.model], bmt.world_size(), args.tp_size, args.shard_size
    plan = TOY_TP_PLAN if wl.name.startswith("toy") else None
    model = wl.build(args.seq)
    if system == "3-D":
        mesh = init_device_mesh("cpu", (n // (s * t), s, t), mesh_dim_names=("replicate", "shard", "tp"))
        model = bmt.BMTrainModelWrapper(model, mesh=mesh, tp_plan=plan)
    else:
        model = bmt.BMTrainModelWrapper(model, tp_size=t, tp_plan=plan)
    layout = bmt.distributed.tensor_parallel()
    dp_rank = layout.dp_rank
    share = args.batch  # every data-parallel rank's rows of the global batch
    local = [tuple(x[dp_rank * share:(dp_rank + 1) * share] for x in b) for b in batches]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    times, counted = [], None
    for i, batch in enumerate(local):
        bmt.reset_comm_stats()
        elapsed = _step(model, opt, wl.loss, batch)
        if i >= args.warmup:
            times.append(elapsed)
            step = {axis: sum(v["bytes"] for v in ops.values()) for axis, ops in
                    bmt.comm_stats(by_group=True).items() if axis in AXES}
            assert counted is None or step == counted, f"{system}: bytes differ between steps: {step} {counted}"
            counted = step
    shard = layout.dp.shard_size
    est = passes.estimate_mesh(model.plan, n, shard, s * t, tokens=local[0][0].numel(),
                               shard_rank=layout.dp.shard_rank)
    mask = est.comm_total - est.comm_replicas - est.comm_shard - est.comm_tp  # the used-parameter mask
    planned = ({"replicate": est.comm_replicas, "shard": est.comm_shard} if system == "3-D" else
               {"dp": est.comm_shard}) | {"tp": est.comm_tp, "world": mask}
    del model, opt
    gc.collect()  # the next system's layout may differ: no group of this one may stay alive
    return {"times": times, "counted": counted, "planned": planned, "shard": shard}


def main() -> None:
    """Alternate the two systems over rounds; rank 0 writes the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="toy-gpt-small", choices=list(WORKLOADS))
    parser.add_argument("--shard-size", type=int, default=2)
    parser.add_argument("--tp-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2, help="sequences per data-parallel rank")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    state = bmt.init_distributed(seed=0, backend="gloo")
    n, t, s = state.world_size, args.tp_size, args.shard_size
    if n % (s * t) or n // (s * t) < 2:
        raise SystemExit(f"--nproc_per_node {n} must be a multiple of shard size x TP size ({s} x {t}) with at "
                         "least 2 replicas")
    wl = WORKLOADS[args.model]
    batches = wl.batches(args.warmup + args.steps, args.batch * (n // t), args.seq)
    systems = ("tp x dp", "3-D")
    results: dict[str, list[dict]] = {k: [] for k in systems}
    for r in range(args.rounds):
        for system in systems if r % 2 == 0 else reversed(systems):
            results[system].append(_run(system, args, batches))
    mine = {k: {"counted": v[0]["counted"], "planned": v[0]["planned"]} for k, v in results.items()}
    for k, v in mine.items():  # an axis of one rank moves nothing and is not counted at all
        counted = {axis: v["counted"].get(axis, 0) for axis in v["planned"]}
        assert counted == v["planned"] and set(v["counted"]) <= set(counted), \
            f"rank {state.rank}, {k}: counted {v['counted']} != plan {v['planned']}"
    if state.rank != 0:
        return
    median = {k: statistics.median(x for run in v for x in run["times"]) for k, v in results.items()}
    replicas = n // (s * t)
    names = {"tp x dp": f"TP {t} x DP {n // t} (ZeRO-3 over {n // t})",
             "3-D": f"HSDP {replicas} x {s} x TP {t}"}
    params = sum(p.numel() for p in wl.build(args.seq).parameters())
    lines = [f"{wl.describe}, {params / 1e6:.1f}M params, {n} ranks (gloo, one machine), batch {args.batch} x seq "
             f"{args.seq} per data-parallel rank, {args.steps} steps x {args.rounds} rounds after {args.warmup} "
             f"warm-up, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}; rank 0's bytes per step (every "
             "rank's equal its plan's), the plan's node: one shard group's ranks and their TP peers",
             "", "| system | axis | group size | counted / step | plan / step | counted vs plan |",
             "|---|---|---|---|---|---|"]
    crossing = {"replicate", "dp", "world"}  # groups that span nodes of S x T ranks
    # Whole parameters' buffers are sharded over the shard (dp) group x TP: those axes run at two sizes.
    sizes = {"replicate": replicas, "shard": f"{s} and {s * t}", "dp": f"{n // t} and {n}", "tp": t, "world": n}
    where = {"replicate": "inter-node", "shard": "intra-node", "dp": "spans nodes", "tp": "intra-node",
             "world": "spans nodes"}
    for k in systems:
        for axis, planned in mine[k]["planned"].items():
            got = mine[k]["counted"].get(axis, 0)
            ratio = f"{got / planned:.2f}x" if planned else "-"
            lines.append(f"| {names[k]} | {axis} ({where[axis]}) | {sizes[axis]} | {fmt_bytes(got)} | "
                         f"{fmt_bytes(planned)} | {ratio} |")
    lines += ["", "| system | step s: median (min-max) | time vs TP x DP | comm / step | across nodes / step |",
              "|---|---|---|---|---|"]
    for k in systems:
        all_times = [x for run in results[k] for x in run["times"]]
        counted = mine[k]["counted"]
        lines.append(f"| {names[k]} | {median[k]:.3f} ({min(all_times):.3f}-{max(all_times):.3f}) | "
                     f"{median[k] / median['tp x dp']:.2f}x | {fmt_bytes(sum(counted.values()))} | "
                     f"{fmt_bytes(sum(v for a, v in counted.items() if a in crossing))} |")
    publish(lines, args.out or Path(__file__).parent / "results" / f"mesh3d_{args.model}.md")


if __name__ == "__main__":
    main()
