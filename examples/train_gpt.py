"""Pre-train a small byte-level GPT from scratch on real text: the Python sources of the installed torch.

The model is plain PyTorch; one line (``bmt.BMTrainModelWrapper``) shards it ZeRO-3 style, checkpoints
and prefetches its blocks. Fused ``AdamOptimizer``, cosine schedule with warm-up, gradient clipping,
sharded checkpoints every ``--save-every`` steps and ``--resume``, a progress bar on rank 0 (loss,
tokens/s, memory), ``--inspect-every N`` parameter tables, and a loss-curve PNG at the end. The
defaults finish in a few minutes on 2 CPU cores (``make demo``); on GPUs the same command uses NCCL.

    torchrun --nproc_per_node=2 examples/train_gpt.py [--steps 300] [--out-dir out/train_gpt] [--resume]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from corpus import batch_for_step, load_corpus  # examples/ is on sys.path when a script here runs
from torch import nn
from tqdm import tqdm

import bmt_wrap as bmt
from bmt_wrap.inspect import format_summary, inspect_model, memory_stats


# ---- the model: plain PyTorch, nothing bmt_wrap-specific ----------------------------------------
class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class ByteGPT(nn.Module):
    """A GPT over bytes (vocabulary 256) with a head tied to the token embedding."""

    def __init__(self, d: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, 256, bias=False)
        self.head.weight = self.tok.weight
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight"))
                                else 0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, 256), targets.reshape(-1))


# ---- training ---------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; the defaults are what ``make demo`` runs."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=300, help="length of the run (and of the cosine schedule)")
    p.add_argument("--stop-at", type=int, help="stop after this many steps (as if preempted); continue with --resume")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="max global gradient norm")
    p.add_argument("--corpus-mb", type=float, default=16, help="bytes of torch's sources to train on")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="out/train_gpt", help="checkpoints, loss curve, metrics, final model")
    p.add_argument("--save-every", type=int, default=100, help="sharded checkpoint every N steps (0: never)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out-dir")
    p.add_argument("--inspect-every", type=int, default=0, help="print parameter statistics every N steps")
    p.add_argument("--sample", type=int, default=120, help="bytes to generate at the end (0: none)")
    p.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    return p.parse_args(argv)


def build(args: argparse.Namespace) -> tuple[nn.Module, bmt.optim.OptimManager, torch.optim.Optimizer]:
    """The wrapped model, its optimizer (no decay on biases and norms) and the OptimManager."""
    device = bmt.get_state().device
    model = ByteGPT(args.d_model, args.layers, args.heads, args.seq).to(device)
    gpu = device.type == "cuda"
    model = bmt.BMTrainModelWrapper(model, mixed_precision=bmt.MixedPrecision() if gpu else None)
    # By name: after wrapping every parameter is a 1-D shard, so `p.dim()` cannot tell matrices apart.
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and ".ln" not in n and "ln_f" not in n]
    keep = {id(p) for p in decay}
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": [p for p in model.parameters() if id(p) not in keep], "weight_decay": 0.0}]
    optimizer = bmt.optim.AdamOptimizer(groups, lr=args.lr, betas=(0.9, 0.95))
    schedule = bmt.lr_scheduler.Cosine(optimizer, start_lr=args.lr, warmup_iter=args.warmup, end_iter=args.steps)
    manager = bmt.optim.OptimManager(loss_scale=None)  # fp32 on CPU, bf16 on GPU: no loss scaling needed
    manager.add_optimizer(optimizer, schedule)
    return model, manager, optimizer


@torch.no_grad()
def sample(model: nn.Module, prompt: bytes, n: int, seq: int, temperature: float = 0.7) -> bytes:
    """Continue ``prompt`` by sampling. Every rank runs the same forwards (they are collectives) and
    draws from identically seeded generators, so all ranks produce the same text."""
    device = bmt.get_state().device
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor(list(prompt), device=device)[None]
    for _ in range(n):
        probs = (model(ids[:, -seq:])[0, -1].float() / temperature).softmax(-1).cpu()
        nxt = torch.multinomial(probs, 1, generator=g).to(device)
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return bytes(ids[0].tolist())


def plot_losses(losses: list[float], path: Path) -> None:
    """The loss curve (raw and a 20-step moving average)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(losses, alpha=0.35, label="loss")
    w = min(20, len(losses))
    smooth = [sum(losses[max(0, i - w + 1):i + 1]) / len(losses[max(0, i - w + 1):i + 1]) for i in range(len(losses))]
    ax.plot(smooth, label=f"{w}-step mean")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.set_title(f"byte-level GPT on torch's sources, {bmt.world_size()} ranks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    """Train (or resume), then write metrics.json, loss.png and model.safetensors into --out-dir."""
    args = parse_args(argv)
    bmt.init_distributed(seed=args.seed)
    rank, world = bmt.rank(), bmt.world_size()
    out = Path(args.out_dir)
    ckpt = out / "checkpoint"
    corpus = load_corpus(int(args.corpus_mb * 2**20))
    model, manager, optimizer = build(args)
    n_params = sum(p.full_shape.numel() for p in model.parameters())
    bmt.print_rank(f"{n_params / 1e6:.2f}M parameters, {len(model.plan.blocks())} blocks sharded over {world} "
                   f"rank(s); corpus {corpus.numel() / 2**20:.1f} MiB of torch's Python sources")
    start, losses = 0, []
    if args.resume:
        info = bmt.load_checkpoint(ckpt, model, optim_manager=manager)
        start, losses = info.step, list(info.extra["losses"])
        bmt.print_rank(f"resumed from step {start} ({ckpt})")
    stop = min(args.steps, args.stop_at or args.steps)
    global_batch = args.batch * world
    bar = tqdm(total=stop, initial=start, disable=rank != 0 or args.no_progress, unit="step", dynamic_ncols=True)
    device = bmt.get_state().device
    for step in range(start, stop):
        t0 = time.perf_counter()
        idx, tgt = batch_for_step(corpus, step, args.seed, global_batch, args.seq, rank, world)
        loss = model(idx.to(device), tgt.to(device))
        manager.zero_grad()
        manager.backward(loss)
        grad_norm = manager.clip_grad_norm(max_norm=args.clip)
        manager.step()
        losses.append(float(bmt.sum_loss(loss)))
        tokens_per_s = global_batch * args.seq / (time.perf_counter() - t0)
        mem = memory_stats()
        stats = {"loss": f"{losses[-1]:.3f}", "tok/s": f"{tokens_per_s:,.0f}", "mem": f"{mem['current'] / 2**30:.2f}G",
                 "lr": f"{optimizer.param_groups[0]['lr']:.1e}", "|g|": f"{float(grad_norm):.2f}"}
        bar.set_postfix(stats, refresh=False)
        bar.update()
        if args.no_progress and (step % 10 == 0 or step == stop - 1):
            bmt.print_rank(f"step {step:5d} " + " ".join(f"{k} {v}" for k, v in stats.items()))
        if args.inspect_every and (step + 1) % args.inspect_every == 0:
            table = format_summary(inspect_model(model))  # a collective: every rank calls it
            if rank == 0:
                bar.write(f"parameters after step {step + 1}:\n{table}")
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            bmt.save_checkpoint(ckpt, model, optim_manager=manager, step=step + 1, extra={"losses": losses})
    bar.close()
    if stop < args.steps:  # preempted: leave a checkpoint to resume from
        bmt.save_checkpoint(ckpt, model, optim_manager=manager, step=stop, extra={"losses": losses})
        bmt.print_rank(f"stopped at step {stop}; continue with --resume")
        return {"losses": losses}
    bmt.see_memory("end of training")
    bmt.save(model, out / "model.safetensors")
    text = sample(model, b"def forward(self, ", args.sample, args.seq) if args.sample else b""
    metrics = {"losses": losses, "first10": sum(losses[:10]) / min(10, len(losses)),
               "last10": sum(losses[-10:]) / min(10, len(losses)), "params": n_params, "world_size": world}
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps(metrics))
        plot_losses(losses, out / "loss.png")
        print(f"loss: first 10 steps {metrics['first10']:.3f} -> last 10 steps {metrics['last10']:.3f} nats/byte; "
              f"curve {out / 'loss.png'}, model {out / 'model.safetensors'}")
        if text:
            print("sample:\n" + text.decode("utf-8", errors="replace"))
    return metrics


if __name__ == "__main__":
    main()
