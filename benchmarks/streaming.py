"""Streaming initialisation measured: a checkpoint loaded into a meta-built, wrapped model at 2 ranks, each
rank's peak against its shard, then 3 AdamW steps against plain PyTorch on the same weights.

    nice python benchmarks/streaming.py [--layers 24] [--world-size 2] [--steps 3] [--out table.md]

One process builds the benchmark GPT (d_model 1024, seq 128, vocab 8192, ``--layers`` blocks) from a seed,
writes its state dict to a safetensors file with plain ``safetensors``, and trains it ``--steps`` steps on
the global batch: the reference. Then each rank of a fresh gloo job builds the model under
``torch.device("meta")``, wraps it and ``bmt.load``s the file; the kernel's peak RSS (VmHWM, reset just
before) gives what the load added, set beside the rank's shard and shard + 2 blocks. The wrapped model
then trains the same steps on the same data (one sequence per rank) with ``torch.optim.AdamW(fused=True)``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
D_MODEL, SEQ, VOCAB = 1024, 128, 8192
GIB = 2**30


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _model(layers: int, device: str | None = None):
    import torch
    from toy_gpt import ToyGPT, ToyGPTConfig

    torch.manual_seed(0)
    with torch.device(device or "cpu"):
        return ToyGPT(ToyGPTConfig(vocab=VOCAB, d_model=D_MODEL, n_layers=layers, seq=SEQ))


def _train(model, steps: int, world: int, rank: int | None) -> list[float]:
    import torch
    from toy_gpt import ToyGPTConfig, token_batches

    import bmt_wrap as bmt

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    losses = []
    for idx, tgt in token_batches(ToyGPTConfig(vocab=VOCAB, seq=SEQ), steps, batch=world):
        rows = slice(None) if rank is None else slice(rank, rank + 1)
        loss = model(idx[rows], tgt[rows])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss) if rank is None else float(bmt.sum_loss(loss.detach())))
    return losses


def reference(layers: int, steps: int, world: int, path: Path, out: Path) -> None:
    """The plain model: saved with plain safetensors, then trained on the whole global batch."""
    from safetensors.torch import save_file

    model = _model(layers)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path), metadata={"format": "pt"})
    del state
    losses = _train(model, steps, world, None)
    out.write_text(json.dumps({"losses": losses, "params": sum(p.numel() for p in model.parameters()),
                               "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def rank_job(layers: int, steps: int, path: Path, out: Path) -> None:
    """One rank: meta build, wrap, streaming load (its peak measured), then training."""
    import bmt_wrap as bmt

    bmt.init_distributed(seed=0)
    model = bmt.BMTrainModelWrapper(_model(layers, "meta"))
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM restarts from the current RSS
    before = _status("VmRSS")
    bmt.load(model, path)
    grew = _status("VmHWM") - before
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    block = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    losses = _train(model, steps, bmt.world_size(), bmt.rank())
    out.write_text(json.dumps({"rank": bmt.rank(), "before": before, "grew": grew, "shard": shard,
                               "block": block, "full": full, "losses": losses,
                               "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def _launch(args: list[str], nproc: int) -> None:
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(21000 + os.getpid() % 20000), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__, *args], env=env))
    if any(p.wait() for p in procs):
        raise RuntimeError(f"{args[0]} failed")


def main() -> None:
    """Reference, then the streaming job; print and write the table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", type=Path, default=HERE / "results" / "streaming.md")
    args = p.parse_args()
    sys.path.insert(0, str(HERE))
    from report import command_line, publish

    with open("/proc/loadavg") as f:
        load = " / ".join(f.read().split()[:3])
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "model.safetensors"
        common = [str(args.layers), str(args.steps), str(args.world_size), str(ckpt)]
        _launch(["--reference", *common, str(Path(tmp) / "ref.json")], 1)
        size = ckpt.stat().st_size
        _launch(["--rank", *common, tmp], args.world_size)
        ref = json.loads((Path(tmp) / "ref.json").read_text())
        ranks = [json.loads((Path(tmp) / f"rank-{r}.json").read_text()) for r in range(args.world_size)]
    mib = 2**20
    dloss = max(abs(a - b) for r in ranks for a, b in zip(r["losses"], ref["losses"], strict=True))
    lines = [f"GPT {args.layers} x d_model {D_MODEL}, vocab {VOCAB}, seq {SEQ}: {ref['params'] / 1e6:.0f}M "
             f"params, checkpoint {size / GIB:.2f} GiB (plain safetensors), {args.world_size} ranks, "
             f"{args.steps} AdamW steps; load average {load} (1/5/15 min) on {os.cpu_count()} cores", "",
             "| rank | load grew RSS by | its shard | shard + 2 blocks | full model | grew / shard | "
             "peak RSS training | one process's peak RSS | max Δloss vs one process |", "|" + "---|" * 9]
    for r in ranks:
        lines.append(f"| {r['rank']} | {r['grew'] / mib:.0f} MiB | {r['shard'] / mib:.0f} MiB | "
                     f"{(r['shard'] + 2 * r['block']) / mib:.0f} MiB | {r['full'] / mib:.0f} MiB | "
                     f"{r['grew'] / r['shard']:.2f}x | {r['rss'] / GIB:.2f} GiB | "
                     f"{ref['rss'] / GIB:.2f} GiB | {dloss:.1e} |")
    publish(lines, args.out, command_line(None))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("--reference", "--rank"):
        sys.path.insert(0, str(HERE))
        layers, steps, world, ckpt = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
        if sys.argv[1] == "--reference":
            reference(layers, steps, world, ckpt, Path(sys.argv[6]))
        else:
            rank_job(layers, steps, ckpt, Path(sys.argv[6]) / f"rank-{os.environ['RANK']}.json")
    else:
        main()
