"""A plan as text for people: the summary line and tables ``bmt-wrap`` prints, and ``str(plan)``.

Plain string work on the plan's dataclasses, beside them rather than in ``passes/``, so the runtime, which
holds plans, can show one without loading ``torch.fx``.
"""

from __future__ import annotations

from collections.abc import Callable

from .plan import FX_FAILED_NOTE, SCHEDULE_NOTE, MemoryEstimate, WrapPlan

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def fmt_bytes(n: int | None) -> str:
    """Human-readable bytes (binary units)."""
    if n is None:
        return "n/a"
    value, unit = float(n), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{int(value)} B" if unit == 0 else f"{value:.2f} {_UNITS[unit]}"


def summary_line(plan: WrapPlan) -> str:
    """One line: capture method, blocks, calls, prefetch depth, checkpointed blocks."""
    blocks = plan.blocks()
    ckpt = sum(g.checkpoint for g in blocks)
    return (f"capture: {plan.capture} | blocks: {len(blocks)} | calls: {len(plan.order)} | "
            f"prefetch depth: {plan.prefetch_depth} | checkpointed: {ckpt}/{len(blocks)}")


def shown_notes(plan: WrapPlan, verbose: bool = False) -> list[str]:
    """The notes worth a reader's attention; ``verbose`` adds the expected fallbacks."""
    # fx fails on every transformers model and torch.export then captures it: nothing to act on.
    expected = SCHEDULE_NOTE + FX_FAILED_NOTE
    return [n for n in plan.notes if verbose or plan.capture != "export" or not n.startswith(expected)]


def render_groups(plan: WrapPlan) -> str:
    """Table of shard groups: parameters, bytes, checkpointing, ZeRO level."""
    rows = [("group", "params", "bytes", "buffers", "checkpoint", "zero")]
    for g in plan.groups:
        rows.append((g.name, f"{g.param_numel():,}", fmt_bytes(g.param_bytes()),
                     ",".join(f"{b.dtype}{'' if b.gather_dtype == b.dtype else '->' + b.gather_dtype}"
                              f"{'' if b.requires_grad else '(frozen)'}" for b in g.buffers) or "-",
                     "-" if g.is_root else str(g.checkpoint).lower(), "-" if g.is_root else str(g.zero_level)))
    return _table(rows)


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                                      enumerate(zip(r, widths, strict=True))).rstrip() for r in rows)


_ESTIMATE_ROWS: list[tuple[str, Callable[[MemoryEstimate], int | None]]] = [
    ("parameters (shard)", lambda e: e.params),
    ("gradients (shard)", lambda e: e.grads),
    ("optimizer state (shard)", lambda e: e.optimizer),
    ("= model states", lambda e: e.params + e.grads + e.optimizer),
    ("gathered parameters", lambda e: e.gathered),
    ("gradients in flight", lambda e: e.grads_in_flight),
    ("activations", lambda e: e.activations),
    ("= total per rank", lambda e: e.total),
    ("all-gather / step", lambda e: e.comm_all_gather),
    ("reduce-scatter / step", lambda e: e.comm_reduce_scatter),
    ("= communicated / step", lambda e: e.comm_total),
    ("ZeRO-3 bound 3Ψ(N-1)/N", lambda e: e.zero3_bound),
]


def render_estimates(plans: list[WrapPlan]) -> str:
    """Per-rank estimates table, one column per plan (each plan holds one world size's estimate)."""
    estimates = [est for p in plans for est in p.estimates.values()]
    # Activations need an input shape; a total without them must not pass for the whole footprint.
    partial = " without activations" if any(e.activations is None for e in estimates) else ""
    rows = [("per rank", *(f"N={e.world_size}" for e in estimates))]
    rows += [(label + (partial if label == "= total per rank" else ""), *(fmt_bytes(get(e)) for e in estimates))
             for label, get in _ESTIMATE_ROWS]
    return _table(rows)


def heading(plan: WrapPlan, verbose: bool = False) -> list[str]:
    """The summary line, then the notes worth showing."""
    return [summary_line(plan), *(f"  note: {n}" for n in shown_notes(plan, verbose))]


def tables(plan: WrapPlan) -> list[str]:
    """The groups table, then the per-rank estimates if the plan has them."""
    lines = ["groups:", render_groups(plan)]
    if plan.estimates:
        lines += ["estimates:", render_estimates([plan])]
    return lines


def plan_text(plan: WrapPlan) -> str:
    """What ``str(plan)`` shows: summary, notes, groups and per-rank estimates."""
    return "\n".join([*heading(plan), *tables(plan)])
