"""Optimizer step time: AdamOptimizer vs torch.optim.AdamW (fused=True, foreach=True) on the same tensors.

A 100M-element flat shard in fp32, and in bf16 (AdamOptimizer keeps an fp32 master and fp32 moments;
torch's AdamW keeps bf16 state, so it moves half the bytes). Each as one parameter, and in the
engine's layout: many parameter views of one buffer (gradients likewise), which AdamOptimizer fuses
into one call while torch's fused kernel handles each tensor on its own. Each optimizer runs blocks
of steps, alternating with the others so machine load hits all of them alike; the table shows
medians. With CUDA it repeats the table on the GPU and reports the achieved bandwidth of the bf16
update (the CuPy kernel when CuPy is installed) against a device copy. On the CPU it also times
``AdamDiskOptimizer`` (state in a file under ``--disk-dir``, streamed through its 32 MiB buffer): with the
file in the page cache this is the cost of the extra copies and system calls, not of the disk itself.

    python benchmarks/optim.py [--numel 100000000] [--steps 7] [--views 100] [--disk-dir /tmp] [--out table.md]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bmt_wrap.kernels import cupy_usable
from bmt_wrap.optim import AdamDiskOptimizer, AdamOptimizer

#: Bytes one bf16 element moves per fused step: grad 2, master 4+4, moments 2×(4+4), param 2.
BF16_STEP_BYTES = 28


def flat_shard(numel: int, views: int, dtype: torch.dtype, device: str) -> list[torch.nn.Parameter]:
    """Parameters viewing one flat buffer, with gradients viewing another at the same offsets."""
    flat = torch.randn(numel, device=device).to(dtype)
    grad = (torch.randn(numel, device=device) * 1e-2).to(dtype)
    bounds = [numel * i // views for i in range(views + 1)]
    params = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        p = torch.nn.Parameter(flat[a:b])
        p.grad = grad[a:b]
        params.append(p)
    return params


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def block_medians(steps: dict[str, Callable[[], object]], rounds: int, device: str, repeats: int = 2
                  ) -> dict[str, float]:
    """Median seconds per call of each step function: each runs a block (one warm-up call, then ``rounds``
    timed calls) in turn, ``repeats`` times over. Blocks rather than alternating calls: torch's foreach
    path frees parameter-sized temporaries every step, and the page reclaim that follows would be
    billed to whichever optimizer runs next."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            for r in range(rounds + 1):
                _sync(device)
                start = time.perf_counter()
                step()
                _sync(device)
                if r > 0:
                    times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def compare(numel: int, views: int, dtype: torch.dtype, rounds: int, device: str,
            disk_dir: str) -> dict[str, float]:
    """Median step times of ours, torch fused, torch foreach (and ours on disk, on the CPU) on one shard."""
    params = flat_shard(numel, views, dtype, device)
    optimizers = {
        "ours": AdamOptimizer(params, lr=1e-4, weight_decay=0.01),
        "torch fused": torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True),
        "torch foreach": torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, foreach=True),
    }
    if device == "cpu":
        optimizers["ours on disk"] = AdamDiskOptimizer(params, lr=1e-4, weight_decay=0.01,
                                                       offload_dir=disk_dir)
    medians = block_medians({name: opt.step for name, opt in optimizers.items()}, rounds, device)
    assert optimizers["ours"].last_step_runs == 1, "the flat shard is updated by one fused call"
    return medians


def copy_bandwidth(numel: int, device: str) -> float:
    """Bytes per second of a device-to-device copy of ``numel`` fp32 elements (read + write)."""
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    seconds = block_medians({"copy": lambda: dst.copy_(src)}, 5, device, repeats=1)["copy"]
    return 2 * src.numel() * src.element_size() / seconds


def main() -> None:
    """Run the CPU comparison (and the GPU one when available); print and write the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=100_000_000)
    parser.add_argument("--steps", type=int, default=7, help="timed steps per optimizer (median reported)")
    parser.add_argument("--views", type=int, default=100, help="parameter views in the engine-layout shard")
    parser.add_argument("--disk-dir", default=tempfile.gettempdir(),
                        help="where AdamDiskOptimizer's file goes")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "optim.md")
    args = parser.parse_args()
    from report import command_line, publish

    lines = [f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, {args.numel / 1e6:.0f}M elements, "
             f"median of 2 × {args.steps} steps; AdamDiskOptimizer's file under {args.disk_dir} (in the page "
             "cache: the cost of the copies and system calls, not of the disk)", "",
             "| device | shard | views | ours ms | torch fused ms | torch foreach ms | ours / fused | "
             "foreach / ours | on disk ms | on disk / ours |", "|" + "---|" * 10]
    notes = []
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        for dtype, label in ((torch.float32, "fp32"), (torch.bfloat16, "bf16+master")):
            for views in (1, args.views):
                m = compare(args.numel, views, dtype, args.steps, device, args.disk_dir)
                disk = (f"{m['ours on disk'] * 1e3:.1f} | {m['ours on disk'] / m['ours']:.2f}x"
                        if "ours on disk" in m else "- | -")
                lines.append(f"| {device} | {label} | {views} | {m['ours'] * 1e3:.1f} | {m['torch fused'] * 1e3:.1f} "
                             f"| {m['torch foreach'] * 1e3:.1f} | {m['ours'] / m['torch fused']:.2f}x | "
                             f"{m['torch foreach'] / m['ours']:.2f}x | {disk} |")
            if device == "cuda" and dtype == torch.bfloat16:
                kernel = "CuPy kernel" if cupy_usable(torch.empty(0, device="cuda")) else "torch fused (no CuPy)"
                achieved = BF16_STEP_BYTES * args.numel / m["ours"]
                copy = copy_bandwidth(args.numel, device)
                notes.append(f"{kernel}: {achieved / 1e9:.0f} GB/s achieved ({BF16_STEP_BYTES} B/element), "
                             f"{achieved / copy:.0%} of copy bandwidth ({copy / 1e9:.0f} GB/s)")
    publish(lines + ([""] + notes if notes else []), args.out, command_line())

if __name__ == "__main__":
    main()
