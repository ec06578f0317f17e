"""Inspection tools (BMTrain's ``bmt.inspect``): per-parameter statistics of a sharded model, and memory per rank.

``inspect_model`` is a collective: every rank must call it with the same ``pattern``. Statistics of a
sharded parameter are reduced from each rank's slice (count, sum, min, max, then the squared deviations
from the global mean) instead of gathering the full tensor, so they cost a few small all-reduces for the
whole model and no parameter-sized memory; they equal those of the unsharded tensor.
"""

from __future__ import annotations

import fnmatch
import os
import resource
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..base.log import get_logger
from ..errors import BMTError
from ..job import distributed
from ..optim.sharding import is_sharded
from ..runtime.active_engine import get_engine
from ..runtime.sharded_tensor import local_view

STAT_KEYS = ("mean", "std", "min", "max")


def _local_slices(p: torch.Tensor, mine: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's contribution (values, gradient) to ``p``'s statistics, flattened, fp32 or wider."""
    values = local_view(p).detach().reshape(-1)
    empty = values.new_empty(0, dtype=torch.float32)
    if not mine:  # a replicated parameter counts once: rank 0 contributes it
        return empty, None if p.grad is None else empty
    grad = None if p.grad is None else local_view(p.grad).detach().reshape(-1)
    return values, grad


def _partials(x: torch.Tensor | None) -> list[float]:
    """[has, count, sum, max, -min] of one local slice (neutral elements when empty or absent)."""
    if x is None:
        return [0.0, 0.0, 0.0, float("-inf"), float("-inf")]
    if x.numel() == 0:
        return [1.0, 0.0, 0.0, float("-inf"), float("-inf")]
    return [1.0, float(x.numel()), float(torch.sum(x, dtype=torch.float64)),
            float(x.max()), float(-x.min())]


def _device() -> torch.device:
    state = distributed.current_state()
    return state.device if state is not None else torch.device("cpu")


def _reduce(values: list[list[float]], width: int, op: str) -> torch.Tensor:
    """One all-reduce of a [rows x width] table across ranks (no communication in a single process)."""
    t = torch.tensor(values, dtype=torch.float64, device=_device()).reshape(len(values), width)
    if distributed.is_initialized() and distributed.world_size() > 1 and t.numel():
        flat = t.reshape(-1).contiguous()
        distributed.comm().all_reduce(flat, op, label="inspect_model")
        t = flat.reshape(t.shape)
    return t.cpu()


def _stats(sums: torch.Tensor, extremes: torch.Tensor, sq: torch.Tensor, i: int) -> dict[str, float] | None:
    has, count, total = sums[i].tolist()
    if has == 0:
        return None
    if count == 0:
        return {k: float("nan") for k in STAT_KEYS}
    mean = total / count
    # torch.std's default (Bessel-corrected) so numbers match ``p.std()`` on the unsharded tensor.
    std = (float(sq[i]) / (count - 1)) ** 0.5 if count > 1 else float("nan")
    return {"mean": mean, "std": std, "min": -float(extremes[i, 1]), "max": float(extremes[i, 0])}


def inspect_model(model: nn.Module, pattern: str = "*") -> list[dict[str, Any]]:
    """Mean/std/min/max of every parameter (and its gradient) whose name matches ``pattern`` (fnmatch).

    Returns one dict per parameter: ``name``, ``shape`` (the full shape), ``mean``, ``std``, ``min``,
    ``max`` and ``grad_mean``, ``grad_std``, ``grad_min``, ``grad_max`` (None without a gradient).
    A collective: call it on every rank. Print it with ``format_summary``.
    """
    rank0 = not distributed.is_initialized() or distributed.rank() == 0
    names, shapes, slices = [], [], []
    for name, p in model.named_parameters():
        if not fnmatch.fnmatchcase(name, pattern):
            continue
        sharded = is_sharded(p)
        names.append(name)
        shapes.append(tuple(p.shape))
        slices.extend(_local_slices(p, sharded or rank0))
    return [{"name": name, "shape": shape, **stats} for name, shape, stats in zip(names, shapes, _rows(slices), strict=True)]


def _rows(slices: list[torch.Tensor | None]) -> list[dict[str, Any]]:
    """Statistics over every rank of (values, gradient) slice pairs: one row of value and grad_ keys each."""
    parts = [_partials(x) for x in slices]
    sums = _reduce([q[:3] for q in parts], 3, "sum")
    extremes = _reduce([q[3:] for q in parts], 2, "max")
    # Second pass: squared deviations from the global mean (exact, unlike sum-of-squares minus mean²).
    sq_local = []
    for i, x in enumerate(slices):
        has, count, total = sums[i].tolist()
        mean = total / count if count else 0.0
        sq_local.append([0.0 if x is None or x.numel() == 0 else
                         float(torch.sum((x.float() - mean).square(), dtype=torch.float64))])
    sq = _reduce(sq_local, 1, "sum").reshape(-1)
    rows = []
    for j in range(len(slices) // 2):
        values, grads = _stats(sums, extremes, sq, 2 * j), _stats(sums, extremes, sq, 2 * j + 1)
        row: dict[str, Any] = dict(values or {k: float("nan") for k in STAT_KEYS})
        row.update({f"grad_{k}": None if grads is None else grads[k] for k in STAT_KEYS})
        rows.append(row)
    return rows


# ---- tensors recorded during forward (BMTrain's inspect_tensor / record_tensor) ---------------------------------
class _Record:
    """One ``record_tensor`` call: the value, and the gradient once backward reached it."""

    def __init__(self, name: str, value: torch.Tensor) -> None:
        self.name = name
        self.value = value.detach()
        self.grad: torch.Tensor | None = None

    def hook(self, x: torch.Tensor) -> None:
        """Keep the gradient that reaches ``x`` (summed, if it arrives more than once)."""
        def keep(grad: torch.Tensor) -> None:
            self.grad = grad.detach().clone() if self.grad is None else self.grad + grad.detach()
        x.register_hook(keep)


class InspectTensor:
    """What ``inspect_tensor()`` yields: the tensors ``record_tensor`` saw inside its ``with`` block."""

    def __init__(self) -> None:
        self.records: list[_Record] = []

    def _names(self) -> list[str]:
        # A name recorded more than once (once per layer) is numbered by order, as BMTrain does.
        total = {r.name: sum(q.name == r.name for q in self.records) for r in self.records}
        seen: dict[str, int] = {}
        names = []
        for r in self.records:
            i = seen[r.name] = seen.get(r.name, -1) + 1
            names.append(r.name if total[r.name] == 1 else f"{i}.{r.name}" if "." not in r.name
                         else r.name.replace(".", f".{i}.", 1))
        return names

    def get_summary(self) -> list[dict[str, Any]]:
        """Statistics of every recorded tensor and its gradient over every rank; a collective.

        Rows as ``inspect_model``'s (``grad_*`` None where no gradient arrived); ``shape`` is one rank's.
        """
        slices = [t.reshape(-1) if t is not None else None for r in self.records for t in (r.value, r.grad)]
        return [{"name": n, "shape": tuple(r.value.shape), **row}
                for n, r, row in zip(self._names(), self.records, _rows(slices), strict=True)]

    def get_tensor(self, name: str, group: str | None = None, index: int | None = None) -> torch.Tensor | None:
        """The recorded value named ``name`` (``group.name``; the ``index``-th when recorded repeatedly)."""
        full = f"{group}.{name}" if group is not None else name
        matches = [r.value for r in self.records if r.name == full]
        i = index or 0
        return matches[i] if i < len(matches) else None


_ACTIVE: list[InspectTensor] = []


@contextmanager
def inspect_tensor() -> Iterator[InspectTensor]:
    """Record the tensors passed to ``record_tensor`` (and their gradients) while the block runs.

    Run forward and backward inside it, then call ``get_summary()`` (a collective) and print it with
    ``format_summary``. Tensors recorded inside a checkpointed block are recorded once, by its forward
    (which runs in the model's graph, so the gradient reaches the recorded tensor); its recompute in
    backward records nothing.
    """
    if _ACTIVE:
        raise BMTError("inspect_tensor() is already active; nest no second one")
    inspector = InspectTensor()
    _ACTIVE.append(inspector)
    try:
        yield inspector
    finally:
        _ACTIVE.clear()


def record_tensor(x: torch.Tensor, name: str, group: str | None = None) -> None:
    """Record ``x`` under ``name`` for the active ``inspect_tensor()``; does nothing outside one."""
    if not _ACTIVE:
        return
    if isinstance(x, nn.Parameter):
        raise BMTError(f"record_tensor({name!r}) got a parameter; inspect parameters with inspect_model")
    inspector = _ACTIVE[0]
    full = f"{group}.{name}" if group is not None else name
    if distributed.is_initialized() and get_engine().recomputing:
        return  # a checkpointed block runs again in backward: its forward recorded the value and the gradient
    record = _Record(full, x)
    if x.requires_grad and torch.is_grad_enabled():
        record.hook(x)
    inspector.records.append(record)


#: BMTrain's table: its columns, in its order, and their widths (the name column fits the longest name).
SUMMARY_COLUMNS = ("name", "shape", "max", "min", "std", "mean", "grad_std", "grad_mean")
SUMMARY_WIDTHS = (0, 20, 10, 10, 10, 10, 10, 10)


def format_summary(summary: list[dict[str, Any]]) -> str:
    """``inspect_model``'s result as BMTrain prints it: a header line, then one line per parameter.

    Columns are BMTrain's (name, shape, max, min, std, mean, grad_std, grad_mean), floats with four
    decimals, each cell left-aligned in a fixed width and cut to fit, so scripts that parse BMTrain's
    table parse this one. A parameter without a gradient shows 0.0000 in the grad columns, as in
    BMTrain (its row keeps None).
    """
    widths = list(SUMMARY_WIDTHS)
    widths[0] = max([len("name")] + [len(r["name"]) for r in summary]) + 4

    def cell(row: dict[str, Any], col: str) -> str:
        v = row.get(col)
        if v is None and col.startswith("grad_"):
            v = 0.0
        return f"{v:.4f}" if isinstance(v, float) else str(v)

    def line(values: list[str]) -> str:
        out = ""
        for v, w in zip(values, widths, strict=True):
            v = " " + (v[:w - 1] if len(v) + 1 > w else v)
            out += v.ljust(w)
        return out

    return "\n".join([line(list(SUMMARY_COLUMNS))] + [line([cell(r, c) for c in SUMMARY_COLUMNS]) for r in summary])


def memory_stats() -> dict[str, Any]:
    """This rank's memory, no communication: CUDA allocated/peak bytes on GPU, else resident set size."""
    state = distributed.current_state()
    if state is not None and state.device.type == "cuda":
        return {"kind": "cuda", "current": torch.cuda.memory_allocated(state.device),
                "peak": torch.cuda.max_memory_allocated(state.device),
                "reserved": torch.cuda.memory_reserved(state.device)}
    with open("/proc/self/statm") as f:
        current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    # ru_maxrss is in KiB on Linux, and the kernel updates its high-water mark lazily: it can trail statm.
    peak = max(current, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"kind": "rss", "current": current, "peak": peak, "reserved": None}


def see_memory(message: str = "") -> list[dict[str, Any]]:
    """Print every rank's memory (CUDA or RSS) from rank 0 and return it; a collective when distributed."""
    mine = memory_stats()
    ranks, me = (distributed.world_size(), distributed.rank()) if distributed.is_initialized() else (1, 0)
    table = [[0.0, 0.0, 0.0] for _ in range(ranks)]
    table[me] = [float(mine["current"]), float(mine["peak"]), float(mine["reserved"] or 0)]
    rows = _reduce(table, 3, "sum").tolist()
    per_rank = [{"rank": r, "kind": mine["kind"], "current": int(c), "peak": int(p),
                 "reserved": int(v) if mine["kind"] == "cuda" else None} for r, (c, p, v) in enumerate(rows)]
    if me == 0:
        head = f"memory{f' ({message})' if message else ''}, {mine['kind']}:"
        lines = [head] + [f"  rank {m['rank']}: {m['current'] / 2**30:.2f} GiB now, {m['peak'] / 2**30:.2f} GiB peak"
                          + (f", {m['reserved'] / 2**30:.2f} GiB reserved" if m["reserved"] is not None else "")
                          for m in per_rank]
        get_logger().info("\n".join(lines))
    return per_rank
