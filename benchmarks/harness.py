"""Shared benchmark driver: launch each system in its own ``torchrun`` job, interleave rounds, summarise.

Each system runs in fresh processes (so peak RSS is that system's), with the same environment
(``OMP_NUM_THREADS``, ``MALLOC_MMAP_THRESHOLD_``), model, data and seed. Systems are interleaved over
``--rounds`` so machine noise hits all of them alike. ``compare.py`` and ``engine.py`` are presets.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from report import command_line, format_table, plot, publish
from systems import SYSTEMS
from workloads import WORKLOADS

WORKER = Path(__file__).resolve().parent / "worker.py"


def free_port() -> int:
    """A free TCP port on loopback for torchrun's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(system: str, args: argparse.Namespace, env: dict[str, str]) -> list[dict]:
    """Run one system under torchrun (one process for ``single``); return every rank's result."""
    nproc = 1 if system == "single" else args.world_size
    with tempfile.TemporaryDirectory() as out_dir:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", str(WORKER), "--system", system, "--workload", args.model,
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--seq", str(args.seq),
               "--global-batch", str(args.batch * args.world_size), "--out-dir", out_dir]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        results = [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("*.json"))]
    if proc.returncode != 0 or len(results) != nproc:
        raise RuntimeError(f"{system} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}")
    return results


def summarize(runs: dict[str, list[list[dict]]], world_size: int, baseline: str = "fsdp2") -> list[dict]:
    """One row per system: step time over every measured step of every round (slowest rank per step),
    peak RSS per rank, communication per step against the ZeRO-3 bound and the plan, losses, ratios to
    FSDP2 and DDP, and what bmt_wrap's plan kept."""
    rows = []
    reference = runs.get("single")
    for system, rounds in runs.items():
        times = [max(step) for r in rounds for step in zip(*(rank["times"] for rank in r), strict=True)]
        first = rounds[-1][0]
        bound = 3 * first["param_bytes"] * (world_size - 1) / world_size
        comm = first["comm_bytes"]
        row = {"system": system, "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
               "steps": len(times), "peak_rss": max(rank["rss"] for r in rounds for rank in r),
               "loss": first["losses"][-1], "comm_bytes": comm, "zero3_bound": bound,
               "plan_comm_bytes": first["plan_comm_bytes"], "params": first["params"],
               "comm_vs_bound": comm / bound if comm is not None and bound else None,
               "comm_vs_plan": comm / first["plan_comm_bytes"] if comm is not None and first["plan_comm_bytes"] else None,
               "max_loss_diff_vs_single": None, "kept": first.get("kept")}
        if reference:
            ref = reference[-1][0]["losses"]
            row["max_loss_diff_vs_single"] = max(abs(a - b) for a, b in zip(first["losses"], ref, strict=True))
        rows.append(row)
    # Ratios to FSDP2 (the sharded peer) and to DDP (what a budget of DDP's memory must match).
    for name, key in ((baseline, "fsdp2"), ("ddp", "ddp")):
        base = next((r for r in rows if r["system"] == name), None)
        for r in rows:
            r[f"time_vs_{key}"] = r["median_s"] / base["median_s"] if base else None
            r[f"rss_vs_{key}"] = r["peak_rss"] / base["peak_rss"] if base else None
    return rows


def environment(mmap_threshold: str) -> dict[str, str]:
    """The environment every system gets: ours, with one OMP thread unless set, and the mmap threshold."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if mmap_threshold != "glibc-default":  # same allocator behaviour for every system either way
        env["MALLOC_MMAP_THRESHOLD_"] = mmap_threshold
    return env


def parse_args(description: str, default_systems: list[str], argv: list[str] | None) -> argparse.Namespace:
    """The options compare.py and engine.py share."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--model", choices=list(WORKLOADS), default="toy-gpt")
    p.add_argument("--systems", default=",".join(default_systems),
                   help=f"comma-separated, from {', '.join(SYSTEMS)}")
    p.add_argument("--steps", type=int, default=12, help="measured steps per round (after warm-up)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=1, help="sequences per rank")
    p.add_argument("--mmap-threshold", default="glibc-default",
                   help="MALLOC_MMAP_THRESHOLD_ for every system, or glibc-default to leave it unset")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per launch")
    p.add_argument("--json", dest="json_path", help="write the rows (and the set-up) here")
    p.add_argument("--plot", help="draw step time, peak RSS and communication into this PNG")
    p.add_argument("--out", type=Path, help="write the Markdown table here (default: "
                   "benchmarks/results/<script>_<model>.md, which RESULTS.md quotes)")
    args = p.parse_args(argv)
    unknown = [s for s in args.systems.split(",") if s not in SYSTEMS]
    if unknown:
        p.error(f"unknown system(s) {unknown}; choose from {list(SYSTEMS)}")
    return args


def main(description: str, default_systems: list[str], argv: list[str] | None = None) -> list[dict]:
    """Run every selected system, interleaved; print the table; write JSON and the plot if asked."""
    args = parse_args(description, default_systems, argv)
    env = environment(args.mmap_threshold)
    systems = args.systems.split(",")
    if "bmt_explicit" in systems and WORKLOADS[args.model].explicit is None:
        print(f"skipping bmt_explicit: {args.model} has no BMTrain-style version (toy-gpt has)", file=sys.stderr)
        systems.remove("bmt_explicit")
    runs: dict[str, list[list[dict]]] = {s: [] for s in systems}
    for i in range(args.rounds):
        for system in systems:
            print(f"round {i + 1}/{args.rounds}: {system} ...", file=sys.stderr, flush=True)
            runs[system].append(launch(system, args, env))
    rows = summarize(runs, args.world_size)
    setup = {"model": args.model, "describe": WORKLOADS[args.model].describe, "params": rows[0]["params"],
             "world_size": args.world_size, "batch_per_rank": args.batch, "seq": args.seq, "steps": args.steps,
             "warmup": args.warmup, "rounds": args.rounds, "OMP_NUM_THREADS": env["OMP_NUM_THREADS"],
             "MALLOC_MMAP_THRESHOLD_": env.get("MALLOC_MMAP_THRESHOLD_", "unset (glibc default)"),
             "command": command_line(argv)}
    # compare.py and engine.py share this harness: each script's table gets a file of its own.
    out = args.out or Path(__file__).parent / "results" / f"{Path(sys.argv[0]).stem}_{args.model}.md"
    publish(format_table(rows, setup).splitlines(), out, setup["command"])
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"setup": setup, "rows": rows}, indent=1))
    if args.plot:
        plot(rows, setup, args.plot)
    return rows
