"""What the host allocator's settings cost and save on a CPU job: glibc's default against its mmap threshold
fixed (``MALLOC_MMAP_THRESHOLD_``: a freed tensor leaves the process, so the peak is what the plan counts)
and fixed with torch's transparent huge pages (``THP_MEM_ALLOC_ENABLE=1``: fewer page faults per mapping).

    nice python benchmarks/host_allocator.py [--model toy-gpt] [--seq 128] [--steps 6] [--rounds 3]
        [--systems bmt_wrapper,ddp] [--thresholds 65536,1048576]

Each (system, setting) runs in fresh ``torchrun`` processes (``harness.launch``), interleaved over rounds;
the table gives the median step time (slowest rank per step, every measured step of every round) and the
peak RSS per rank of each setting, and their ratios to glibc's default.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from harness import environment, launch
from report import command_line, publish
from systems import SYSTEMS
from workloads import WORKLOADS

GIB = 2**30


def settings(thresholds: list[int]) -> dict[str, dict[str, str]]:
    """Each setting's environment variables (glibc and torch read them at start-up): the default, each
    threshold, and the first threshold with torch's transparent huge pages."""
    fixed = {t: {"MALLOC_MMAP_THRESHOLD_": str(t)} for t in thresholds}
    return {"glibc default": {}, **{f"threshold {t}": env for t, env in fixed.items()},
            f"threshold {thresholds[0]} + THP": {**fixed[thresholds[0]], "THP_MEM_ALLOC_ENABLE": "1"}}


def main() -> None:
    """Run every (system, setting) interleaved over rounds; print and write the ratio table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=list(WORKLOADS), default="toy-gpt")
    p.add_argument("--systems", default="bmt_wrapper,ddp")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--thresholds", default="65536,1048576",
                   help="MALLOC_MMAP_THRESHOLD_ values in bytes, comma-separated (the first is the plan's)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "host_allocator.md")
    args = p.parse_args()
    systems = args.systems.split(",")
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        p.error(f"unknown system(s) {unknown}; choose from {list(SYSTEMS)}")
    variants = settings([int(t) for t in args.thresholds.split(",")])
    base = environment("glibc-default")
    for var in ("MALLOC_MMAP_THRESHOLD_", "THP_MEM_ALLOC_ENABLE"):
        base.pop(var, None)
    runs: dict[tuple[str, str], list[list[dict]]] = {(s, v): [] for s in systems for v in variants}
    for i in range(args.rounds):
        for system, name in runs:
            print(f"round {i + 1}/{args.rounds}: {system}, {name} ...", file=sys.stderr, flush=True)
            runs[system, name].append(launch(system, args, {**base, **variants[name]}))

    def summary(rounds: list[list[dict]]) -> tuple[float, int, float]:
        times = [max(step) for r in rounds for step in zip(*(rank["times"] for rank in r), strict=True)]
        return statistics.median(times), max(rank["rss"] for r in rounds for rank in r), rounds[-1][0]["losses"][-1]

    first = runs[systems[0], "glibc default"][0][0]
    lines = [f"{WORKLOADS[args.model].describe}, {first['params'] / 1e6:.1f}M params, {args.world_size} ranks, "
             f"batch {args.batch}/rank x seq {args.seq}, {args.steps} steps x {args.rounds} rounds after "
             f"{args.warmup} warm-up, OMP_NUM_THREADS=1", "",
             "| system | host allocator | step s (median) | time vs glibc default | peak RSS/rank | "
             "RSS vs glibc default | final loss as glibc default's |", "|" + "---|" * 7]
    for system in systems:
        t0, m0, l0 = summary(runs[system, "glibc default"])
        for name in variants:
            t, m, loss = summary(runs[system, name])
            same = "yes" if loss == l0 else f"no ({loss:.6f} vs {l0:.6f})"
            lines.append(f"| {system} | {name} | {t:.3f} | {t / t0:.3f}x | {m / GIB:.2f} GiB | {m / m0:.3f}x "
                         f"| {same} |")
    publish(lines, args.out, command_line())


if __name__ == "__main__":
    main()
