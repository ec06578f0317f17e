"""What the collective order check costs: training steps with it on and off, interleaved, in one run.

    torchrun --nproc_per_node=2 benchmarks/order_check.py [--steps 8] [--d-model 1024] [--layers 8]

Every gloo collective first exchanges a 128-byte description with each peer (runtime/comm/gloo.py), so a
block skipped on one rank is named at once instead of hanging. This trains the benchmarks' toy GPT
wrapped with ``BMTrainModelWrapper`` and alternates the check per step (both ranks switch together),
so machine noise hits both alike; it prints and writes (``--out``) a Markdown table of median step times
and their ratio. Target: the check costs at most 1% of step time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from report import publish
from toy_gpt import ToyGPT, ToyGPTConfig

import bmt_wrap as bmt
from bmt_wrap.runtime.comm import GlooCommunicator


def _gloo(comm: object) -> GlooCommunicator:
    while not isinstance(comm, GlooCommunicator):
        comm = getattr(comm, "inner", None)
        if comm is None:
            raise SystemExit("order_check.py measures the gloo backend: run it on CPU with 2+ ranks")
    return comm


def main() -> None:
    """Time steps with the order check on and off, alternating, and report medians on rank 0."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=24, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "order_check.md")
    args = parser.parse_args()
    state = bmt.init_distributed(seed=0)
    gloo = _gloo(state.comm)
    cfg = ToyGPTConfig(d_model=args.d_model, n_layers=args.layers)
    model = bmt.BMTrainModelWrapper(ToyGPT(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(state.rank)

    def step() -> float:
        idx = torch.randint(0, cfg.vocab, (args.batch, cfg.seq + 1), generator=gen)
        bmt.synchronize()
        start = time.perf_counter()
        model(idx[:, :-1], idx[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - start

    for _ in range(args.warmup):
        step()
    times: dict[bool, list[float]] = {True: [], False: []}
    collectives = 0
    for i in range(2 * args.steps):
        check = i % 2 == 0
        bmt.synchronize()  # both ranks switch between steps, never inside one
        gloo.check_order = check
        before = gloo._sequence
        times[check].append(step())
        collectives = gloo._sequence - before
    gloo.check_order = True
    if state.rank != 0:
        return
    on, off = statistics.median(times[True]), statistics.median(times[False])
    # Neighbouring steps share the machine's mood: the median of their ratios is the steadier number.
    paired = statistics.median(a / b for a, b in zip(times[True], times[False], strict=True))
    lines = [
        f"toy GPT d_model {cfg.d_model} x {cfg.n_layers} layers, {state.world_size} ranks (gloo), batch "
        f"{args.batch}/rank x seq {cfg.seq}, {args.steps} steps per mode after {args.warmup} warm-up, "
        f"alternating; {collectives} collectives per step; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}",
        "",
        "| order check | step s: median (min-max) | median vs off | median of step-pair ratios |",
        "|---|---|---|---|",
        f"| on (default) | {on:.3f} ({min(times[True]):.3f}-{max(times[True]):.3f}) | {on / off:.3f}x | {paired:.3f}x |",
        f"| off (BMT_WRAP_CHECK_COLLECTIVES=0) | {off:.3f} ({min(times[False]):.3f}-{max(times[False]):.3f}) | 1.000x | 1.000x |",
    ]
    publish(lines, args.out)


if __name__ == "__main__":
    main()
