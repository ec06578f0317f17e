"""fused_loss=True against the unfused head: a Llama-shaped model with Llama-3's 128,256-word vocabulary.

    nice python benchmarks/fused_loss.py [--seqs 512,1024,2048] [--world-size 2] [--steps 4] [--rounds 2]
        [--limit 8GiB] [--kill-limit 10GiB] [--hidden 256] [--layers 2] [--out benchmarks/results/fused_loss.md]

Each (mode, sequence) is a fresh job of ``--world-size`` rank processes (gloo, ``OMP_NUM_THREADS=1``,
``MALLOC_MMAP_THRESHOLD_=65536``: freed tensors leave the process), under ``capacity.run_ranks``' watchdog,
which kills the job when its ranks' summed RSS passes ``--kill-limit``; a job fits when its summed peak
stays within ``--limit`` (the unfused job above the limit still runs, for its step time). Each rank builds
transformers' ``LlamaForCausalLM`` (untied head, default config but for the sizes), wraps it with or
without ``fused_loss=True``, and trains ``--steps`` steps (the first not timed) of one sequence per rank,
called as users call it (``model(input_ids=x, labels=x)``, default ``use_cache``), with
``torch.optim.AdamW(fused=True)``. A round is one unfused and one fused job back to back (the first of the
pair alternating between rounds), ``--rounds`` rounds per sequence, so a change in the machine's load
falls on both jobs of a round alike; each round gives the ratio of its fused to its unfused median step
time, and the table reports the median of those ratios beside every round's (the verdict on a machine
shared with other work), the step times' medians over every round's timed steps, the CPU seconds the
ranks spent per step (``time.process_time``: what the load changes least) and the machine's load average
before and after each job. Reported too: the ranks' summed peak RSS (``ru_maxrss``, the largest over
rounds), whether it fits, ``bmt-wrap plan --memory``'s peak per rank (run in a fresh process as a user
runs it) against the largest rank's measured peak, the logits' share of the measured peak per rank (the
vocabulary-wide tensors the pair holds at once: unfused, the plan's ``unfused_bytes``, logits and the
fp32 log-probabilities' and logits' gradients; fused, one chunk of fp32 logits), and the fused job's loss
against the unfused one's at the first step (same weights and data).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
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
    """One rank: build, wrap, train; write peak RSS, step times, the first loss and the pair's bytes."""
    import torch

    import bmt_wrap as bmt
    from bmt_wrap.base.fused_loss_plan import chunk_rows

    bmt.init_distributed(seed=0, backend="gloo")
    torch.manual_seed(0)
    model = bmt.BMTrainModelWrapper(llama(hidden, layers, seq), fused_loss=mode == "fused")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator().manual_seed(bmt.rank())
    times, cpu, losses = [], [], []
    for step in range(steps):
        ids = torch.randint(0, VOCAB, (1, seq), generator=g)
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step:
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        losses.append(float(loss))
    section = model.plan.fused_loss
    fused = bool(section and section.fused)
    logits = min(seq, chunk_rows(VOCAB)) * VOCAB * 4 if fused else (section.unfused_bytes if section else None)
    out.write_text(json.dumps({"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "times": times,
                               "cpu": cpu, "loss": losses[0], "fused": fused, "logits_bytes": logits}))


def job(mode: str, seq: int, args: argparse.Namespace) -> dict:
    """One fresh job; its ranks' results and whether it fitted the limit."""
    sys.path.insert(0, str(HERE))
    from capacity import parse_size, run_ranks

    def argv(rank: int, out: Path) -> list[str]:
        return [sys.executable, __file__, "--worker", mode, str(seq), str(args.steps), str(args.hidden),
                str(args.layers), str(out)]

    print(f"  {mode} seq {seq} ...", file=sys.stderr, flush=True)
    load = os.getloadavg()[0]
    r = run_ranks(argv, args.world_size, parse_size(args.kill_limit), args.timeout, ENV)
    r["fits"] = r["ok"] and sum(r["rank_peaks"]) <= parse_size(args.limit)
    r["load"] = (load, os.getloadavg()[0])
    return r


