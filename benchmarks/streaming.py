"""Streaming initialisation measured: a checkpoint loaded into a meta-built, wrapped model at 2 ranks, each
rank's peak against its shard, then 3 AdamW steps against plain PyTorch on the same weights.

    nice python benchmarks/streaming.py [--model gpt|llama-1b] [--layers 24] [--world-size 2] [--steps 3]
        [--out table.md]

``--model gpt`` (default): one process builds the benchmark GPT (d_model 1024, seq 128, vocab 8192,
``--layers`` blocks) from a seed, writes its state dict to a safetensors file with plain ``safetensors``,
and trains it ``--steps`` steps on the global batch: the reference. Then each rank of a fresh gloo job
builds the model under ``torch.device("meta")``, wraps it and ``bmt.load``s the file; the kernel's peak
RSS (VmHWM, reset just before it is built) gives what building, wrapping and loading added, set beside the rank's shard and shard + 2
blocks. The wrapped model then trains the same steps on the same data (one sequence per rank) with
``torch.optim.AdamW(fused=True)``.

``--model llama-1b``: the fine-tuning case. ``transformers``' Llama at TinyLlama's 1.1B shape (2048 wide,
22 layers, 32 heads over 4 KV heads, vocab 32000; every other setting its default) is built in fp32 from
a seed and written with ``save_pretrained``; the reference is ``LlamaForCausalLM.from_pretrained`` of that
directory, and each rank runs ``bmt.from_pretrained(LlamaForCausalLM, dir)``. Both train in train mode.
The reference needs about 18 GiB (fp32 weights, gradients and AdamW state).
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
LLAMA_VOCAB, LLAMA_SEQ = 32000, 64  # the 1.1B reference's activations at seq 64 keep it within 24 GiB
GIB = 2**30


def proc_status(field: str) -> int:
    """A byte count from this process's /proc status (VmRSS, VmHWM), 0 where it is absent."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _layers(default: int) -> int:
    return int(os.environ.get("BMT_STREAMING_LAYERS", default))  # how predict() sizes the CLI's model


def gpt(n_layers: int | None = None):
    """The benchmark GPT (also ``bmt-wrap plan``'s factory for it)."""
    n_layers = n_layers or _layers(24)
    sys.path.insert(0, str(HERE))
    from toy_gpt import ToyGPT, ToyGPTConfig

    return ToyGPT(ToyGPTConfig(vocab=VOCAB, d_model=D_MODEL, n_layers=n_layers, seq=SEQ))


def llama_1b(n_layers: int | None = None):
    """transformers' Llama at TinyLlama's 1.1B shape, every other setting its default (``bmt-wrap plan``'s
    factory for it)."""
    n_layers = n_layers or _layers(22)
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=n_layers,
                                        num_attention_heads=32, num_key_value_heads=4, vocab_size=LLAMA_VOCAB))


def _model(layers: int, device: str | None = None):
    import torch

    torch.manual_seed(0)
    with torch.device(device or "cpu"):
        return gpt(layers)


def _vocab(kind: str) -> int:
    return LLAMA_VOCAB if kind == "llama-1b" else VOCAB


def _seq(kind: str) -> int:
    return LLAMA_SEQ if kind == "llama-1b" else SEQ


def _loss(kind: str, model, idx, tgt):
    if kind == "llama-1b":  # transformers shifts the labels itself
        return model(input_ids=idx, labels=idx).loss
    return model(idx, tgt)


def _train(kind: str, model, steps: int, world: int, rank: int | None) -> list[float]:
    import torch
    from toy_gpt import ToyGPTConfig, token_batches

    import bmt_wrap as bmt

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    losses = []
    for idx, tgt in token_batches(ToyGPTConfig(vocab=_vocab(kind), seq=_seq(kind)), steps, batch=world):
        rows = slice(None) if rank is None else slice(rank, rank + 1)
        loss = _loss(kind, model, idx[rows], tgt[rows])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()) if rank is None else float(bmt.sum_loss(loss.detach())))
    return losses


