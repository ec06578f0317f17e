"""The benchmark table (text, the README's format) and its plot."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any

MB = 1e6
GIB = 2**30


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / MB:.1f} MB"


def format_table(rows: list[dict], setup: dict[str, Any]) -> str:
    """A Markdown table: one line per system, ratios to FSDP2, communication beside its bounds."""
    head = (f"{setup['describe']}, {setup['params'] / 1e6:.1f}M params, {setup['world_size']} ranks, "
            f"batch {setup['batch_per_rank']}/rank x seq {setup['seq']}, {setup['steps']} steps x "
            f"{setup['rounds']} rounds after {setup['warmup']} warm-up, OMP_NUM_THREADS={setup['OMP_NUM_THREADS']}, "
            f"MALLOC_MMAP_THRESHOLD_={setup['MALLOC_MMAP_THRESHOLD_']}")
    cols = ["system", "step s: median (min-max)", "time vs FSDP2", "time vs DDP", "peak RSS/rank", "RSS vs FSDP2",
            "RSS vs DDP", "comm/step", "ZeRO-3 bound", "comm vs bound", "plan predicts", "comm vs plan",
            "kept: activations / params", "final loss", "max Δloss vs single"]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        diff = r["max_loss_diff_vs_single"]
        ours = r["comm_bytes"] is not None
        cells = [r["system"], f"{r['median_s']:.3f} ({r['min_s']:.3f}-{r['max_s']:.3f})", _ratio(r["time_vs_fsdp2"]),
                 _ratio(r.get("time_vs_ddp")), f"{r['peak_rss'] / GIB:.2f} GiB", _ratio(r["rss_vs_fsdp2"]),
                 _ratio(r.get("rss_vs_ddp")), _mb(r["comm_bytes"]), _mb(r["zero3_bound"]) if ours else "-",
                 _ratio(r["comm_vs_bound"]), _mb(r["plan_comm_bytes"]), _ratio(r["comm_vs_plan"]),
                 _kept(r.get("kept")), f"{r['loss']:.4f}", "-" if diff is None else f"{diff:.1e}"]
        lines.append("| " + " | ".join(cells) + " |")
    budgets = [r for r in rows if (r.get("kept") or {}).get("memory_budget") is not None]
    lines += [""] * bool(budgets) + [
        f"{r['system']}: memory_budget {r['kept']['memory_budget'] / MB:.1f} MB (DDP's parameters, gradients, AdamW "
        f"state and activations by the plan's estimate); prefetch depth {r['kept']['prefetch_depth']}; "
        f"activations kept: {_names(r['kept']['activations'])}; parameters kept gathered: "
        f"{_names(r['kept']['parameters'])}" for r in budgets]
    return "\n".join(lines)


def _kept(kept: dict | None) -> str:
    """How many blocks kept activations (no recompute) and parameters gathered (no second all-gather)."""
    if kept is None:
        return "-"
    return f"{len(kept['activations'])}/{kept['blocks']} / {len(kept['parameters'])}/{kept['blocks']}"


def _names(blocks: list[str]) -> str:
    return ", ".join(blocks) if blocks else "none"


def plot(rows: list[dict], setup: dict[str, Any], path: str) -> None:
    """Step time (median, min-max whiskers), peak RSS per rank, and communication against the bounds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["system"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    med = [r["median_s"] for r in rows]
    err = [[m - r["min_s"] for m, r in zip(med, rows, strict=True)], [r["max_s"] - m for m, r in zip(med, rows, strict=True)]]
    axes[0].bar(names, med, yerr=err, capsize=4, color="tab:blue")
    axes[0].set_ylabel("step time, s (median, min-max)")
    axes[1].bar(names, [r["peak_rss"] / GIB for r in rows], color="tab:orange")
    axes[1].set_ylabel("peak RSS per rank, GiB")
    ours = [r for r in rows if r["comm_bytes"] is not None]
    if ours:
        x = range(len(ours))
        axes[2].bar([i - 0.27 for i in x], [r["comm_bytes"] / MB for r in ours], 0.27, label="measured")
        axes[2].bar(list(x), [(r["plan_comm_bytes"] or 0) / MB for r in ours], 0.27, label="plan predicts")
        axes[2].bar([i + 0.27 for i in x], [r["zero3_bound"] / MB for r in ours], 0.27, label="ZeRO-3 bound")
        axes[2].set_xticks(list(x), [r["system"] for r in ours])
        axes[2].legend(loc="lower center", fontsize=8)
    axes[2].set_ylabel("communicated MB per step")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(f"{setup['describe']}, {setup['world_size']} ranks", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def command_line(argv: list[str] | None = None) -> str:
    """The command that reproduces this run from the repository root: the script's real arguments, under
    ``torchrun`` when it runs in a torchrun job."""
    script = Path(sys.argv[0]).resolve()
    try:
        shown = script.relative_to(Path(__file__).resolve().parent.parent).as_posix()
    except ValueError:
        shown = script.as_posix()
    ranks = os.environ.get("LOCAL_WORLD_SIZE")
    launcher = f"torchrun --nproc_per_node={ranks}" if ranks else "python"
    return " ".join([launcher, shown, *map(shlex.quote, sys.argv[1:] if argv is None else argv)])


def publish(lines: list[str], out: Path, command: str | None = None) -> None:
    """Print a benchmark's Markdown table followed by the command that made it (default: this process's,
    ``command_line()``), and write both to ``out`` (RESULTS.md quotes these files)."""
    text = "\n".join([*lines, "", f"command: {command or command_line()}"])
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
