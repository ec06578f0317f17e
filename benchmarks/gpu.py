"""Single-GPU benchmark, self-contained, under 5 minutes on one H100/H200-class GPU.

1. Fused Adam: ``bmt.optim.AdamOptimizer`` (the CuPy kernel when CuPy is installed) against
   ``torch.optim.AdamW(fused=True)`` on the same 100M-element shard (fp32, and bf16 with our fp32
   master), as milliseconds per step and achieved GB/s, beside the device's copy bandwidth.
2. Training step of a ~370M-parameter GPT (24 blocks x 1024, seq 1024, batch 8, bf16 autocast, fused
   AdamW for all): plain PyTorch, plain with ``torch.utils.checkpoint`` per block, and
   ``bmt.BMTrainModelWrapper`` (world size 1, every block checkpointed): median (min-max) step time and
   peak CUDA memory, as ratios to plain.
3. With ``--offload-capacity`` (issue 37; tens of minutes, not five): benchmarks/gpu_offload.py's search for
   the largest Llama-shaped model on an emulated 24 GiB card: plain, per-layer checkpointing, FSDP2 with
   ``CPUOffloadPolicy`` and ``offload="host"``, and tokens/s where all fit.

    python benchmarks/gpu.py [--numel 100000000] [--layers 24] [--steps 10] [--offload-capacity [--card 24GiB]]
    python benchmarks/gpu.py --dry-run      # no GPU: section 3's probes and model sizes

Without a CUDA device it exits at once with a message (CPU numbers: ``benchmarks/compare.py``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from gpu_offload import add_options, capacity_lines, dry_run
from optim import BF16_STEP_BYTES, compare, copy_bandwidth
from report import publish
from torch import nn
from torch.utils.checkpoint import checkpoint
from toy_gpt import ToyGPT, ToyGPTConfig

import bmt_wrap as bmt
from bmt_wrap.kernels import cupy_usable

FP32_STEP_BYTES = 28  # grad 4, param 4+4, exp_avg 4+4, exp_avg_sq 4+4: the same for both optimizers
TORCH_BF16_STEP_BYTES = 14  # torch keeps bf16 state: grad 2, param 2+2, moments 2x(2+2)
NO_CUDA = ("benchmarks/gpu.py needs a CUDA GPU and none is visible (torch.cuda.is_available() is False); "
           "nothing was measured. On CPU run: python benchmarks/compare.py")


class Checkpointed(nn.Module):
    """A block run under ``torch.utils.checkpoint`` (the unwrapped baseline's activation checkpointing)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


def optimizer_table(numel: int, steps: int) -> list[str]:
    """Section 1: our fused Adam against torch's, in ms per step and GB/s."""
    kernel = "CuPy kernel" if cupy_usable(torch.empty(0, device="cuda")) else "torch fused (CuPy not installed)"
    copy = copy_bandwidth(numel, "cuda")
    lines = [f"#### Fused Adam, {numel / 1e6:.0f}M elements, 100 parameter views of one flat buffer; ours: {kernel}; "
             f"device copy bandwidth {copy / 1e9:.0f} GB/s", "",
             "| shard | ours ms | ours GB/s | torch fused ms | torch fused GB/s | ours / torch time |",
             "|---|---|---|---|---|---|"]
    for dtype, label, ours_bytes, torch_bytes in ((torch.float32, "fp32", FP32_STEP_BYTES, FP32_STEP_BYTES),
                                                 (torch.bfloat16, "bf16 (+fp32 master for ours)", BF16_STEP_BYTES,
                                                  TORCH_BF16_STEP_BYTES)):
        m = compare(numel, 100, dtype, steps, "cuda")
        ours, fused = m["ours"], m["torch fused"]
        lines.append(f"| {label} | {ours * 1e3:.2f} | {ours_bytes * numel / ours / 1e9:.0f} | {fused * 1e3:.2f} | "
                     f"{torch_bytes * numel / fused / 1e9:.0f} | {ours / fused:.2f}x |")
        torch.cuda.empty_cache()
    return lines


def train_step_stats(kind: str, cfg: ToyGPTConfig, batch: int, steps: int, warmup: int) -> dict:
    """Median/min/max step time, peak memory and final loss of one way of training the same model."""
    torch.manual_seed(0)
    model = ToyGPT(cfg).cuda()
    if kind == "torch checkpoint":
        model.blocks = nn.ModuleList(Checkpointed(b) for b in model.blocks)
    elif kind == "bmt_wrap":
        model = bmt.BMTrainModelWrapper(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator(device="cuda").manual_seed(1)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, loss = [], float("nan")
    for i in range(warmup + steps):
        seq = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), device="cuda", generator=g)
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(seq[:, :-1], seq[:, 1:])
        out.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
        loss = float(out.detach())
    peak = torch.cuda.max_memory_allocated()
    del model, opt, out
    torch.cuda.empty_cache()
    return {"kind": kind, "median": statistics.median(times), "min": min(times), "max": max(times), "peak": peak,
            "loss": loss}


def model_table(layers: int, batch: int, steps: int) -> list[str]:
    """Section 2: plain, plain + torch checkpointing, and wrapped, on the same model and data."""
    cfg = ToyGPTConfig(vocab=32768, d_model=1024, n_layers=layers, n_heads=16, seq=1024)
    params = sum(p.numel() for p in ToyGPT(cfg).parameters())
    lines = [f"#### Training step, toy GPT {layers} x 1024, vocab {cfg.vocab}, {params / 1e6:.0f}M params, batch "
             f"{batch} x seq {cfg.seq}, bf16 autocast, fused AdamW, {steps} steps after 3 warm-up", "",
             "| training | step ms: median (min-max) | vs plain | peak CUDA memory | vs plain | final loss |",
             "|---|---|---|---|---|---|"]
    rows = [train_step_stats(kind, cfg, batch, steps, 3) for kind in ("plain", "torch checkpoint", "bmt_wrap")]
    base = rows[0]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['median'] * 1e3:.1f} ({r['min'] * 1e3:.1f}-{r['max'] * 1e3:.1f}) | "
                     f"{r['median'] / base['median']:.2f}x | {r['peak'] / 2**30:.2f} GiB | "
                     f"{r['peak'] / base['peak']:.2f}x | {r['loss']:.4f} |")
    return lines


def main() -> None:
    """Both sections, as Markdown tables, printed and written to ``--out`` (RESULTS.md quotes that file)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=100_000_000)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "gpu.md")
    p.add_argument("--offload-capacity", action="store_true", help="also section 3 (issue 37's GPU goal)")
    p.add_argument("--dry-run", action="store_true", help="print section 3's probes; needs no GPU")
    add_options(p)
    args = p.parse_args()
    if args.dry_run:
        print("\n".join(dry_run(args)))
        return
    if not torch.cuda.is_available():
        raise SystemExit(NO_CUDA)
    bmt.init_distributed(seed=0)
    device = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    lines = [device, "", *optimizer_table(args.numel, args.steps), "", *model_table(args.layers, args.batch, args.steps)]
    if args.offload_capacity:
        lines += ["", "#### Largest model on an emulated card (issue 37)", "", *capacity_lines(args)]
    publish(lines, args.out)


if __name__ == "__main__":
    main()
