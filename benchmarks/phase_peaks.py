"""Where a wrapped training step peaks, phase by phase, beside the plan's count (docs/design.md "Capacity").

    python benchmarks/phase_peaks.py [--models gpt:13,llama:2] [--world-size 2] [--steps 3] [--out table.md]

Each model runs in a fresh ``torchrun`` job (one process per rank; a process that trained another model
would reuse its buffers). Each rank builds the model with real weights, wraps it, and trains ``--steps``
steps with ``torch.optim.AdamW(fused=True)`` (as capacity.py and streaming.py do) under
the allocator setting the plan's count is exact for (``bmt_wrap.base.host_allocator.EXACT_SETTING``). The kernel's peak RSS (VmHWM)
is reset at each phase boundary and read at the next: the forward; the blocks' backward (up to the
gradient of the first block's input, which also holds the gradients of root parameters used after the
blocks, such as the head); the root's backward to the end of ``backward()``; and the optimizer step. Each
is given above the rank's RSS before the model was built, the worst over ranks and over the steps after
the first, beside ``bmt-wrap plan --memory``'s training peak (the largest of its phases,
``passes.capacity.training_phases``), the phase it names, and the bytes of the tensors the process holds at a step's start (every plain tensor the garbage
collector sees, each storage once).

``gpt``: capacity.py's GPT (d_model 1024, vocab 8192, untied head, seq 128). ``llama``: transformers' Llama at
TinyLlama's width (streaming.py's, vocab 32000, seq 64), whose embedding and head make a large root group.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from streaming import proc_status

import bmt_wrap as bmt
from bmt_wrap.base.host_allocator import EXACT_SETTING, THRESHOLD_VAR
from bmt_wrap.passes import build_plan, capture, discover_blocks
from bmt_wrap.passes.capacity import training_phases
from bmt_wrap.passes.fused_loss import fused_loss_section, with_fused_loss

HERE = Path(__file__).resolve().parent
MIB = 2**20
PHASES = ("forward", "blocks' backward", "root backward", "optimizer step")


def factory(kind: str) -> tuple[Callable[[int], torch.nn.Module], int, int]:
    """The model's builder (by layer count), its vocabulary and its sequence length; importing it here
    keeps the model library's import out of what a measured step is compared with."""
    sys.path.insert(0, str(HERE))
    if kind == "gpt":
        from capacity import SEQ, VOCAB, capacity_model

        return capacity_model, VOCAB, SEQ
    from streaming import LLAMA_SEQ, LLAMA_VOCAB, llama_1b

    importlib.import_module("transformers.models.llama.modeling_llama")  # llama_1b imports it when called
    return llama_1b, LLAMA_VOCAB, LLAMA_SEQ


