"""Engine benchmark: bmt_wrap's engine vs FSDP2 (fully_shard per block + root) vs DDP, side by side.

    python benchmarks/engine.py [--world-size 2] [--steps 12] [--warmup 3] [--rounds 2] [--json out.json]

Each system runs in its own ``torchrun`` job (fresh processes, so peak RSS is per system) with the same
model, data, seed, ``OMP_NUM_THREADS`` and ``MALLOC_MMAP_THRESHOLD_``; systems are interleaved over
``--rounds`` so machine noise hits all of them alike. Every system uses fused AdamW.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SYSTEMS = ("bmt_wrap", "fsdp2", "ddp")
HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(system: str, steps: int, warmup: int, out_dir: str) -> None:
    """One rank of one system: train, then write its measurements as JSON into ``out_dir``."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))
    from toy_gpt import ToyGPT, token_batches

    import bmt_wrap as bmt

    bmt.init_distributed(seed=0)
    rank, n = bmt.rank(), bmt.world_size()
    torch.manual_seed(0)
    model = ToyGPT()
    cfg = model.cfg
    n_params = sum(p.numel() for p in model.parameters())
    if system == "bmt_wrap":
        model = _wrap_bmt(model)
    elif system == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    elif system == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batches = token_batches(cfg, warmup + steps, batch=n)
    times, loss = [], 0.0
    for i, (idx, tgt) in enumerate(batches):
        if i == warmup:
            bmt.reset_comm_stats()
        dist.barrier()
        t0 = time.perf_counter()
        out = model(idx[rank:rank + 1], tgt[rank:rank + 1])
        out.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - t0
        if i >= warmup:
            times.append(elapsed)
        loss = float(bmt.sum_loss(out.detach()))
    stats = bmt.comm_stats()
    comm_bytes = sum(v["bytes"] for k, v in stats.items() if k != "broadcast") / max(1, steps)
    result = {"system": system, "rank": rank, "times": times, "loss": loss,
              "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "params": n_params,
              "comm_bytes": comm_bytes if system == "bmt_wrap" else None}
    Path(out_dir, f"{system}-{rank}.json").write_text(json.dumps(result))
    dist.barrier()


def _wrap_bmt(model):
    # The engine benchmark marks blocks by hand (the wrapper benchmark is compare.py).
    from bmt_wrap.apply_plan import apply_plan
    from bmt_wrap.dtypes import dtype_name
    from bmt_wrap.plan import ROOT, ParamInfo, ShardGroupSpec, WrapPlan, layout_buffers

    def infos(prefix_ok):
        return [ParamInfo(n, list(p.shape), dtype_name(p.dtype), p.requires_grad)
                for n, p in model.named_parameters() if prefix_ok(n)]

    blocks = [f"blocks.{i}" for i in range(len(model.blocks))]
    groups = [ShardGroupSpec(ROOT, layout_buffers(infos(lambda n: not n.startswith("blocks."))))]
    groups += [ShardGroupSpec(b, layout_buffers(infos(lambda n, b=b: n.startswith(b + ".")))) for b in blocks]
    return apply_plan(model, WrapPlan(groups=groups, prefetch_depth=1, order=blocks, capture="explicit"))


def launch(system: str, world_size: int, steps: int, warmup: int, env: dict[str, str]) -> list[dict]:
    """Run one system under torchrun; returns each rank's result."""
    with tempfile.TemporaryDirectory() as out_dir:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world_size}",
               f"--master_port={_free_port()}", str(Path(__file__).resolve()), "--worker", system,
               "--steps", str(steps), "--warmup", str(warmup), "--out-dir", out_dir]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        results = [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("*.json"))]
    if proc.returncode != 0 or len(results) != world_size:
        raise RuntimeError(f"{system} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return results


def summarize(runs: dict[str, list[list[dict]]], world_size: int) -> list[dict]:
    """Median step time (over every measured step of every round), min-max, peak RSS per rank."""
    rows = []
    for system, rounds in runs.items():
        times = [max(step) for r in rounds for step in zip(*(rank["times"] for rank in r))]
        rss = max(rank["rss"] for r in rounds for rank in r)
        first = rounds[-1][0]
        psi = first["params"] * 4
        rows.append({"system": system, "median_s": statistics.median(times), "min_s": min(times),
                     "max_s": max(times), "peak_rss": rss, "loss": first["loss"], "comm_bytes": first["comm_bytes"],
                     "zero3_bound": 3 * psi * (world_size - 1) / world_size})
    base = next((r for r in rows if r["system"] == "fsdp2"), None)
    for r in rows:
        r["time_vs_fsdp2"] = r["median_s"] / base["median_s"] if base else None
        r["rss_vs_fsdp2"] = r["peak_rss"] / base["peak_rss"] if base else None
    return rows


def print_table(rows: list[dict]) -> None:
    """One line per system."""
    head = f"{'system':<10} {'step s (median, min-max)':<26} {'x FSDP2':>8} {'peak RSS/rank':>14} {'x FSDP2':>8} " \
           f"{'comm/step':>11} {'ZeRO-3 bound':>13} {'final loss':>10}"
    print(head)
    print("-" * len(head))
    for r in rows:
        comm = f"{r['comm_bytes'] / 1e6:.1f} MB" if r["comm_bytes"] is not None else "-"
        print(f"{r['system']:<10} {r['median_s']:.3f} ({r['min_s']:.3f}-{r['max_s']:.3f}){'':<6} "
              f"{r['time_vs_fsdp2']:>8.2f} {r['peak_rss'] / 2**30:>10.2f} GiB {r['rss_vs_fsdp2']:>8.2f} "
              f"{comm:>11} {r['zero3_bound'] / 1e6:>9.1f} MB {r['loss']:>10.4f}")


def main(argv: list[str] | None = None) -> None:
    """Run every system, interleaved, and print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--mmap-threshold", default="glibc-default",
                        help="MALLOC_MMAP_THRESHOLD_ for every system, or glibc-default to leave it unset")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        run_worker(args.worker, args.steps, args.warmup, args.out_dir)
        return
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if args.mmap_threshold != "glibc-default":  # same allocator behaviour for every system either way
        env["MALLOC_MMAP_THRESHOLD_"] = args.mmap_threshold
    systems = args.systems.split(",")
    runs: dict[str, list[list[dict]]] = {s: [] for s in systems}
    for _ in range(args.rounds):
        for system in systems:
            runs[system].append(launch(system, args.world_size, args.steps, args.warmup, env))
    rows = summarize(runs, args.world_size)
    print(f"toy GPT, {rows and runs[systems[0]][0][0]['params'] / 1e6:.1f}M params, {args.world_size} ranks, "
          f"batch 1/rank, OMP_NUM_THREADS={env['OMP_NUM_THREADS']}, "
          f"MALLOC_MMAP_THRESHOLD_={env.get('MALLOC_MMAP_THRESHOLD_', 'unset (glibc default)')}")
    print_table(rows)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
