"""Resumable sharded checkpoints, two formats side by side: ours (``bmt.save_checkpoint``/``load_checkpoint``)
and ``torch.distributed.checkpoint`` (``get_state_dict`` + ``dcp.save``/``dcp.load`` + ``set_state_dict``).

    torchrun --nproc_per_node 2 benchmarks/sharded_formats.py [--gb 0.5] [--repeats 3] [--dir /tmp/bmt_formats]

A wrapped model of about ``--gb`` GB of fp32 parameters (an embedding and square blocks ``--width`` wide,
at least two: 0.4 GB at the default width) and its AdamW state (two moments) after one step,
saved and loaded at the same world size, alternating the formats ``--repeats`` times: median save and load
seconds (slowest rank), each rank's peak RSS above its level before the call (the larger rank's), and the
bytes on disk. Both write each rank's own elements; both reshard on load (tests/test_dcp.py and
tests/test_checkpoint_sharded.py check that). Writes benchmarks/results/sharded_formats.md.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

import torch
from checkpoint import Model, PeakRSS, build
from report import publish

import bmt_wrap as bmt
from bmt_wrap.checkpoint.dcp import load_sharded, save_sharded

MB = 2 ** 20


def _timed(fn) -> tuple[float, int, int]:  # noqa: ANN001 - a thunk
    """(seconds on the slowest rank, largest extra peak RSS, largest extra peak anonymous RSS) of ``fn()``,
    over ranks; a collective. Anonymous RSS leaves out file pages (memory-mapped reads) the kernel can drop."""
    bmt.barrier()
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        fn()
        bmt.barrier()
        seconds = time.perf_counter() - t0
    out = torch.tensor([seconds, float(mem.peak - mem.start), float(mem.peak_anon - mem.start_anon)],
                       dtype=torch.float64)
    torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.MAX)
    return float(out[0]), int(out[1]), int(out[2])


def _disk(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=4096, help="the blocks' width (the tests' smoke run shrinks it)")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bmt_formats"))
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "sharded_formats.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    bmt.init_distributed(backend="gloo")
    n, vocab = build(args.gb, args.width)
    torch.manual_seed(0)
    model = bmt.BMTrainModelWrapper(Model(n, vocab, args.width))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, vocab, (2, 8))).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    psi = sum(p.full_shape.numel() for p in model.parameters())
    if bmt.rank() == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
    bmt.barrier()
    ours, dcp = args.dir / "ours", args.dir / "dcp"
    formats = {
        "bmt.save_checkpoint (ours)": (lambda: bmt.save_checkpoint(ours, model, optimizer=opt),
                                       lambda: bmt.load_checkpoint(ours, model, optimizer=opt), ours),
        "torch.distributed.checkpoint": (lambda: save_sharded(dcp, model, opt), lambda: load_sharded(dcp, model, opt),
                                         dcp),
    }
    keys = ("save", "save_rss", "save_anon", "load", "load_rss", "load_anon")
    runs: dict[str, dict[str, list[float]]] = {k: {key: [] for key in keys} for k in formats}
    for _ in range(args.repeats):
        for name, (save, load, _) in formats.items():
            for key, v in zip(keys, (*_timed(save), *_timed(load)), strict=True):
                runs[name][key].append(v)
    if bmt.rank() == 0:
        med = {k: {m: statistics.median(v) for m, v in r.items()} for k, r in runs.items()}
        ref = med["bmt.save_checkpoint (ours)"]
        lines = [f"{psi / 1e6:.0f}M fp32 parameters + AdamW moments, {bmt.world_size()} ranks (gloo), medians of "
                 f"{args.repeats} alternating runs; +RSS: the larger rank's peak above its level before the call, "
                 "total (anonymous, i.e. without droppable file pages)", "",
                 "| format | save s | save vs ours | load s | load vs ours | save +RSS | load +RSS | on disk |",
                 "|---|---|---|---|---|---|---|---|"]
        for name, m in med.items():
            lines.append(f"| {name} | {m['save']:.2f} | {m['save'] / ref['save']:.2f}x | {m['load']:.2f} | "
                         f"{m['load'] / ref['load']:.2f}x | {m['save_rss'] / MB:.0f} ({m['save_anon'] / MB:.0f}) MiB | "
                         f"{m['load_rss'] / MB:.0f} ({m['load_anon'] / MB:.0f}) MiB | {_disk(formats[name][2]) / MB:.0f} MiB |")
        publish(lines, args.out)
        shutil.rmtree(args.dir, ignore_errors=True)
    bmt.barrier()


if __name__ == "__main__":
    main()
