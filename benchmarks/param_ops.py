"""What the parameter representation costs: torch's optimizer steps and clip_grad_norm_ on a wrapped
model's parameters (``ShardedTensor``s of the original shape, each op dispatched in Python) against the
same ranges as plain 1-D tensors (the representation before issue 21, no dispatch), in one process.

Both sides update the same memory: this rank's ranges of the flat shards and of the gradient shards,
so the difference is the per-op dispatch (pytorch#134191 reports DTensor's for FSDP2's AdamW). No copy
is timed because none is made: parameters are views of the shard, which the all-gather reads directly.

    python benchmarks/param_ops.py [--layers 12] [--width 256] [--rounds 9] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from optim import block_medians  # noqa: E402
from report import publish  # noqa: E402
from toy import ToyGPT  # noqa: E402

import bmt_wrap as bmt  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "param_ops.md"


def plain_twins(model: nn.Module) -> list[nn.Parameter]:
    """Plain 1-D parameters viewing each sharded parameter's local range, gradients likewise."""
    twins = []
    for p in model.parameters():
        twin = nn.Parameter(p.to_local())
        twin.grad = p.grad.to_local()
        twins.append(twin)
    return twins


def paired_ratio(sharded: Callable[[], object], plain: Callable[[], object], pairs: int) -> float:
    """Median over back-to-back (sharded, plain) call pairs of their time ratio: on a shared machine the
    load drifts between blocks, while two neighbouring calls see the same load."""
    ratios = []
    for _ in range(pairs):
        start = time.perf_counter()
        sharded()
        mid = time.perf_counter()
        plain()
        ratios.append((mid - start) / (time.perf_counter() - mid))
    return statistics.median(ratios)


def main() -> None:
    """Time each operation on both representations and write the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=9, help="timed calls per block (median reported)")
    parser.add_argument("--out", type=Path, default=OUT, help="where to write the Markdown table")
    args = parser.parse_args()
    bmt.init_distributed(seed=0)
    model = bmt.BMTrainModelWrapper(ToyGPT(n_layers=args.layers, d=args.width, vocab=4096))
    idx = torch.randint(0, 4096, (2, 32))
    model(idx, idx).backward()
    sharded = list(model.parameters())
    plain = plain_twins(model)
    ops = {
        "AdamW step (single-tensor)": lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=False),
        "AdamW step (foreach)": lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True),
        "SGD step (momentum, single-tensor)": lambda ps: torch.optim.SGD(ps, lr=1e-4, momentum=0.9, foreach=False),
    }
    lines = [f"{len(sharded)} parameters, {sum(p.numel() for p in sharded) / 1e6:.1f}M elements, one process, "
             f"median of 2 × {args.rounds} calls", "",
             "| operation | plain 1-D ms | ShardedTensor ms | ratio | median ratio of call pairs |",
             "|---|---:|---:|---:|---:|"]
    steps = {name: {"plain": make(plain).step, "sharded": make(sharded).step} for name, make in ops.items()}
    for foreach in (True, False):
        steps[f"clip_grad_norm_ (foreach={foreach})"] = {
            k: (lambda ps=ps, foreach=foreach: torch.nn.utils.clip_grad_norm_(ps, 1e9, foreach=foreach))
            for k, ps in (("plain", plain), ("sharded", sharded))}
    for name, fns in steps.items():
        m = block_medians(fns, args.rounds, "cpu")
        paired = paired_ratio(fns["sharded"], fns["plain"], 4 * args.rounds)
        lines.append(f"| {name} | {m['plain'] * 1e3:.2f} | {m['sharded'] * 1e3:.2f} | "
                     f"{m['sharded'] / m['plain']:.2f}x | {paired:.2f}x |")
    publish(lines, args.out)


if __name__ == "__main__":
    main()
