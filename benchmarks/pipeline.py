"""Pipeline stages in the one-liner: pp2 x dp2 against dp4 (ZeRO-3 over 4 ranks), and each schedule's idle time.

    python benchmarks/pipeline.py [--world-size 4] [--model toy-gpt-24] [--batch 4] [--steps 4] [--rounds 1]

Systems: ``bmt_wrapper`` (ZeRO-3 over every rank) and ``bmt_wrapper_pp2`` (``BMTrainModelWrapper(model,
pp_size=2, pp_microbatches=M, example_inputs=batch)``: two stages of consecutive ranks balanced by the blocks'
and the head's forward FLOPs, ZeRO-3 over each stage's two data-parallel ranks) at M = 4 and 8, trained by the
GPipe loop (``loss.backward()``), by ``model.pipeline_step(..., schedule="1F1B")`` (torch's Schedule1F1B), and
with two stages per rank (``pp_virtual_stages=2``: four stages, rank r running stages r and r + 2) by
``schedule="Interleaved1F1B"``, ``"LoopedBFS"`` and ``"InterleavedZeroBubble"``, on the same global batch
(``--batch`` x world size sequences). The first table gives per system the median step time (slowest rank
per step), the bytes each rank sends per step (collectives' algorithmic bytes plus the activations and
gradients it sends to another stage; the largest over ranks) and the peak RSS per rank (the largest); the
second, per schedule and stage, two idle fractions beside the schedule's bubble, (P-1)/(M+P-1) for GPipe and
1F1B, (P-1)/(V x M+P-1) for V stages per rank (each of the P-1 warm-up and cool-down slots costs 1/V of a
stage's micro-batch). Wall idle: the step's wall-clock time outside the stage's own forwards and backwards
(the GPipe loop: in transfers between stages, ``runtime/pipeline.py``'s ``transfer_time``), which on
oversubscribed cores is mostly the machine's load. Replayed idle (torch's schedules): the step's actions in the order torch's
schedule ran them, replayed with each action's thread CPU seconds (``pipeline_replay.py``),
the idle the schedule leaves on dedicated cores. The bytes of a torch schedule's point-to-point transfers
(its own process group's) are not counted. Written to ``--out`` (default
``benchmarks/results/pipeline_<model>.md``), which RESULTS.md quotes (``assemble_results.py``).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from harness import environment, launch, parse_args
from pipeline_replay import replay
from report import command_line, publish

# (system, micro-batches, schedule, stages per rank): schedule None runs the GPipe loop (loss.backward()), a
# name model.pipeline_step
CONFIGS = [("bmt_wrapper", None, None, 1), ("bmt_wrapper_pp2", 4, None, 1), ("bmt_wrapper_pp2", 8, None, 1),
           ("bmt_wrapper_pp2", 4, "1F1B", 1), ("bmt_wrapper_pp2", 8, "1F1B", 1),
           ("bmt_wrapper_pp2", 4, "Interleaved1F1B", 2), ("bmt_wrapper_pp2", 8, "Interleaved1F1B", 2),
           ("bmt_wrapper_pp2", 4, "LoopedBFS", 2), ("bmt_wrapper_pp2", 8, "LoopedBFS", 2),
           ("bmt_wrapper_pp2", 4, "InterleavedZeroBubble", 2), ("bmt_wrapper_pp2", 8, "InterleavedZeroBubble", 2)]
PIPE = 2  # P: pipeline ranks
DEFAULTS = {"--world-size": "4", "--model": "toy-gpt-24", "--batch": "4", "--steps": "4", "--warmup": "1",
            "--rounds": "1"}


def _label(system: str, micro: int | None, schedule: str | None, virtual: int) -> str:
    if micro is None:
        return "dp4 ZeRO-3"
    v = f" V={virtual}" if virtual > 1 else ""
    return f"pp2 x dp2, {schedule} (pipeline_step) M={micro}{v}" if schedule else f"pp2 x dp2, GPipe loop M={micro}"


def bound(micro: int, virtual: int) -> float:
    """The idle fraction of a schedule with no overhead: (P-1)/(V x M+P-1)."""
    return (PIPE - 1) / (virtual * micro + PIPE - 1)


def _replayed(ranks: list[dict]) -> dict[int, list[float]]:
    """Each stage's idle fraction, per step and pipeline, from replaying the actions the pipeline's ranks ran
    under torch's schedule, in their order, with their thread CPU seconds (``pipeline_replay.replay``)."""
    out: dict[int, list[float]] = {}
    for pipe in sorted({rank["pipeline"] for rank in ranks}):
        mine = [rank for rank in ranks if rank["pipeline"] == pipe]
        for step in zip(*(rank["actions"] for rank in mine), strict=True):
            order = {rank["stage"]: [tuple(a[:3]) for a in actions] for rank, actions in zip(mine, step, strict=True)}
            seconds = {tuple(a[:3]): a[3] for actions in step for a in actions}
            for stage, fraction in replay(order, seconds).items():
                out.setdefault(stage, []).append(fraction)
    return out


