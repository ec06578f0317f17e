"""Generation speed: a wrapped GPT-2 on N ranks vs the same model unsharded in one process, side by side.

    torchrun --nproc_per_node=2 benchmarks/generate.py [--tokens 64] [--repeats 5]

Each rank holds the plain model and the wrapped copy and alternates greedy ``generate`` calls of
``--tokens`` new tokens on both (same prompt), so machine noise hits them alike. Rows: the wrapped model
with parameters gathered once per call (the default when they fit) and per step
(``BMT_WRAP_GENERATE_GATHER=per-step``), each against unsharded. Prints and writes (``--out``) a Markdown
table of median tokens/s. Target on CPU: wrapped >= 0.5x unsharded.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from pathlib import Path

import torch
from report import publish

import bmt_wrap as bmt


def main() -> None:
    """Time greedy generation plain and wrapped (both gather policies) and report on rank 0."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "generate.md")
    args = parser.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel

    state = bmt.init_distributed(seed=0)
    vocab = 1024
    # GPT-2's default config, sizes shrunk, special tokens inside the shrunk vocabulary; EOS never
    # generated (min_new_tokens) so every call makes exactly --tokens tokens.
    cfg = GPT2Config(vocab_size=vocab, n_positions=args.tokens + 16, n_embd=args.d_model, n_layer=args.layers,
                     n_head=4, bos_token_id=vocab - 1, eos_token_id=vocab - 1)
    plain = GPT2LMHeadModel(cfg).eval()
    model = bmt.BMTrainModelWrapper(copy.deepcopy(plain)).eval()
    prompt = torch.randint(0, vocab - 1, (1, 8), generator=torch.Generator().manual_seed(0))
    settings = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False,
                    pad_token_id=vocab - 1)

    def timed(m: torch.nn.Module, policy: str | None = None) -> float:
        if policy is not None:
            os.environ["BMT_WRAP_GENERATE_GATHER"] = policy
        bmt.synchronize()
        start = time.perf_counter()
        out = m.generate(prompt, **settings)
        elapsed = time.perf_counter() - start
        assert out.shape[1] == prompt.shape[1] + args.tokens
        return args.tokens / elapsed

    model(prompt)  # capture and schedule outside the timings
    for m, p in ((plain, None), (model, "auto"), (model, "per-step")):
        timed(m, p)  # warm-up
    rates: dict[str, list[float]] = {"unsharded": [], "auto": [], "per-step": []}
    for _ in range(args.repeats):
        rates["unsharded"].append(timed(plain))
        rates["auto"].append(timed(model, "auto"))
        rates["per-step"].append(timed(model, "per-step"))
    os.environ.pop("BMT_WRAP_GENERATE_GATHER", None)
    if state.rank != 0:
        return
    base = statistics.median(rates["unsharded"])
    names = {"unsharded": "unsharded, one process", "auto": f"wrapped, {state.world_size} ranks, gathered once per call",
             "per-step": f"wrapped, {state.world_size} ranks, gathered per step"}
    params = sum(p.numel() for p in plain.parameters())
    lines = [f"GPT-2 default config shrunk to d_model {args.d_model} x {args.layers} layers ({params / 1e6:.1f}M "
             f"params), greedy, {args.tokens} new tokens after an 8-token prompt, {args.repeats} repeats "
             f"alternating; {state.world_size} ranks ({state.backend}), "
             f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}",
             "", "| model | tokens/s: median (min-max) | vs unsharded |", "|---|---|---|"]
    for key, label in names.items():
        r = rates[key]
        lines.append(f"| {label} | {statistics.median(r):.1f} ({min(r):.1f}-{max(r):.1f}) | "
                     f"{statistics.median(r) / base:.2f}x |")
    publish(lines, args.out)


if __name__ == "__main__":
    main()