def reference(kind: str, layers: int, steps: int, world: int, path: Path, out: Path) -> None:
    """The plain model: saved (plain safetensors, or ``save_pretrained``), then trained on the whole global
    batch (the Llama as loaded back by ``from_pretrained``, as a user fine-tunes it)."""
    import torch

    if kind == "llama-1b":
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        llama_1b(layers).save_pretrained(path)  # the built copy is freed here
        model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        from safetensors.torch import save_file

        model = _model(layers)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(path), metadata={"format": "pt"})
        del state
    losses = _train(kind, model, steps, world, None)
    out.write_text(json.dumps({"losses": losses, "params": sum(p.numel() for p in model.parameters()),
                               "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def rank_job(kind: str, layers: int, steps: int, path: Path, out: Path) -> None:
    """One rank: meta build, wrap, streaming load (its peak measured), then training."""
    import bmt_wrap as bmt

    bmt.init_distributed(seed=0)
    if kind == "llama-1b":
        from transformers import LlamaForCausalLM
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM restarts from the current RSS
    before = proc_status("VmRSS")  # the process baseline: everything imported, nothing built
    if kind == "llama-1b":
        model = bmt.from_pretrained(LlamaForCausalLM, path)  # meta build, wrap and load in one
        first_block = model.model.layers[0]
    else:
        model = bmt.BMTrainModelWrapper(_model(layers, "meta"))
        bmt.load(model, path)
        first_block = model.blocks[0]
    grew = proc_status("VmHWM") - before
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    block = sum(p.numel() * p.element_size() for p in first_block.parameters())
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    losses = _train(kind, model, steps, bmt.world_size(), bmt.rank())
    out.write_text(json.dumps({"rank": bmt.rank(), "before": before, "grew": grew, "shard": shard,
                               "block": block, "full": full, "losses": losses,
                               "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def predict(kind: str, layers: int, world: int, baseline: int) -> int:
    """``bmt-wrap plan --memory --streaming``'s peak per rank for this job, from the ranks' own baseline."""
    seq = _seq(kind)
    inputs = ([f"input_ids=int64[1,{seq}]", f"labels=int64[1,{seq}]"] if kind == "llama-1b"
              else [f"int64[1,{seq}]", f"int64[1,{seq}]"])
    factory = "llama_1b" if kind == "llama-1b" else "gpt"
    out = subprocess.run([sys.executable, "-c", "import sys; from bmt_wrap.cli import main; sys.exit(main())",
                          "plan", f"{__file__}:{factory}", "--world-size", str(world), "--memory", "1024GiB",
                          "--streaming", "--baseline", str(baseline), "--json",
                          *(a for spec in inputs for a in ("--input", spec))],
                         capture_output=True, text=True, env=dict(os.environ, BMT_STREAMING_LAYERS=str(layers)))
    if out.returncode:
        raise RuntimeError(f"bmt-wrap plan failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout)["counted_per_rank"]  # the count, without the margin kept beside it


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
    p.add_argument("--model", choices=("gpt", "llama-1b"), default="gpt")
    p.add_argument("--layers", type=int, default=None, help="blocks (default: 24 for gpt, 22 for llama-1b)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", type=Path, default=None,
                   help="default: results/streaming.md (gpt) or results/streaming_llama-1b.md")
    args = p.parse_args()
    layers = args.layers or (22 if args.model == "llama-1b" else 24)
    out = args.out or HERE / "results" / ("streaming_llama-1b.md" if args.model == "llama-1b" else "streaming.md")
    sys.path.insert(0, str(HERE))
    from report import command_line, publish

    with open("/proc/loadavg") as f:
        load = " / ".join(f.read().split()[:3])
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / ("pretrained" if args.model == "llama-1b" else "model.safetensors")
        common = [args.model, str(layers), str(args.steps), str(args.world_size), str(ckpt)]
        _launch(["--reference", *common, str(Path(tmp) / "ref.json")], 1)
        size = sum(f.stat().st_size for f in ([ckpt] if ckpt.is_file() else ckpt.glob("*.safetensors")))
        _launch(["--rank", *common, tmp], args.world_size)
        ref = json.loads((Path(tmp) / "ref.json").read_text())
        ranks = [json.loads((Path(tmp) / f"rank-{r}.json").read_text()) for r in range(args.world_size)]
    mib = 2**20
    dloss = max(abs(a - b) for r in ranks for a, b in zip(r["losses"], ref["losses"], strict=True))
    rel = max(abs(a - b) / abs(b) for r in ranks for a, b in zip(r["losses"], ref["losses"], strict=True))
    planned = predict(args.model, layers, args.world_size, max(r["before"] for r in ranks))
    what = (f"transformers Llama {layers} x 2048 (GQA 32/4, MLP 5632), vocab {LLAMA_VOCAB}, fp32, seq {LLAMA_SEQ}"
            if args.model == "llama-1b" else f"GPT {layers} x d_model {D_MODEL}, vocab {VOCAB}, seq {SEQ}")
    written = "save_pretrained, loaded by bmt.from_pretrained" if args.model == "llama-1b" else "plain safetensors"
    lines = [f"{what}: {ref['params'] / 1e6:.0f}M "
             f"params, checkpoint {size / GIB:.2f} GiB ({written}), {args.world_size} ranks, "
             f"{args.steps} AdamW steps (one sequence per rank); the plan's baseline is the ranks' RSS before "
             f"building; host allocator: {os.environ.get('MALLOC_MMAP_THRESHOLD_') and 'MALLOC_MMAP_THRESHOLD_=' + os.environ['MALLOC_MMAP_THRESHOLD_'] or 'glibc default'}; load average {load} (1/5/15 min) on {os.cpu_count()} cores", "",
             "| rank | meta build + wrap + load grew RSS by | its shard | shard + 2 blocks | full model | grew / shard | "
             "peak RSS training | plan predicts | peak vs plan | one process's peak RSS | "
             "max Δloss vs one process | max relative Δloss |", "|" + "---|" * 12]
    for r in ranks:
        lines.append(f"| {r['rank']} | {r['grew'] / mib:.0f} MiB | {r['shard'] / mib:.0f} MiB | "
                     f"{(r['shard'] + 2 * r['block']) / mib:.0f} MiB | {r['full'] / mib:.0f} MiB | "
                     f"{r['grew'] / r['shard']:.2f}x | {r['rss'] / GIB:.2f} GiB | {planned / GIB:.2f} GiB | "
                     f"{r['rss'] / planned:.3f}x | {ref['rss'] / GIB:.2f} GiB | {dloss:.1e} | {rel:.1e} |")
    publish(lines, out, command_line(None))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("--reference", "--rank"):
        sys.path.insert(0, str(HERE))
        kind, layers, steps, world = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
        ckpt = Path(sys.argv[6])
        if sys.argv[1] == "--reference":
            reference(kind, layers, steps, world, ckpt, Path(sys.argv[7]))
        else:
            rank_job(kind, layers, steps, ckpt, Path(sys.argv[7]) / f"rank-{os.environ['RANK']}.json")
    else:
        main()
