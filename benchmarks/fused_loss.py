"""fused_loss=True against the unfused head: a Llama-shaped model with Llama-3's 128,256-word vocabulary.

    nice python benchmarks/fused_loss.py [--seqs 512,1024,2048] [--world-size 2] [--steps 3] [--limit 8GiB]
        [--hidden 256] [--layers 2] [--out benchmarks/results/fused_loss.md]

Each (mode, sequence) is a fresh job of ``--world-size`` rank processes (gloo, ``OMP_NUM_THREADS=1``,
``MALLOC_MMAP_THRESHOLD_=65536``: freed tensors leave the process), under ``capacity.run_ranks``' watchdog,
which kills the job when its ranks' summed RSS passes ``--limit``. Each rank builds transformers'
``LlamaForCausalLM`` (untied head, default config but for the sizes), wraps it with or without
``fused_loss=True``, and trains ``--steps`` steps (the first not timed) of one sequence per rank, called as
users call it (``model(input_ids=x, labels=x)``, default ``use_cache``), with ``torch.optim.AdamW(fused=True)``.
Reported: the ranks' summed peak RSS (``ru_maxrss``), whether the job fitted the limit, the median step
time and its ratio to the unfused job's, the plan's count of the head and loss pair (``model.plan.fused_loss``),
and the fused job's loss against the unfused one's at the first step (same weights and data).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VOCAB = 128_256
MIB = 2**20
ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def llama(hidden: int = 256, layers: int = 2, seq: int = 2048) -> object:
    """The benchmark's model (also ``bmt-wrap plan benchmarks/fused_loss.py:llama``): transformers' Llama,
    Llama-3's vocabulary, untied head, default config but for the sizes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, max_position_embeddings=seq,
        tie_word_embeddings=False))


def worker(mode: str, seq: int, steps: int, hidden: int, layers: int, out: Path) -> None:
    """One rank: build, wrap, train; write peak RSS, step times, the first loss and the plan's bytes."""
    import torch

    import bmt_wrap as bmt

    bmt.init_distributed(seed=0, backend="gloo")
    torch.manual_seed(0)
    model = bmt.BMTrainModelWrapper(llama(hidden, layers, seq), fused_loss=mode == "fused")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator().manual_seed(bmt.rank())
    times, losses = [], []
    for step in range(steps):
        ids = torch.randint(0, VOCAB, (1, seq), generator=g)
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step:
            times.append(time.perf_counter() - start)
        losses.append(float(loss))
    section = model.plan.fused_loss
    out.write_text(json.dumps({"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "times": times,
                               "loss": losses[0], "fused": bool(section and section.fused),
                               "unfused_bytes": section.unfused_bytes if section else None,
                               "fused_bytes": section.fused_bytes if section else None}))


def job(mode: str, seq: int, args: argparse.Namespace) -> dict:
    """One fresh job; its ranks' results and whether it fitted the limit."""
    sys.path.insert(0, str(HERE))
    from capacity import parse_size, run_ranks

    def argv(rank: int, out: Path) -> list[str]:
        return [sys.executable, __file__, "--worker", mode, str(seq), str(args.steps), str(args.hidden),
                str(args.layers), str(out)]

    print(f"  {mode} seq {seq} ...", file=sys.stderr, flush=True)
    return run_ranks(argv, args.world_size, parse_size(args.limit), args.timeout, ENV)


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MIB:.0f}"


def _peak(r: dict) -> float | None:
    return sum(r["rank_peaks"]) if r["ok"] else None


def _step(r: dict) -> float | None:
    return statistics.median(t for x in r["results"] for t in x["times"]) if r["ok"] else None


def _fits(r: dict) -> str:
    return "yes" if r["ok"] else "no"


def _secs(t: float | None) -> str:
    return "-" if t is None else f"{t:.2f}"


def table(rows: list[tuple[int, dict, dict]], args: argparse.Namespace) -> str:
    """The Markdown table and the command that made it."""
    head = (f"{args.world_size} ranks, Llama {args.layers} x {args.hidden}, vocabulary {VOCAB:,}, untied head, fp32, "
            f"one sequence per rank, labels given, default use_cache; {args.steps} steps, the first not timed; "
            f"MALLOC_MMAP_THRESHOLD_={ENV['MALLOC_MMAP_THRESHOLD_']}; killed above {args.limit} summed; RSS in MiB (sum over ranks)\n\n"
            "| seq | unfused peak | fused peak | saved | fits: unfused | fits: fused | unfused step s | fused step s "
            "| ratio | plan: pair unfused / fused per rank | first loss, fused - unfused |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for seq, plain, fused in rows:
        p, f = _peak(plain), _peak(fused)
        sp, sf = _step(plain), _step(fused)
        first = fused["results"][0] if fused["results"] else None
        cells = [str(seq), _mib(p), _mib(f), _mib(p - f) if p and f else "-", _fits(plain), _fits(fused),
                 _secs(sp), _secs(sf), f"{sf / sp:.2f}" if sp and sf else "-",
                 f"{_mib(first['unfused_bytes'])} / {_mib(first['fused_bytes'])}" if first else "-",
                 f"{first['loss'] - plain['results'][0]['loss']:.1e}" if first and plain["results"] else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + f"\n\ncommand: python benchmarks/fused_loss.py {' '.join(sys.argv[1:])}\n"


def main() -> None:
    """Run every (sequence, mode) job and write the table."""
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        mode, seq, steps, hidden, layers, out = sys.argv[2:8]
        worker(mode, int(seq), int(steps), int(hidden), int(layers), Path(out))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="512,1024,2048")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--limit", default="8GiB")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=HERE / "results" / "fused_loss.md")
    args = p.parse_args()
    rows = []
    for seq in (int(s) for s in args.seqs.split(",")):
        rows.append((seq, job("unfused", seq, args), job("fused", seq, args)))
    text = table(rows, args)
    args.out.write_text(text)
    print(text)
    print(f"load average: {os.getloadavg()}", file=sys.stderr)


if __name__ == "__main__":
    main()