def main(argv: list[str]) -> None:
    """Run the configurations, print and write the two tables."""
    for flag, value in DEFAULTS.items():
        if flag not in argv:
            argv += [flag, value]
    args = parse_args(__doc__, ["bmt_wrapper", "bmt_wrapper_pp2"], argv)
    env = environment(args.mmap_threshold)
    runs: dict[tuple[str, int | None, str | None, int], list[list[dict]]] = {c: [] for c in CONFIGS}
    for i in range(args.rounds):
        for config in CONFIGS:
            system, micro, schedule, virtual = config
            print(f"round {i + 1}/{args.rounds}: {_label(*config)} ...", file=sys.stderr, flush=True)
            extra = ({"BMT_PP_MICROBATCHES": str(micro)} if micro else {}) | (
                {"BMT_PP_SCHEDULE": schedule} if schedule else {}) | {"BMT_PP_VIRTUAL": str(virtual)}
            runs[config].append(launch(system, args, env | extra))
    rows = []
    for (system, micro, schedule, virtual), rounds in runs.items():
        times = [max(step) for r in rounds for step in zip(*(rank["times"] for rank in r), strict=True)]
        sent = max(rank["comm_bytes"] for r in rounds for rank in r)
        rss = max(rank["rss"] for r in rounds for rank in r)
        idle: dict[int, list[float]] = {}
        replayed: dict[int, list[float]] = {}
        for r in rounds:
            for rank in r:
                fractions = [w / t for w, t in zip(rank["idle"], rank["times"], strict=True)]
                idle.setdefault(rank["stage"], []).extend(fractions)
            for stage, fractions in (_replayed(r) if schedule else {}).items():
                replayed.setdefault(stage, []).extend(fractions)
        rows.append({"label": _label(system, micro, schedule, virtual), "micro": micro, "virtual": virtual,
                     "schedule": (schedule or "GPipe loop") + (f" V={virtual}" if virtual > 1 else ""),
                     "median_s": statistics.median(times),
                     "sent": sent, "rss": rss, "loss": rounds[-1][0]["losses"][-1],
                     "idle": {s: statistics.median(v) for s, v in sorted(idle.items())},
                     "replayed": {s: statistics.median(v) for s, v in replayed.items()},
                     "split": rounds[-1][0].get("split")})
    base = rows[0]
    first = runs[CONFIGS[0]][-1][0]
    lines = [f"{first['params']:,} parameters ({args.model}), {args.world_size} ranks, batch {args.batch}/rank x seq "
             f"{args.seq} (the same global batch for every system), {args.steps} steps x {args.rounds} round(s) "
             f"after {args.warmup} warm-up, OMP_NUM_THREADS={env['OMP_NUM_THREADS']}", "",
             "| system | step s (median) | time vs dp4 | bytes sent/rank/step | bytes vs dp4 | peak RSS/rank | "
             "RSS vs dp4 | final loss |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['label']} | {row['median_s']:.3f} | {row['median_s'] / base['median_s']:.2f}x | "
                     f"{row['sent'] / 1e6:.1f} MB | {row['sent'] / base['sent']:.2f}x | {row['rss'] / 2**30:.2f} GiB | "
                     f"{row['rss'] / base['rss']:.2f}x | {row['loss']:.4f} |")
    splits = {row["virtual"]: " + ".join(map(str, row["split"])) for row in rows[1:]}
    lines += ["", "Stage split (blocks per stage, planned from the example batch: the blocks' forward FLOPs, the head's "
              "on the last stage): " + "; ".join(f"V={v}: {split}" for v, split in sorted(splits.items())) + ". "
              "Wall idle: the fraction of the step's wall-clock time the rank spent outside its own forwards and "
              "backwards (the GPipe loop: in transfers between stages), on these shared cores, load included. "
              "Replayed idle: each rank's actions in the order torch's schedule ran them, replayed with each "
              "action's thread CPU seconds from the same step, transfers free: the idle the schedule and the "
              "stages' measured costs leave on dedicated cores (the GPipe loop is not replayed: -).", "",
              "| schedule | stage (rank) | wall idle | replayed idle (CPU time) | bound (P-1)/(V x M+P-1) | "
              "wall vs bound | replayed vs bound |", "|---|---|---|---|---|---|---|"]
    for row in rows[1:]:
        b = bound(row["micro"], row["virtual"])
        for stage, frac in row["idle"].items():
            cpu = row["replayed"].get(stage)
            cells = ("-", "-") if cpu is None else (f"{cpu:.3f}", f"{cpu / b:.2f}x")
            lines.append(f"| {row['schedule']} M={row['micro']} | {stage} | {frac:.3f} | {cells[0]} | {b:.3f} | "
                         f"{frac / b:.2f}x | {cells[1]} |")
    out = args.out or Path(__file__).parent / "results" / f"pipeline_{args.model}.md"
    publish(lines, out, command_line(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
