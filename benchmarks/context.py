"""Context parallelism (#52) at 2 ranks: each rank's step peak at cp2 against cp1, the longest sequence that
trains under a memory limit, and the plan's answer for it.

    python benchmarks/context.py [--size full|smoke] [--memory 1.5GiB] [--seq 4096] [--step 512] [--max-seq 65536]

The model is a transformers Llama from its default config with sizes shrunk (``full``: width 512, 8 heads,
2 layers, vocabulary 1024; ``smoke``: width 64, for tests), called as users call it
(``model(input_ids=x, labels=x)``), trained by ``torch.optim.AdamW`` on 2 ranks: cp1 is
``BMTrainModelWrapper(model)`` (each rank its own sequence), cp2 ``BMTrainModelWrapper(model, cp_size=2)``
(both ranks split one sequence). Every job runs under the allocator setting the plan states
(``MALLOC_MMAP_THRESHOLD_``), so freed tensors leave the process.

- **Step peak at ``--seq`` tokens**: each rank's resident peak over its second step less its resident bytes
  just before it (``/proc/self/clear_refs`` resets the peak), the largest rank's: what a step adds to the
  model states (activations, recompute, gathered parameters, attention buffers). Goal: cp2 <= 0.6x cp1.
- **Longest sequence under ``--memory``** (summed over the 2 ranks, as ``plan --memory``): two-step jobs at
  multiples of ``--step`` tokens, doubling from ``--step`` then bisecting, each killed once the ranks'
  summed RSS passes the limit (``capacity.run_ranks``); capped at ``--max-seq``. Two steps, because AdamW makes
  its moments at the first step: only the second step's backward holds them, as every later one does (a
  one-step job at 5120 tokens peaked at 761 MiB a rank where its second step peaked at 790). Goal: cp2 >= 1.8x
  cp1.
- **The plan's answer**: ``bmt-wrap plan --memory B --grow-seq STEP [--cp-size 2]`` in a fresh process.
  Goal: within one ``--step`` of the measured answer.

Written to ``--out`` (default ``benchmarks/results/context_<size>.md``), which RESULTS.md quotes.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from torch import nn

HERE = Path(__file__).resolve().parent
MIB = 2**20
SIZES = {"full": dict(hidden_size=512, intermediate_size=1376, num_attention_heads=8, vocab_size=1024),
         "smoke": dict(hidden_size=64, intermediate_size=172, num_attention_heads=4, vocab_size=128)}


def _llama(size: str) -> nn.Module:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, **SIZES[size]))


def full() -> nn.Module:
    """The benchmark's Llama (``bmt-wrap plan benchmarks/context.py:full``)."""
    return _llama("full")


def smoke() -> nn.Module:
    """The smoke test's Llama."""
    return _llama("smoke")


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (VmRSS, VmHWM)."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M)[1]) * 1024  # type: ignore[index]