def plan_peak(mode: str, seq: int, args: argparse.Namespace) -> int | None:
    """``bmt-wrap plan --memory``'s peak per rank for the job, in a fresh process as a user runs it."""
    cmd = [sys.executable, "-c", "import sys; from bmt_wrap.cli import main; sys.exit(main())", "plan",
           f"{__file__}:llama", "--world-size", str(args.world_size), "--memory", args.limit,
           "--input", f"input_ids=int64[1,{seq}]", "--input", f"labels=int64[1,{seq}]", "--json",
           *(["--fused-loss"] if mode == "fused" else [])]
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **ENV))
    if out.returncode:
        print(f"  plan {mode} {seq} failed: {out.stderr[-500:]}", file=sys.stderr)
        return None
    return int(json.loads(out.stdout)["counted_per_rank"])  # the count, without the margin kept beside it


def _round_median(r: dict) -> float | None:
    """One job's median step time over its ranks' timed steps (None: it did not finish)."""
    return statistics.median(t for x in r["results"] for t in x["times"]) if r["ok"] else None


def merged(runs: list[dict]) -> dict:
    """One mode's rounds at one sequence: the largest peaks, every timed step, each round's median, the
    first round's results."""
    ok = [r for r in runs if r["ok"]]
    return {"ok": bool(ok), "fits": all(r["fits"] for r in runs) and bool(ok),
            "peak_sum": max((sum(r["rank_peaks"]) for r in ok), default=None),
            "peak_rank": max((max(r["rank_peaks"]) for r in ok), default=None),
            "times": [t for r in ok for x in r["results"] for t in x["times"]],
            "cpu": [t for r in ok for x in r["results"] for t in x["cpu"]],
            "rounds": [_round_median(r) for r in runs],
            "load": [v for r in runs for v in r["load"]],
            "first": ok[0]["results"][0] if ok else None}


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MIB:.0f}"


def _secs(t: float | None) -> str:
    return "-" if t is None else f"{t:.2f}"


def _median(r: dict, key: str = "times") -> float | None:
    return statistics.median(r[key]) if r[key] else None


def _round_ratios(plain: dict, fused: dict) -> list[float]:
    """Each round's fused median step time over its unfused one (rounds where both jobs finished)."""
    return [f / p for p, f in zip(plain["rounds"], fused["rounds"], strict=True) if p and f]


def _share(r: dict) -> float | None:
    first = r["first"]
    return first["logits_bytes"] / r["peak_rank"] if first and first["logits_bytes"] and r["peak_rank"] else None


def _vs_plan(r: dict, plan: int | None) -> str:
    if r["peak_rank"] is None or plan is None:
        return "-"
    return f"{_mib(plan)} / {_mib(r['peak_rank'])} ({r['peak_rank'] / plan - 1:+.1%})"


