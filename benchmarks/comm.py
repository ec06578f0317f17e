"""Communicator benchmark: our gloo backend vs plain torch.distributed calls, side by side.

    torchrun --nproc_per_node=2 benchmarks/comm.py [--mib 64] [--repeats 9]

Both run in the same processes on the same buffers, interleaved, so machine noise hits them alike;
it prints and writes (``--out``) a Markdown table of medians, min-max and our time as a fraction of
torch's. This compares gloo implementations on CPU only; it says nothing about NCCL.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from report import publish

import bmt_wrap as bmt

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _time(fn: Callable[[], None]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    """Measure all-gather and reduce-scatter of one buffer both ways and print a table on rank 0."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=64, help="size of the full (unsharded) fp32 buffer")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "comm.md")
    args = parser.parse_args()
    state = bmt.init_distributed()
    comm, n = state.comm, state.world_size
    numel = args.mib * 2**20 // 4 // n * n
    full = torch.randn(numel)
    shard = full[: numel // n].clone()
    out_full, out_shard = torch.empty(numel), torch.empty(numel // n)
    ops = {
        "all-gather": (lambda: comm.all_gather_into(out_full, shard), lambda: _all_gather(out_full, shard)),
        "reduce-scatter": (lambda: comm.reduce_scatter_into(out_shard, full, "sum"),
                           lambda: _reduce_scatter(out_shard, full)),
    }
    rows = []
    for name, (ours, theirs) in ops.items():
        ours(), theirs()  # warm-up: connections, page faults
        t_ours, t_theirs = [], []
        for _ in range(args.repeats):
            t_ours.append(_time(ours))
            t_theirs.append(_time(theirs))
        rows.append((name, t_ours, t_theirs))
    if state.rank == 0:
        gb = numel * 4 / 1e9
        lines = [f"{args.mib} MiB fp32 buffer, {n} ranks, backend {state.backend}, {args.repeats} repeats, "
                 "interleaved", "",
                 "| op | bmt_wrap ms: median (min-max) | torch.distributed ms: median (min-max) | ratio | bmt GB/s |",
                 "|---|---|---|---|---|"]
        for name, a, b in rows:
            ma, mb = statistics.median(a), statistics.median(b)
            lines.append(f"| {name} | {ma * 1e3:.1f} ({min(a) * 1e3:.1f}-{max(a) * 1e3:.1f}) | "
                         f"{mb * 1e3:.1f} ({min(b) * 1e3:.1f}-{max(b) * 1e3:.1f}) | {ma / mb:.2f}x | {gb / ma:.2f} |")
        publish(lines, args.out)
    bmt.synchronize()


if __name__ == "__main__":
    main()
