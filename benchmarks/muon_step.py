"""torch's Muon step on a wrapped model's sharded matrices, three ways, in one run.

    torchrun --nproc_per_node=2 benchmarks/muon_step.py [--d-model 512] [--layers 4] [--rounds 5]

- **unsharded**: ``torch.optim.Muon`` on a plain copy of the model (every rank holds and orthogonalises
  every matrix, as under DDP);
- **sharded, fast path**: ``torch.optim.Muon`` on the wrapped model's parameters (``optim/muon.py``: only
  matrices that straddle ranks move, each orthogonalised by one owner);
- **gather everything**: each rank gathers every matrix's bf16 update (``full_tensor()``), orthogonalises
  all of them and keeps its range: what sharded Muon costs without an owner plan.

Each optimizer steps on the gradients of one backward (kept), so only the step is timed; the table has
medians (``block_medians``) and the bytes each route moves per step per rank.
"""

from __future__ import annotations

import argparse
import copy
import os
from pathlib import Path

import torch
from optim import block_medians
from report import publish
from toy_gpt import ToyGPT, ToyGPTConfig

import bmt_wrap as bmt
from bmt_wrap.base._compat import muon_adjusted_lr, muon_orthogonalize

OUT = Path(__file__).resolve().parent / "results" / "muon_step.md"


def gather_everything_step(opt: torch.optim.Muon) -> None:
    """Muon with every matrix gathered whole on every rank (same arithmetic, no owner plan)."""
    with torch.no_grad():
        for group in opt.param_groups:
            for p in group["params"]:
                state = opt.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = p.grad.lerp(buf, group["momentum"]).to(torch.bfloat16).full_tensor()
                ortho = muon_orthogonalize(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
                lo, hi = p.source_range()
                local = p.to_local()
                local.mul_(1 - group["lr"] * group["weight_decay"])
                local.add_(ortho.reshape(-1)[lo:hi], alpha=-muon_adjusted_lr(group["lr"], group["adjust_lr_fn"],
                                                                             p.shape))


def main() -> None:
    """Time the three routes and write the table on rank 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5, help="timed calls per block (median reported)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    state = bmt.init_distributed(seed=0)
    cfg = ToyGPTConfig(d_model=args.d_model, n_layers=args.layers, vocab=4096)
    torch.manual_seed(0)
    plain = ToyGPT(cfg)
    model = bmt.BMTrainModelWrapper(copy.deepcopy(plain))
    idx = torch.randint(0, cfg.vocab, (2, cfg.seq + 1), generator=torch.Generator().manual_seed(state.rank))
    for m in (plain, model):
        m(idx[:, :-1], idx[:, 1:]).backward()
    matrices = {name: [p for p in m.parameters() if p.ndim == 2 and p.requires_grad] for name, m in
                (("plain", plain), ("sharded", model))}
    opts = {"unsharded": torch.optim.Muon(matrices["plain"], lr=1e-3),
            "sharded, fast path": torch.optim.Muon(matrices["sharded"], lr=1e-3),
            "gather everything": torch.optim.Muon(copy.copy(matrices["sharded"]), lr=1e-3)}
    steps = {"unsharded": opts["unsharded"].step, "sharded, fast path": opts["sharded, fast path"].step,
             "gather everything": lambda: gather_everything_step(opts["gather everything"])}
    moved = {}
    for name, step in steps.items():
        bmt.reset_comm_stats()
        step()
        stats = bmt.comm_stats()
        moved[name] = sum(v["bytes"] for k, v in stats.items() if k != "materialize")
    times = block_medians(steps, args.rounds, "cpu")
    if state.rank != 0:
        return
    size = sum(p.numel() * p.element_size() for p in matrices["plain"])
    plan = bmt.optim.muon_plan(opts["sharded, fast path"])
    base = times["unsharded"]
    lines = [f"toy GPT d_model {cfg.d_model} x {cfg.n_layers} layers, {len(matrices['plain'])} matrices, "
             f"{size / 1e6:.1f} MB fp32 (S), {state.world_size} ranks (gloo), median of 2 x {args.rounds} steps, "
             f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}; owners' Newton-Schulz load "
             f"(GFLOP per rank): {', '.join(f'{x / 1e9:.2f}' for x in plan.load) if plan else '-'}", "",
             "| route | step ms | vs unsharded | bytes moved/rank/step | vs 4·S/W |", "|---|---:|---:|---:|---:|"]
    for name, t in times.items():
        lines.append(f"| {name} | {t * 1e3:.1f} | {t / base:.2f}x | {moved[name] / 1e6:.2f} MB | "
                     f"{moved[name] / (4 * size / state.world_size):.2f} |")
    publish(lines, args.out)


if __name__ == "__main__":
    main()
