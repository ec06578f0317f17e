"""The plan against measurement on models it was not tuned on (docs/design.md "Capacity").

    python benchmarks/plan_truth.py [--families llama,gpt2,qwen2,t5,llama_gqa,llama_32k=2GiB,mixtral]
        [--memory 1.5GiB] [--world-size 2] [--optimizers adamw,adam,disk] [--steps 3] [--pp-size P]
        [--tp-size T] [--ep-size E] [--out table.md]

For each family (``benchmarks/families.py``: transformers models from their default configs, sizes shrunk,
called as users call them: ``model(input_ids=x, labels=x)`` with the default ``use_cache``), limit B and
optimizer, ``bmt-wrap plan --memory B --grow n_layers`` answers k in a fresh process (``--optimizer-state
disk`` for the disk optimizer). Then fresh jobs of ``--world-size`` ranks, each started with the allocator
setting the plan states, build the model at k and at k+1 with real weights, wrap it, and train ``--steps``
steps, the first step included, with the optimizer: ``adamw`` ``torch.optim.AdamW(fused=True)``, ``adam``
``bmt.optim.AdamOptimizer``, ``disk`` ``bmt.optim.AdamDiskOptimizer`` (the state in a file). A job is
killed as soon as its ranks' summed RSS passes B (a killed job at k runs again without the limit, for its per-rank peak).
The table gives the answered k, whether k and k+1 fit, the measured summed peak at each (each rank's
``ru_maxrss``; a killed job's is the watchdog's last sample), and the largest rank's peak against the plan's
per-rank count (the answer fits the count and the margin the plan keeps beside it for the count's known
error). ``--pp-size P`` asks ``plan --memory --pp-size P`` and trains the jobs under ``init_distributed(pipe_size=P)``
(the GPipe loop; a pipeline's stages take one batch). ``--tp-size T`` and ``--ep-size E`` ask ``plan --memory
--tp-size T --ep-size E`` and wrap with ``tp_size=T, ep_size=E`` (TP peers take one batch).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
GIB, MIB = 2**30, 2**20


#: The optimizers a row trains with: each one's name in the table and where ``bmt-wrap plan`` is told its state is.
OPTIMIZERS = {"adamw": ("torch AdamW", "memory"), "adam": ("AdamOptimizer", "memory"),
              "disk": ("AdamDiskOptimizer", "disk")}


def worker(family: str, layers: int, steps: int, optimizer: str, out: Path, pp: int = 1, tp: int = 1,
           ep: int = 1) -> None:
    """One rank: build, wrap and train the family's model at ``layers`` (over ``pp`` pipeline stages, with
    ``tp_size=tp`` and ``ep_size=ep``); write its peak RSS."""
    sys.path.insert(0, str(HERE))
    import torch
    from families import BATCH, FAMILIES, SEQ

    import bmt_wrap as bmt

    bmt.init_distributed(seed=0, pipe_size=pp)
    built = FAMILIES[family](layers)
    vocab = built.config.vocab_size
    model = bmt.BMTrainModelWrapper(built, **({"tp_size": tp} if tp > 1 else {}),
                                    **({"ep_size": ep} if ep > 1 else {}))
    del built
    if optimizer == "disk":
        opt = bmt.optim.AdamDiskOptimizer(model.parameters(), lr=1e-4, weight_decay=0.01,
                                          offload_dir=tempfile.gettempdir())
    elif optimizer == "adam":
        opt = bmt.optim.AdamOptimizer(model.parameters(), lr=1e-4, weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    gen = torch.Generator().manual_seed(bmt.data_parallel_rank())  # pipeline stages and TP peers take one batch
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    out.write_text(json.dumps({"rank": bmt.rank(), "losses": losses,
                               "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def predict(family: str, limit: int, world: int, optimizer: str, pp: int = 1, tp: int = 1, ep: int = 1) -> dict:
    """``bmt-wrap plan --memory`` in a fresh process, as a user runs it."""
    sys.path.insert(0, str(HERE))
    from families import BATCH, SEQ

    cmd = [sys.executable, "-c", "import sys; from bmt_wrap.cli import main; sys.exit(main())", "plan",
           f"{HERE / 'families.py'}:{family}", "--world-size", str(world), "--memory", str(limit),
           "--grow", "n_layers", "--input", f"input_ids=int64[{BATCH},{SEQ}]",
           "--input", f"labels=int64[{BATCH},{SEQ}]", "--json", "--optimizer-state", OPTIMIZERS[optimizer][1]]
    for flag, size in (("--pp-size", pp), ("--tp-size", tp), ("--ep-size", ep)):
        cmd += [flag, str(size)] if size > 1 else []
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"bmt-wrap plan failed for {family}: {out.stderr[-2000:]}")
    return json.loads(out.stdout)


def measure(family: str, layers: int, limit: int, world: int, steps: int, optimizer: str, setting: str,
            pp: int = 1, tp: int = 1, ep: int = 1) -> dict:
    """One job at ``layers`` under the limit; its summed and largest per-rank peak."""
    from capacity import run_ranks

    def argv(rank: int, out: Path) -> list[str]:
        return [sys.executable, __file__, "--worker", family, str(layers), str(steps), optimizer, str(out), str(pp),
                str(tp), str(ep)]

    var, _, value = setting.partition("=")
    r = run_ranks(argv, world, limit, timeout=1800, env={var: value})
    peaks = r["rank_peaks"]
    return {"ok": r["ok"], "why": r["why"], "peak_sum": sum(peaks) or r["sampled_peak_sum"],
            "peak_rank": max(peaks) if peaks else None}


def table(rows: list[dict], world: int, steps: int, setting: str, layout: str = "") -> list[str]:
    """One row per family, limit and optimizer; ``layout``: the parallel sizes beside ZeRO-3 (``tp2 x ep2``)."""
    head = ["model", "B (sum)", "optimizer", "answered k", "k fits", "peak sum at k", "k+1 fits",
            "peak sum at k+1", "peak/count at k (per rank)"]
    margin = {f"{r['margin_fraction']:.0%}" for r in rows}
    lines = [f"{world} ranks{f' ({layout})' if layout else ''}, batch {rows[0]['batch']} x {rows[0]['seq']} per rank, labels given, default "
             f"use_cache; {steps} steps from the first; {setting}; the answer keeps a margin of "
             f"{', '.join(sorted(margin))} of the count beside it; MiB", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        at, above = r["at_k"], r["at_k1"]
        ratio = f"{at['peak_rank'] / r['count_rank']:.3f}x" if at["peak_rank"] else "-"
        cells = [r["family"], f"{r['limit'] / GIB:.2f} GiB", OPTIMIZERS[r["optimizer"]][0], str(r["k"]),
                 "yes" if at["ok"] else "no", f"{at['peak_sum'] / MIB:.0f}", "yes" if above["ok"] else "no",
                 f"{above['peak_sum'] / MIB:.0f}", ratio]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    """Predict, measure at k and k+1, print and write the table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default="llama,gpt2,qwen2,t5,llama_gqa,llama_32k=2GiB,mixtral",
                   help="comma-separated; FAMILY=SIZE plans that family under SIZE instead of --memory")
    p.add_argument("--memory", default="1.5GiB", help="the limit B, summed over ranks (comma-separated list)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--optimizers", default="adamw,adam,disk", help=f"comma-separated, of {', '.join(OPTIMIZERS)}")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--pp-size", type=int, default=1, help="pipeline stages (init_distributed(pipe_size=P))")
    p.add_argument("--tp-size", type=int, default=1, help="tensor parallelism (tp_size=T)")
    p.add_argument("--ep-size", type=int, default=1, help="expert parallelism (ep_size=E)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "plan_truth.md")
    p.add_argument("--worker", nargs=8, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        family, layers, steps, optimizer, out, pp, tp, ep = args.worker
        worker(family, int(layers), int(steps), optimizer, Path(out), int(pp), int(tp), int(ep))
        return
    sys.path.insert(0, str(HERE))
    from capacity import parse_size
    from families import BATCH, SEQ
    from report import publish

    rows = []
    for memory in (parse_size(m) for m in args.memory.split(",")):
        for optimizer in args.optimizers.split(","):
            for family, _, own in (f.partition("=") for f in args.families.split(",")):
                limit = parse_size(own) if own else memory
                sizes = (args.pp_size, args.tp_size, args.ep_size)
                plan = predict(family, limit, args.world_size, optimizer, *sizes)
                k = plan["value"]
                print(f"{family} {optimizer} under {limit / GIB:.2f} GiB: the plan answers {k}: {json.dumps(plan)}",
                      file=sys.stderr, flush=True)
                at = [measure(family, n, limit, args.world_size, args.steps, optimizer, plan["assumes"], *sizes)
                      for n in (k, k + 1)]
                if at[0]["peak_rank"] is None:  # killed at the limit: its peak per rank, unlimited
                    at[0]["peak_rank"] = measure(family, k, 0, args.world_size, args.steps, optimizer,
                                                 plan["assumes"], *sizes)["peak_rank"]
                print(f"  measured: {at}", file=sys.stderr, flush=True)
                rows.append({"family": family, "limit": limit, "optimizer": optimizer, "k": k,
                             "count_rank": plan["counted_per_rank"], "margin_fraction": plan["margin_fraction"],
                             "at_k": at[0], "at_k1": at[1],
                             "batch": BATCH, "seq": SEQ, "setting": plan["assumes"]})
    layout = " x ".join(f"{name}{size}" for name, size in (("pp", args.pp_size), ("tp", args.tp_size),
                                                           ("ep", args.ep_size)) if size > 1)
    publish(table(rows, args.world_size, args.steps, rows[0]["setting"], layout), args.out)


if __name__ == "__main__":
    main()