def table(rows: list[tuple[int, dict, dict, int | None, int | None]], args: argparse.Namespace) -> str:
    """The Markdown table and the command that made it."""
    loads = [v for _, plain, fused, *_ in rows for v in plain["load"] + fused["load"]]
    head = (f"{args.world_size} ranks, Llama {args.layers} x {args.hidden}, vocabulary {VOCAB:,}, untied head, fp32, "
            f"one sequence per rank, labels given, default use_cache; {args.rounds} rounds of {args.steps} steps "
            f"per mode and sequence, a round being an unfused and a fused job back to back (which first "
            f"alternating), the first step of each not timed; machine load average (1 min) before and after the "
            f"jobs {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} CPUs; "
            f"MALLOC_MMAP_THRESHOLD_={ENV['MALLOC_MMAP_THRESHOLD_']}; fits: summed peak within {args.limit} "
            f"(jobs killed above {args.kill_limit}); RSS in MiB; step times are medians over every timed step, "
            "the ratio is the median of the rounds' ratios (fused median step over unfused, per round)\n\n"
            "| seq | unfused peak (sum) | fused peak (sum) | fits: unfused / fused | unfused step s | fused step s "
            "| ratio per round | ratio (median) | CPU s per step: unfused / fused (ratio) "
            "| logits' share of the peak: unfused / fused (ratio) | plan / measured per rank: unfused "
            "| plan / measured per rank: fused | first loss, fused - unfused |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for seq, plain, fused, plan_plain, plan_fused in rows:
        sp, sf = _median(plain), _median(fused)
        cp, cf = _median(plain, "cpu"), _median(fused, "cpu")
        ratios = _round_ratios(plain, fused)
        hp, hf = _share(plain), _share(fused)
        loss = (f"{fused['first']['loss'] - plain['first']['loss']:.1e}" if fused["first"] and plain["first"]
                else "-")
        cells = [str(seq), _mib(plain["peak_sum"]), _mib(fused["peak_sum"]),
                 f"{'yes' if plain['fits'] else 'no'} / {'yes' if fused['fits'] else 'no'}",
                 _secs(sp), _secs(sf), ", ".join(f"{x:.2f}" for x in ratios) or "-",
                 f"{statistics.median(ratios):.2f}" if ratios else "-",
                 f"{_secs(cp)} / {_secs(cf)} ({cf / cp:.2f})" if cp and cf else "-",
                 f"{hp:.1%} / {hf:.1%} ({hf / hp:.3f})" if hp and hf else "-",
                 _vs_plan(plain, plan_plain), _vs_plan(fused, plan_fused), loss]
        lines.append("| " + " | ".join(cells) + " |")
    fit = {mode: max((seq for seq, *r in rows if r[i]["fits"]), default=None)
           for i, mode in enumerate(("unfused", "fused"))}
    tried = max(seq for seq, *_ in rows)
    largest = {m: "-" if v is None else f"{v}{'+' if v == tried else ''}" for m, v in fit.items()}
    gain = f" ({fit['fused'] / fit['unfused']:.0f}x or more)" if fit["unfused"] and fit["fused"] else ""
    return (head + "\n".join(lines) + f"\n\nlargest sequence tried that fits {args.limit} summed: unfused "
            f"{largest['unfused']}, fused {largest['fused']}{gain} ('+': the largest tried)\n\n"
            f"command: python benchmarks/fused_loss.py {' '.join(sys.argv[1:])}\n")


def main() -> None:
    """Run every (sequence, mode) job and write the table."""
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        mode, seq, steps, hidden, layers, out = sys.argv[2:8]
        worker(mode, int(seq), int(steps), int(hidden), int(layers), Path(out))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="512,1024,2048")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--limit", default="8GiB")
    p.add_argument("--kill-limit", default="10GiB")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--no-plan", action="store_true", help="skip bmt-wrap plan's column (skipped too at other "
                   "--hidden/--layers than 256/2, the sizes the plan reads)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "fused_loss.md")
    args = p.parse_args()
    start = time.monotonic()
    rows = []
    for seq in (int(s) for s in args.seqs.split(",")):
        runs: dict[str, list[dict]] = {"unfused": [], "fused": []}
        for i in range(args.rounds):
            for mode in ("unfused", "fused") if i % 2 == 0 else ("fused", "unfused"):
                runs[mode].append(job(mode, seq, args))
        # The plan reads llama() at its default sizes: other sizes would be compared with another model.
        skip_plan = args.no_plan or (args.hidden, args.layers) != (256, 2)
        plans = (None, None) if skip_plan else (plan_peak("unfused", seq, args), plan_peak("fused", seq, args))
        rows.append((seq, merged(runs["unfused"]), merged(runs["fused"]), *plans))
    text = table(rows, args)
    print(text, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"took {time.monotonic() - start:.0f} s; load average: {os.getloadavg()}", file=sys.stderr)


if __name__ == "__main__":
    main()