def loss_of(kind: str, model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The model's language-modelling loss on ``ids`` (predicting the same tokens: only memory matters)."""
    return model(ids, ids) if kind == "gpt" else model(input_ids=ids, labels=ids).loss


def _restart_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM restarts from the current RSS


def tensor_bytes() -> int:
    """Bytes of every CPU tensor storage the garbage collector sees, each once."""
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        # Plain tensors only: a wrapper subclass (a sharded parameter's logical view) owns no storage; the
        # tensors holding its bytes are plain ones the collector also sees.
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            if storage.nbytes():  # a storage resized to nothing (a released buffer) has no data pointer
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def plan_terms(kind: str, layers: int, world: int) -> dict[str, int]:
    """The plan's training peak per rank above the baseline, and the phase it counts that peak at."""
    make, _, seq = factory(kind)
    model = make(layers)
    ids = torch.zeros(1, seq, dtype=torch.long)
    inputs = ((ids, ids), {}) if kind == "gpt" else ((), {"input_ids": ids, "labels": ids})
    discovery = discover_blocks(model)
    captured = capture(model, discovery, inputs)
    # As `bmt-wrap plan --memory` plans (unfused): the head found is the root's first gradient in backward.
    section = fused_loss_section(model, captured, enabled=False)
    plan = build_plan(model, discovery, world_size=world, capture=with_fused_loss(captured, section))
    est = plan.estimates[str(world)]
    phases = training_phases(plan, est)
    binding = max(phases, key=phases.__getitem__)
    return {"training": phases[binding], "binding": binding,
            "params": sum(p.numel() for p in model.parameters())}


def measure(kind: str, layers: int, steps: int) -> dict:
    """This rank's phase peaks above its RSS before building, per step after the first."""
    make, vocab, seq = factory(kind)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = proc_status("VmRSS")
    torch.manual_seed(0)
    model = bmt.BMTrainModelWrapper(make(layers))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    peaks: dict[str, int] = {}

    def mark(phase: str) -> None:
        peaks[phase] = proc_status("VmHWM") - base
        _restart_peak()

    forward = {"on": False}  # the recompute in backward calls the block again: mark only the real forward

    def first_block_input(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else kwargs["hidden_states"]
        if forward["on"] and x.requires_grad:
            x.register_hook(lambda grad: mark(PHASES[1]))

    if not model.plan.blocks():
        raise SystemExit(f"{kind} x {layers}: the wrapper found no repeated blocks (give 2 layers or more)")
    first = model.get_submodule(model.plan.order[0] if model.plan.order else model.plan.blocks()[0].name)
    first.register_forward_pre_hook(first_block_input, with_kwargs=True)
    gen = torch.Generator().manual_seed(bmt.rank())
    rows = []
    for step in range(steps):
        ids = torch.randint(0, vocab, (1, seq), generator=gen)
        gc.collect()
        peaks.clear()
        start, held = proc_status("VmRSS") - base, tensor_bytes()
        _restart_peak()
        forward["on"] = True
        loss = loss_of(kind, model, ids)
        forward["on"] = False
        mark(PHASES[0])
        loss.backward()
        mark(PHASES[2])
        opt.step()
        opt.zero_grad(set_to_none=True)
        mark(PHASES[3])
        if PHASES[1] not in peaks:
            raise SystemExit(f"{kind} x {layers}: the first block's input never got its gradient, so the blocks' "
                             "backward could not be told from the root's")
        if step:  # the first step allocates the optimizer's state and the pools: not a steady step
            rows.append({"start": start, "tensors": held, **peaks})
    return {"rank": bmt.rank(), "steps": rows}


def table(results: list[tuple[str, int, dict, list[dict]]], world: int, steps: int) -> list[str]:
    """One row per model: each phase's worst peak over ranks and steps, beside the plan's count."""
    head = ["model", "params", "step start", *PHASES, "peak", "plan's training peak", "plan's peak phase",
            "peak vs plan", "tensors at step start"]
    lines = [f"{world} ranks, batch 1/rank, {steps} AdamW steps (fused) after wrapping a model built with real "
             f"weights, {EXACT_SETTING}, OMP_NUM_THREADS=1; MiB above each rank's RSS before building, the "
             "worst over ranks and over the steps after the first", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, layers, plan, ranks in results:
        rows = [row for rank in ranks for row in rank["steps"]]
        worst = {k: max(row[k] for row in rows) for k in ("start", "tensors", *PHASES)}
        peak = max(worst[p] for p in PHASES)
        cells = [f"{name} x {layers} layers", f"{plan['params'] / 1e6:.0f}M", *(
            f"{worst[k] / MIB:.0f}" for k in ("start", *PHASES)), f"{peak / MIB:.0f}",
            f"{plan['training'] / MIB:.0f}", plan["binding"], f"{peak / plan['training']:.3f}x",
            f"{worst['tensors'] / MIB:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def rank_job(model: str, steps: int, out_dir: Path) -> None:
    """One rank of a model's job: measure, and write this rank's result."""
    kind, layers = model.split(":")
    bmt.init_distributed(seed=0)
    result = measure(kind, int(layers), steps)
    (out_dir / f"rank{bmt.rank()}.json").write_text(json.dumps(result))


def run_model(kind: str, layers: int, world: int, steps: int) -> list[dict]:
    """A fresh torchrun job of ``world`` ranks for one model; every rank's result."""
    sys.path.insert(0, str(HERE))
    from harness import free_port

    with tempfile.TemporaryDirectory() as out_dir:
        env = {**os.environ, "OMP_NUM_THREADS": "1", THRESHOLD_VAR: EXACT_SETTING.split("=")[1]}
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
               f"--master_port={free_port()}", __file__, "--rank-job", f"{kind}:{layers}", "--steps", str(steps),
               "--out-dir", out_dir]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{kind} x {layers} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        return [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("rank*.json"))]


def main() -> None:
    """Each model in its own job, then the plan's terms; print and write the table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt:13,llama:2", help="kind:layers, comma-separated (kinds: gpt, llama)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", type=Path, default=HERE / "results" / "phase_peaks.md")
    p.add_argument("--rank-job", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out-dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_job:
        rank_job(args.rank_job, args.steps, args.out_dir)
        return
    models = [(kind, int(layers)) for kind, layers in (m.split(":") for m in args.models.split(","))]
    if any(kind not in ("gpt", "llama") for kind, _ in models) or args.steps < 2:
        p.error("--models takes gpt:N and llama:N; --steps at least 2 (the first is not measured)")
    results = [(kind, layers, plan_terms(kind, layers, args.world_size),
                run_model(kind, layers, args.world_size, args.steps)) for kind, layers in models]
    sys.path.insert(0, str(HERE))
    from report import publish

    publish(table(results, args.world_size, args.steps), args.out)


if __name__ == "__main__":
    main()