def worker(size: str, cp: int, seq: int, steps: int, out: Path) -> None:
    """One rank: wrap at ``cp`` (1: no CP), train ``steps`` steps at ``seq`` tokens; write its peaks."""
    import torch

    import bmt_wrap as bmt

    bmt.init_distributed(seed=0)
    model = bmt.BMTrainModelWrapper(_llama(size), **({"cp_size": cp} if cp > 1 else {}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    gen = torch.Generator().manual_seed(bmt.data_parallel_rank())  # CP peers take the same sequence
    before = step_peak = 0
    for i in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=gen)
        if i == steps - 1:
            Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
            before = _status("VmRSS")
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_peak = _status("VmHWM") - before
    out.write_text(json.dumps({"rank": bmt.rank(), "loss": float(loss.detach()), "step_peak": step_peak,
                               "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def job(size: str, cp: int, seq: int, steps: int, limit: int, setting: str) -> dict:
    """2 ranks of ``worker`` under ``limit`` (summed RSS; 0: none)."""
    from capacity import run_ranks

    def argv(rank: int, out: Path) -> list[str]:
        return [sys.executable, __file__, "--worker", size, str(cp), str(seq), str(steps), str(out)]

    var, _, value = setting.partition("=")
    return run_ranks(argv, 2, limit, timeout=3600, env={var: value})


def longest(fits: Callable[[int], bool], step: int, cap: int, known: dict[int, bool]) -> tuple[int, int]:
    """The longest multiple of ``step`` up to ``cap`` for which ``fits`` holds (doubling, then bisection; 0
    when ``step`` does not fit), and the number of jobs it took; ``known`` holds lengths already settled."""
    tried: dict[int, bool] = {seq // step: ok for seq, ok in known.items() if seq % step == 0}

    def ok(units: int) -> bool:
        if units not in tried:
            tried[units] = fits(units * step)
            print(f"  {units * step} tokens: {'fits' if tried[units] else 'does not fit'}", file=sys.stderr,
                  flush=True)
        return tried[units]

    top = cap // step
    if not ok(1):
        return 0, len(tried)
    lo = 1
    hi = 2
    while hi <= top and ok(hi):
        lo, hi = hi, 2 * hi
    hi = min(hi, top + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo * step, len(tried)


def plan_answer(size: str, cp: int, limit: int, step: int) -> dict:
    """``bmt-wrap plan --memory --grow-seq`` in a fresh process, as a user runs it."""
    cmd = [sys.executable, "-c", "import sys; from bmt_wrap.cli import main; sys.exit(main())", "plan",
           f"{__file__}:{size}", "--world-size", "2", "--memory", str(limit), "--grow-seq", str(step),
           "--input", f"input_ids=int64[1,{step}]", "--input", f"labels=int64[1,{step}]", "--json"]
    cmd += ["--cp-size", str(cp)] if cp > 1 else []
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"bmt-wrap plan failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout)


def main() -> None:
    """Measure both goals at cp1 and cp2, ask the plan, print and write the table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=list(SIZES), default="full")
    p.add_argument("--memory", default="1.5GiB",
                   help="the limit, summed over the 2 ranks (1.5GiB keeps each job to minutes on 2 cores)")
    p.add_argument("--seq", type=int, default=4096, help="tokens per sequence for the step peak")
    p.add_argument("--step", type=int, default=512, help="the search's and the plan's sequence step")
    p.add_argument("--max-seq", type=int, default=65536, help="the search's cap")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--worker", nargs=5, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        size, cp, seq, steps, out = args.worker
        worker(size, int(cp), int(seq), int(steps), Path(out))
        return
    sys.path.insert(0, str(HERE))
    from capacity import parse_size
    from report import publish

    limit = parse_size(args.memory)
    plans = {cp: plan_answer(args.size, cp, limit, args.step) for cp in (1, 2)}
    setting = plans[1]["assumes"]
    peaks, found = {}, {}
    for cp in (1, 2):
        print(f"cp{cp}: step peak at {args.seq} tokens ...", file=sys.stderr, flush=True)
        r = job(args.size, cp, args.seq, 2, 0, setting)
        if not r["ok"]:
            raise RuntimeError(f"cp{cp} at {args.seq} tokens failed: {r['why']}")
        peaks[cp] = max(x["step_peak"] for x in r["results"])
        # Two steps whose ranks' summed RSS stayed within the limit are what a probe runs: that length fits
        # without another job (the smoke test's whole search).
        within = max(r["sampled_peak_sum"], sum(r["rank_peaks"])) <= limit
        print(f"cp{cp}: longest sequence under {args.memory} ...", file=sys.stderr, flush=True)
        found[cp] = longest(lambda s, cp=cp: job(args.size, cp, s, 2, limit, setting)["ok"], args.step, args.max_seq,
                            {args.seq: True} if within else {})
    capped = {cp: " (the cap)" if found[cp][0] + args.step > args.max_seq else "" for cp in (1, 2)}
    lines = [f"transformers Llama ({args.size}: {SIZES[args.size]}, 2 layers), 2 ranks on CPU (gloo), batch 1, "
             f"labels given, torch AdamW, {setting}; cp1: each rank its own sequence, cp2: the ranks split one "
             f"(Ulysses); limit {args.memory} summed over the ranks, search step {args.step} tokens, jobs of 2 steps", "",
             "| | cp1 | cp2 | cp2 / cp1 | goal |", "|---|---|---|---|---|",
             f"| step peak per rank at {args.seq} tokens | {peaks[1] / MIB:.0f} MiB | {peaks[2] / MIB:.0f} MiB | "
             f"{peaks[2] / peaks[1]:.2f}x | <= 0.6x |",
             f"| longest sequence that trains (measured; jobs) | {found[1][0]}{capped[1]} ({found[1][1]}) | "
             f"{found[2][0]}{capped[2]} ({found[2][1]}) | {found[2][0] / max(found[1][0], 1):.2f}x | >= 1.8x |",
             f"| the plan's answer (plan --memory --grow-seq {args.step}) | {plans[1]['value']} | "
             f"{plans[2]['value']} | {plans[2]['value'] / max(plans[1]['value'], 1):.2f}x | within one step |",
             f"| plan - measured, in steps | {(plans[1]['value'] - found[1][0]) // args.step:+d} | "
             f"{(plans[2]['value'] - found[2][0]) // args.step:+d} | | -1 .. +1 |"]
    publish(lines, args.out or HERE / "results" / f"context_{args.size}.md")


if __name__ == "__main__":
    main()
