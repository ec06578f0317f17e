"""Expert parallelism in the one-liner: ep4 and ep2 x dp2 against ZeRO-3 without EP on a MoE GPT.

    python benchmarks/moe.py [--world-size 4] [--model moe-gpt] [--batch 4] [--seq 32] [--steps 4] [--rounds 1]

Systems: ``bmt_wrapper`` (ZeRO-3 over every rank: every step gathers every expert, twice),
``bmt_wrapper_ep2`` (``ep_size=2``: pairs of ranks split each layer's experts, each half ZeRO-3 sharded over
the two ranks owning it) and ``bmt_wrapper_ep4`` (each rank owns a quarter of the experts), on the same
global batch (``--batch`` x world size sequences, every rank its own slice). The table gives per system the
median step time (slowest rank per step), the bytes each rank sends per step (collectives' algorithmic
bytes, all-to-all counted as what a rank sends to the others; the largest over ranks) and the peak RSS per
rank (the largest), each beside ZeRO-3's. The goal of issue 51: ep4 sends at most 0.25x ZeRO-3's bytes.
Written to ``--out`` (default ``benchmarks/results/moe_<model>.md``), which RESULTS.md quotes.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from harness import environment, launch, parse_args
from report import command_line, publish
from workloads import WORKLOADS

CONFIGS = ["bmt_wrapper", "bmt_wrapper_ep2", "bmt_wrapper_ep4"]
LABELS = {"bmt_wrapper": "ZeRO-3 (dp4, no EP)", "bmt_wrapper_ep2": "ep2 x dp2", "bmt_wrapper_ep4": "ep4"}
DEFAULTS = {"--world-size": "4", "--model": "moe-gpt", "--batch": "4", "--steps": "4", "--warmup": "1",
            "--rounds": "1"}


def _expert_share(model: str, seq: int) -> float:
    """The fraction of the model's parameters its experts hold (the pass's own count)."""
    from bmt_wrap.passes import plan_experts

    built = WORKLOADS[model].build(seq)
    total = sum(p.numel() * p.element_size() for p in built.parameters())
    return plan_experts(built).expert_bytes() / total


def main(argv: list[str]) -> None:
    """Run the three systems, print and write the table."""
    for flag, value in DEFAULTS.items():
        if flag not in argv:
            argv += [flag, value]
    args = parse_args(__doc__, CONFIGS, argv)
    env = environment(args.mmap_threshold)
    runs: dict[str, list[list[dict]]] = {c: [] for c in CONFIGS}
    for i in range(args.rounds):
        for system in CONFIGS:
            print(f"round {i + 1}/{args.rounds}: {LABELS[system]} ...", file=sys.stderr, flush=True)
            runs[system].append(launch(system, args, env))
    rows = []
    for system, rounds in runs.items():
        times = [max(step) for r in rounds for step in zip(*(rank["times"] for rank in r), strict=True)]
        rows.append({"label": LABELS[system], "median_s": statistics.median(times),
                     "sent": max(rank["comm_bytes"] for r in rounds for rank in r),
                     "rss": max(rank["rss"] for r in rounds for rank in r), "loss": rounds[-1][0]["losses"][-1]})
    base = rows[0]
    first = runs[CONFIGS[0]][-1][0]
    lines = [f"{first['params']:,} parameters ({args.model}: {WORKLOADS[args.model].describe}; experts hold "
             f"{_expert_share(args.model, args.seq):.0%}), {args.world_size} ranks, batch {args.batch}/rank x seq "
             f"{args.seq} (the same global batch for every system), {args.steps} steps x {args.rounds} round(s) "
             f"after {args.warmup} warm-up, OMP_NUM_THREADS={env['OMP_NUM_THREADS']}", "",
             "| system | step s (median) | time vs ZeRO-3 | bytes sent/rank/step | bytes vs ZeRO-3 | peak RSS/rank | "
             "RSS vs ZeRO-3 | final loss |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['label']} | {row['median_s']:.3f} | {row['median_s'] / base['median_s']:.2f}x | "
                     f"{row['sent'] / 1e6:.1f} MB | {row['sent'] / base['sent']:.2f}x | {row['rss'] / 2**30:.2f} GiB | "
                     f"{row['rss'] / base['rss']:.2f}x | {row['loss']:.4f} |")
    out = args.out or Path(__file__).parent / "results" / f"moe_{args.model}.md"
    publish(lines, out, command_line(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
