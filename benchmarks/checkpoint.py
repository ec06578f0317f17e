"""Checkpoint I/O and meta-device initialisation: time and peak RSS per rank.

    torchrun --nproc_per_node 2 benchmarks/checkpoint.py [--save-gb 1.0] [--init-gb 3.0] [--dir /tmp/bmt_ckpt]

Part 1, a ~1 GB fp32 model: ``bmt.save`` (.safetensors) time and rank 0's peak RSS above its level
before the save; ``bmt.load`` time and every rank's peak RSS above its level before the load. Target:
extra peak <= one shard group (the largest). Part 2, a ~3 GB fp32 model built under ``torch.device("meta")``:
peak RSS of wrap + ``init_parameters`` against torch's own baseline + Psi*4B/N + 2 x largest group.
RSS is sampled every 2 ms from /proc/self/status: total, and anonymous (total minus the page-cache pages
of the memory-mapped file, which the kernel can drop at any time).
"""

from __future__ import annotations

import argparse
import json
import shutil
import threading
import time
from pathlib import Path

import torch
from torch import nn

import bmt_wrap as bmt

MB = 2 ** 20
WIDTH = 4096


def rss() -> tuple[int, int]:
    """(resident bytes, anonymous resident bytes) of this process now; the difference is file pages."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return tuple(int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "RssAnon"))  # type: ignore[return-value]


class PeakRSS:
    """Samples RSS in a thread while inside: ``.start``/``.peak`` and ``.start_anon``/``.peak_anon``, bytes."""

    def __enter__(self) -> PeakRSS:
        self.start, self.start_anon = rss()
        self.peak, self.peak_anon = self.start, self.start_anon
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._update()

    def _update(self) -> None:
        total, anon = rss()
        self.peak, self.peak_anon = max(self.peak, total), max(self.peak_anon, anon)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._update()


class Model(nn.Module):
    """An embedding and a list of square linear blocks: each block becomes a shard group."""

    def __init__(self, n_blocks: int, vocab: int, width: int = WIDTH) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(n_blocks))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return x


def build(gb: float, width: int = WIDTH) -> tuple[int, int]:
    """(blocks, vocab) for about ``gb`` GB of fp32 parameters (at least 2 blocks) at ``width``; the
    embedding is the largest group."""
    vocab = 16384
    per_block = width * width + width
    n = max(2, int((gb * 1e9 / 4 - vocab * width) // per_block))
    return n, vocab


def largest_group(model: nn.Module) -> int:
    """Bytes of the largest shard group (unsharded)."""
    return max(g.param_bytes() for g in model.plan.groups)


def part_save_load(gb: float, directory: Path) -> dict:
    n, vocab = build(gb)
    torch.manual_seed(0)
    model = bmt.BMTrainModelWrapper(Model(n, vocab))
    psi = sum(p.full_shape.numel() for p in model.parameters())
    path = directory / "model.safetensors"
    bmt.barrier()
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        bmt.save(model, path)
        save_s = time.perf_counter() - t0
    save_extra, save_anon = mem.peak - mem.start, mem.peak_anon - mem.start_anon
    bmt.barrier()
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        bmt.load(model, path)
        bmt.barrier()
        load_s = time.perf_counter() - t0
    return {"params": psi, "file_bytes": path.stat().st_size, "largest_group": largest_group(model),
            "save_s": save_s, "save_extra": save_extra, "save_extra_anon": save_anon, "load_s": load_s,
            "load_extra": mem.peak - mem.start, "load_extra_anon": mem.peak_anon - mem.start_anon}


def part_meta_init(gb: float, baseline: int) -> dict:
    n, vocab = build(gb)
    with PeakRSS() as mem:
        with torch.device("meta"):
            model = Model(n, vocab)
        model = bmt.BMTrainModelWrapper(model)
        torch.manual_seed(0)
        t0 = time.perf_counter()
        bmt.init_parameters(model)
        init_s = time.perf_counter() - t0
    psi = sum(p.full_shape.numel() for p in model.parameters())
    target = baseline + psi * 4 // bmt.world_size() + 2 * largest_group(model)
    return {"params": psi, "init_s": init_s, "peak": mem.peak, "baseline": baseline, "target": target,
            "largest_group": largest_group(model)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--save-gb", type=float, default=1.0)
    parser.add_argument("--init-gb", type=float, default=3.0)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bmt_ckpt_bench"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    bmt.init_distributed(backend="gloo")
    baseline = rss()[0]  # torch imported, process group up: what any torch job pays
    rank = bmt.rank()
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
        args.dir.mkdir(parents=True)
    bmt.barrier()
    result = {"rank": rank, "init": part_meta_init(args.init_gb, baseline)}
    result["io"] = part_save_load(args.save_gb, args.dir)
    rows = [None] * bmt.world_size()
    torch.distributed.all_gather_object(rows, result)
    if rank == 0:
        print(json.dumps(rows, indent=1))
        io = rows[0]["io"]
        print(f"\n== save/load: {io['params'] / 1e6:.0f}M params, file {io['file_bytes'] / MB:.0f} MiB, "
              f"largest group {io['largest_group'] / MB:.0f} MiB, {len(rows)} ranks")
        print(f"save {io['save_s']:.2f} s, rank 0 extra peak RSS {io['save_extra'] / MB:.0f} MiB "
              f"(anonymous {io['save_extra_anon'] / MB:.0f} MiB)")
        for r in rows:
            print(f"load rank {r['rank']}: {r['io']['load_s']:.2f} s, extra peak RSS {r['io']['load_extra'] / MB:.0f} "
                  f"MiB (anonymous {r['io']['load_extra_anon'] / MB:.0f} MiB)")
        ini = rows[0]["init"]
        print(f"\n== meta wrap + init_parameters: {ini['params'] / 1e6:.0f}M params "
              f"({ini['params'] * 4 / 1e9:.2f} GB fp32), largest group {ini['largest_group'] / MB:.0f} MiB")
        for r in rows:
            i = r["init"]
            print(f"rank {r['rank']}: {i['init_s']:.1f} s, peak RSS {i['peak'] / MB:.0f} MiB, target "
                  f"{i['target'] / MB:.0f} MiB (baseline {i['baseline'] / MB:.0f})")
        shutil.rmtree(args.dir, ignore_errors=True)
    bmt.barrier()


if __name__ == "__main__":
    main()
