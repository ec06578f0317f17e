"""The largest model each system trains under a memory limit: a GPT (d_model 1024, seq 128) grown by layers.

    nice python benchmarks/capacity.py [--budgets 4GiB,8GiB] [--world-size 2]
        [--systems ddp,fsdp2,fsdp2_offload,deepspeed_zero3,bmt_wrapper,bmt_wrapper_budget,bmt_wrapper_mmap,
                   bmt_wrapper_disk,bmt_wrapper_offload]
        [--steps 3] [--starts SYSTEM=LAYERS,...] [--ceiling SYSTEM=LAYERS,...]
    nice python benchmarks/capacity.py --step-time 13 [--rounds 2] [--out table.md]
        [--out table.md]    # deepspeed_zero3 runs where `import deepspeed` works (DS_ACCELERATOR=cpu)

For each limit B (bytes summed over the job's ranks) and system, the search starts from a prediction (for
bmt_wrap, ``bmt-wrap plan --memory B``'s answer; for the others, two probes at 1 and 3 layers give their
bytes per layer, extrapolated to B), steps up or down a layer at a time while the answer holds, and
reports the largest layer count that
completed ``--steps`` AdamW steps. A job is killed as soon as the summed RSS of its ranks (sampled every
20 ms) exceeds B, and a job that finished counts only if the sum of its ranks' peak RSS (``ru_maxrss``,
exact) is within B too. Each probe is a fresh set of rank processes (gloo, ``OMP_NUM_THREADS=1``).
bmt_wrapper's largest run is compared with one process training the same model on the same data
(the other systems' losses at their own sizes are in the JSON; one process per size would double the run).
``bmt_wrapper_budget`` is the wrapper with ``memory_budget=`` the rank's share of B less what the plan
counts beside the tensors (its baseline and the bytes beside each layer's) and a 64 MiB allocator margin:
memory_budget's count already holds the root group's backward. ``bmt_wrapper_mmap`` is the wrapper in
processes started with the plan's allocator setting, ``MALLOC_MMAP_THRESHOLD_=65536`` (freed tensors leave
the process: the plan's assumption, docs/design.md "Capacity"); ``bmt_wrapper_budget`` runs so too, since it spends the plan's count
up to the limit. ``bmt_wrapper_disk`` is that, trained by
``bmt.optim.AdamDiskOptimizer`` (Adam's moments in a file per rank under ``$BMT_OPTIMIZER_DIR`` or the temp
dir, which must be a disk, not tmpfs), predicted by ``bmt-wrap plan --memory B --optimizer-state disk``; its
row gives the bytes each rank read and wrote per step, measured and planned. ``bmt_wrapper_offload`` is
that with ``offload="disk"`` as well (each rank's parameter and gradient shards in a file under
``$BMT_OFFLOAD_DIR`` or the temp dir, docs/offload.md), the model built on the meta device and initialised
after wrapping (``bmt.init_parameters``: a full copy built first would be the limit), predicted by ``bmt-wrap
plan ... --optimizer-state disk --offload disk --streaming``. ``--ceiling SYSTEM=N`` stops a search that
still passes at N layers (the row then says "≥ N"): offload's largest size is bounded by the disk and the
step time, not by memory. Every other system runs with glibc's defaults. The machine's load during the run
is written under the table.

``--step-time L`` instead trains the L-layer GPT without a limit under bmt_wrapper_mmap (everything in
memory), bmt_wrapper_disk and bmt_wrapper_offload in turn, and writes their median step times side by side,
with how long each offload rank's background reads of shards took and how long gathers waited for them
(the part of the reads the compute did not hide).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bmt_wrap.base.host_allocator import EXACT_SETTING

HERE = Path(__file__).resolve().parent
D_MODEL, SEQ, VOCAB = 1024, 128, 8192
DEFAULT_SYSTEMS = ["ddp", "fsdp2", "fsdp2_offload", "deepspeed_zero3", "bmt_wrapper", "bmt_wrapper_budget",
                   "bmt_wrapper_mmap", "bmt_wrapper_disk", "bmt_wrapper_offload"]
OFFLOAD = "bmt_wrapper_offload"
# Systems whose processes get the plan's allocator setting (bmt_wrap.base.host_allocator: glibc maps every
# allocation of 64 KiB or more and unmaps it when freed), so the process holds what its tensors hold
# (docs/design.md "Capacity"). Under 1 MiB, the offloaded GPT's heap kept ~1 MiB of freed blocks per layer
# (16.6 MiB more free heap at 24 layers than at 8; 0.5 MiB under 64 KiB).
MMAP_ENV = dict([EXACT_SETTING.split("=")])
# bmt_wrapper_budget too: it spends the plan's count of bytes up to the limit, so it needs the setting the
# count is exact for (under glibc's default heap it went over B from 9 layers up at 4 GiB).
MMAP_SYSTEMS = ("bmt_wrapper_budget", "bmt_wrapper_mmap", "bmt_wrapper_disk", OFFLOAD)
#: Systems the plan predicts, and the ``bmt-wrap plan`` options that describe them.
PREDICTED = {"bmt_wrapper": [], "bmt_wrapper_mmap": [], "bmt_wrapper_disk": ["--optimizer-state", "disk"],
             OFFLOAD: ["--optimizer-state", "disk", "--offload", "disk", "--streaming"]}
GIB = 2**30
# What a rank holds beside the tensors memory_budget counts, as `bmt-wrap plan` measured it (main sets
# these for the budget system's ranks): the baseline, and the bytes beside each layer's tensors.
HELD_VAR, PER_LAYER_VAR = "BMT_CAPACITY_BASELINE", "BMT_CAPACITY_BESIDE_PER_LAYER"


def parse_size(text: str) -> int:
    """``4GiB`` -> bytes."""
    units = {"GiB": GIB, "MiB": 2**20, "GB": 10**9, "MB": 10**6}
    for unit, scale in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * scale)
    return int(text)


# ---- one rank of one probe ----------------------------------------------------------------------------
def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def worker(system: str, layers: int, steps: int, limit: int, global_batch: int, out: Path) -> None:
    """Train ``steps`` AdamW steps of the ``layers``-layer GPT under ``system`` (``global_batch`` sequences
    over the ranks: one each); write this rank's result."""
    sys.path.insert(0, str(HERE))
    import torch  # noqa: F401 - the baseline includes it
    from systems import OPTIMIZERS, SYSTEMS, adam_on_disk
    from toy_gpt import ToyGPT, ToyGPTConfig
    from worker import run
    from workloads import WORKLOADS, Workload, _toy_loss

    import bmt_wrap as bmt

    baseline = _rss()
    name = f"capacity-{layers}"

    def build(seq: int) -> torch.nn.Module:
        torch.manual_seed(0)
        if system == OFFLOAD:  # initialised after wrapping, straight into the shards' files
            with torch.device("meta"):
                return ToyGPT(ToyGPTConfig(vocab=VOCAB, d_model=D_MODEL, n_layers=layers, seq=seq))
        return ToyGPT(ToyGPTConfig(vocab=VOCAB, d_model=D_MODEL, n_layers=layers, seq=seq))

    def offloaded(model: torch.nn.Module, wl: Workload, example: tuple) -> torch.nn.Module:
        where = os.environ.get("BMT_OFFLOAD_DIR", tempfile.gettempdir())
        model = bmt.BMTrainModelWrapper(model, offload="disk", offload_dir=where)
        bmt.init_parameters(model)
        return model

    WORKLOADS[name] = Workload(name, f"GPT {layers} x {D_MODEL}", build, "blocks", VOCAB, _toy_loss,
                               call=lambda idx, tgt: ((idx, tgt), {}))
    n = int(os.environ.get("WORLD_SIZE", "1"))
    if system == "deepspeed_zero3":
        result = _deepspeed(build, WORKLOADS[name], steps, n)  # global batch n: one sequence per rank
        result["baseline"] = baseline
        out.write_text(json.dumps(result))
        return

    def budget(model: torch.nn.Module, wl: Workload, example: tuple) -> torch.nn.Module:
        # The rank's share of B less what the process holds beside the tensors memory_budget counts (the
        # plan's baseline and the bytes beside each layer's tensors, from main's `bmt-wrap plan`) and an
        # allocator margin of 64 MiB. memory_budget's count is training's peak by phase, the root's
        # backward included (passes.capacity.training_peak).
        held = int(os.environ[HELD_VAR]) + int(os.environ[PER_LAYER_VAR]) * (layers - 1)
        return bmt.BMTrainModelWrapper(model, memory_budget=limit // n - held - 64 * 2**20)

    SYSTEMS["bmt_wrapper_budget"] = budget
    SYSTEMS["bmt_wrapper_mmap"] = SYSTEMS["bmt_wrapper"]  # the same wrapper; its processes' allocator differs
    SYSTEMS[OFFLOAD], OPTIMIZERS[OFFLOAD] = offloaded, adam_on_disk
    result = run(system, name, steps, 0, SEQ, global_batch)
    result["baseline"] = baseline
    out.write_text(json.dumps(result))


def _deepspeed(build, wl, steps: int, n: int) -> dict:
    """DeepSpeed ZeRO-3 (its AdamW, lr and weight decay as the other systems') on gloo: the same model,
    batches and timing between barriers as ``worker.run``."""
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    model = build(SEQ)
    params = sum(p.numel() for p in model.parameters())
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    times, losses = [], []
    for idx, tgt in wl.batches(steps, n, SEQ):
        dist.barrier()
        t0 = time.perf_counter()
        loss = wl.loss(engine, idx[rank:rank + 1], tgt[rank:rank + 1])
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        total = loss.detach().reshape(1).clone()
        dist.all_reduce(total)
        losses.append(float(total) / n)
    dist.barrier()
    return {"system": "deepspeed_zero3", "rank": rank, "world_size": n, "params": params, "times": times,
            "losses": losses, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


# ---- the launcher: one probe under a watchdog -----------------------------------------------------------
def _proc_rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_ranks(argv: Callable[[int, Path], list[str]], world: int, limit: int, timeout: float,
              env: dict[str, str]) -> dict:
    """Start ``world`` rank processes (``argv(rank, result_file)``) under a watchdog that kills them all as
    soon as their summed RSS passes ``limit`` (0: none) or ``timeout`` passes; ``ok`` when every rank
    finished and their summed peak RSS (each rank's ``"rss"``) stayed within ``limit``."""
    sys.path.insert(0, str(HERE))
    from harness import free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for rank in range(world):
            rank_env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", **env)
            procs.append(subprocess.Popen(argv(rank, Path(tmp) / f"{rank}.json"), env=rank_env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        peak_sum, killed, start = 0, False, time.monotonic()
        while any(p.poll() is None for p in procs):
            total = sum(_proc_rss(p.pid) for p in procs)
            peak_sum = max(peak_sum, total)
            if (limit and total > limit) or time.monotonic() - start > timeout:
                killed = True
                for p in procs:
                    p.kill()
                break
            time.sleep(0.02)
        errors = [p.communicate()[1] for p in procs]
        results = [json.loads(f.read_text()) for f in sorted(Path(tmp).glob("*.json"))]
    finished = not killed and all(p.returncode == 0 for p in procs) and len(results) == world
    rank_peaks = [r["rss"] for r in results]
    ok = finished and (not limit or sum(rank_peaks) <= limit)
    why = "" if ok else ("summed RSS over the limit" if killed or finished else (errors[0] or "")[-300:])
    return {"ok": ok, "why": why, "sampled_peak_sum": peak_sum, "rank_peaks": rank_peaks, "results": results}


def probe(system: str, layers: int, limit: int, world: int, steps: int, timeout: float) -> dict:
    """Run one job; ``ok`` when every rank finished and its ranks' summed peak RSS stayed within ``limit``."""
    env = {"DS_ACCELERATOR": "cpu", **(MMAP_ENV if system in MMAP_SYSTEMS else {})}

    def argv(rank: int, out: Path) -> list[str]:
        return [sys.executable, __file__, "--worker", system, str(layers), str(steps), str(limit), str(world),
                str(out)]

    result = run_ranks(argv, 1 if system == "single" else world, limit, timeout, env)
    return {"system": system, "layers": layers, **result}


def search(system: str, limit: int, start: int | None, args: argparse.Namespace,
           log: list[dict], ceiling: int | None = None) -> dict | None:
    """The largest layer count that passes, stepping a layer at a time from ``start`` (up while it passes,
    down while it fails, never above ``ceiling``); None if even one layer fails. Without a ``start``
    (systems the plan does not predict), two small probes give the system's bytes per layer and the start is
    their extrapolation."""
    def run(layers: int) -> dict:
        print(f"  {system} {layers} layers under {limit / GIB:.1f} GiB ...", file=sys.stderr, flush=True)
        r = probe(system, layers, limit, args.world_size, args.steps, args.timeout)
        r["limit"] = limit
        peak = sum(r["rank_peaks"]) or r["sampled_peak_sum"]
        verdict = "ok" if r["ok"] else "no: " + r["why"][:120]
        print(f"    {verdict} (peak sum {peak / GIB:.2f} GiB)", file=sys.stderr, flush=True)
        log.append(r)
        return r

    tried: dict[int, dict] = {}
    if start is None:
        small = [tried.setdefault(k, run(k)) for k in (1, 3)]
        if not small[0]["ok"]:
            return None
        if not small[1]["ok"]:
            return tried[2] if tried.setdefault(2, run(2))["ok"] else small[0]
        a, b = (sum(r["rank_peaks"]) for r in small)
        start = 3 + int((limit - b) // max((b - a) / 2, 1))
    layers = max(start, 1)
    r = tried.get(layers) or run(layers)
    best = r if r["ok"] else None
    step = 1 if r["ok"] else -1
    while True:
        layers += step
        if layers < 1 or (ceiling is not None and step > 0 and layers > ceiling):
            return best
        r = tried.get(layers) or run(layers)
        if r["ok"] and step > 0:
            best = r
        elif r["ok"]:
            return r
        elif step > 0:
            return best


def predict(limit: int, world: int, options: list[str]) -> dict:
    """``bmt-wrap plan --memory`` (with ``options``) on this model: the largest layer count and its per-rank
    peak."""
    # ``bmt-wrap plan`` in a fresh process: its baseline is what a rank holds before building the model.
    out = subprocess.run([sys.executable, "-c", "import sys; from bmt_wrap.cli import main; sys.exit(main())",
                          "plan", f"{__file__}:capacity_model",
                          "--world-size", str(world), "--memory", str(limit), "--grow", "n_layers",
                          "--input", f"int64[1,{SEQ}]", "--input", f"int64[1,{SEQ}]", "--json", *options],
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"bmt-wrap plan failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout)


def deepspeed_missing() -> str | None:
    """Why DeepSpeed cannot run here (not importable with ``DS_ACCELERATOR=cpu``), or None."""
    out = subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True, text=True,
                         env=dict(os.environ, DS_ACCELERATOR="cpu"))
    return None if out.returncode == 0 else out.stderr.strip().splitlines()[-1][:160]


def capacity_model(n_layers: int = 8) -> object:
    """The benchmark's GPT at ``n_layers`` (the CLI calls it under the meta device)."""
    sys.path.insert(0, str(HERE))
    from toy_gpt import ToyGPT, ToyGPTConfig

    return ToyGPT(ToyGPTConfig(vocab=VOCAB, d_model=D_MODEL, n_layers=n_layers, seq=SEQ))


def _load() -> str:
    with open("/proc/loadavg") as f:
        one, five, fifteen = f.read().split()[:3]
    return f"load average {one} / {five} / {fifteen} (1/5/15 min) on {os.cpu_count()} cores"


def table(rows: list[dict], args: argparse.Namespace, loads: list[str]) -> list[str]:
    """The Markdown table and the lines around it."""
    head = ["limit B (sum over ranks)", "system", "largest layers", "params", "vs DDP", "peak RSS/rank",
            "peak RSS sum", "plan predicts", "peak vs plan", "step s (median)", "final loss",
            "Δloss vs 1 process", "disk read+written/step/rank (plan)", "vs state on disk", "probes"]
    lines = [f"GPT d_model {D_MODEL}, vocab {VOCAB}, untied head, seq {SEQ}, batch 1/rank, "
             f"{args.world_size} ranks, {args.steps} AdamW steps per probe, OMP_NUM_THREADS=1, "
             f"host allocator: {allocator_setting()}", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(k, "-")) for k in (
            "limit", "system", "layers", "params", "vs_ddp", "peak_rank", "peak_sum", "predicted", "vs_plan",
            "step_s",
            "loss", "dloss", "disk_io", "vs_disk", "probes")) + " |")
    lines += ["", "machine load while it ran: " + "; ".join(loads)]
    return lines


def allocator_setting() -> str:
    """The host allocator's settings the probes ran with, in words."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return f"MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']} for every system"
    return (f"glibc's defaults, except {' and '.join(MMAP_SYSTEMS)}: "
            + ", ".join(f"{k}={v}" for k, v in MMAP_ENV.items()))


def _fmt_gib(b: float) -> str:
    return f"{b / GIB:.2f} GiB"


def step_times(args: argparse.Namespace) -> list[str]:
    """``--step-time``: the same GPT trained in memory, with Adam's state on disk, and offloaded, side by side:
    ``--rounds`` rounds, the three systems in turn within each, so a change in the machine's load meets all
    three alike."""
    layers, systems = args.step_time, ("bmt_wrapper_mmap", "bmt_wrapper_disk", OFFLOAD)
    times: dict[str, list[float]] = {s: [] for s in systems}
    peaks: dict[str, int] = {s: 0 for s in systems}
    reads: dict[str, list[dict]] = {s: [] for s in systems}
    failed: dict[str, str] = {}
    for round_ in range(args.rounds):
        for system in systems:
            print(f"  round {round_ + 1}: {system} {layers} layers, no limit ...", file=sys.stderr, flush=True)
            r = probe(system, layers, 0, args.world_size, args.steps, args.timeout)
            if not r["ok"]:
                failed[system] = r["why"][:100]
                continue
            res = r["results"]
            times[system] += [max(step) for step in zip(*(x["times"] for x in res), strict=True)]
            peaks[system] = max(peaks[system], *r["rank_peaks"])
            # per step, the slowest rank's
            reads[system] += [max((x["offload_reads"] for x in res if x.get("offload_reads")),
                                  key=lambda x: x["read_s"], default=None) or {}]
    median = {s: statistics.median(t) for s, t in times.items() if t}
    rows = []
    for system in systems:
        if system not in median:
            rows.append(f"| {system} | {layers} | failed: {failed.get(system, '?')} | - | - | - | - | - | - |")
            continue
        done = [x for x in reads[system] if x]
        steps = args.steps * len(done)
        read_s = sum(x["read_s"] for x in done) / steps if done else None
        waited_s = sum(x["waited_s"] for x in done) / steps if done else None
        hidden = f"{1 - waited_s / read_s:.0%}" if done and read_s else "-"
        ratio = {b: f"{median[system] / median[b]:.2f}x" if b in median else "-"
                 for b in ("bmt_wrapper_mmap", "bmt_wrapper_disk")}
        rows.append(f"| {system} | {layers} | {median[system]:.2f} | {ratio['bmt_wrapper_mmap']} | "
                    f"{ratio['bmt_wrapper_disk']} | {_fmt_gib(peaks[system])} | "
                    f"{f'{read_s:.3f}' if read_s is not None else '-'} | "
                    f"{f'{waited_s:.3f}' if waited_s is not None else '-'} | {hidden} |")
    return [f"GPT d_model {D_MODEL}, vocab {VOCAB}, seq {SEQ}, batch 1/rank, {args.world_size} ranks, "
            f"{args.rounds} rounds x {args.steps} AdamW steps (the three systems in turn within a round), no "
            f"memory limit, OMP_NUM_THREADS=1, {', '.join(f'{k}={v}' for k, v in MMAP_ENV.items())}; "
            "bmt_wrapper_mmap trains with torch.optim.AdamW(fused=True), the other two with "
            "AdamDiskOptimizer; offload files under the temp dir (a disk, its pages in the page cache: "
            "memory was plentiful); step time: median over every step of the slowest rank; shard reads: "
            "seconds per step the background thread spent reading the next block's shards "
            "(MADV_POPULATE_READ), and seconds gathers waited for them",
            "", "| system | layers | step s (median) | vs in memory | vs state on disk | peak RSS/rank | "
                "shard reads s/step | gathers waited s/step | reads hidden by compute |",
            "|---|---|---|---|---|---|---|---|---|", *rows, "", "machine load while it ran: " + _load()]


def main() -> None:
    """Search every (limit, system); compare each largest run with one process; print and write the table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budgets", default="4GiB,8GiB")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--no-reference", action="store_true", help="skip the one-process loss comparison")
    p.add_argument("--starts", default="", metavar="SYSTEM=LAYERS,...",
                   help="where to start searching for systems the plan does not predict (e.g. from an "
                        "earlier "
                        "run's bytes per layer), instead of two small probes")
    p.add_argument("--ceiling", default="", metavar="SYSTEM=LAYERS,...",
                   help="stop searching upward at this many layers (the row says >= LAYERS)")
    p.add_argument("--step-time", type=int, default=None, metavar="LAYERS",
                   help="instead of searching: step times of the in-memory, state-on-disk and offloaded "
                        "wrapper at LAYERS layers, side by side, without a limit")
    p.add_argument("--rounds", type=int, default=2, help="with --step-time: rounds of the three systems")
    p.add_argument("--out", type=Path, default=HERE / "results" / "capacity.md")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    sys.path.insert(0, str(HERE))
    from report import command_line, publish

    if args.step_time is not None:
        publish(step_times(args), args.out, command_line(None))
        return
    loads, rows, log = [_load()], [], []
    starts = {k: int(v) for k, v in (item.split("=") for item in args.starts.split(",") if item)}
    ceilings = {k: int(v) for k, v in (item.split("=") for item in args.ceiling.split(",") if item)}
    reference: dict[int, dict] = {}
    for text in args.budgets.split(","):
        limit = parse_size(text)
        systems = args.systems.split(",")
        predictions = {s: predict(limit, args.world_size, options) for s, options in PREDICTED.items()
                       if s in systems or s == "bmt_wrapper"}  # bmt_wrapper's also starts bmt_wrapper_budget
        ddp_layers = None
        os.environ[HELD_VAR] = str(predictions["bmt_wrapper"]["baseline"])
        os.environ[PER_LAYER_VAR] = str(predictions["bmt_wrapper"]["beside_per_layer"])
        for system in systems:
            if system == "deepspeed_zero3" and (missing := deepspeed_missing()):
                rows.append({"limit": text, "system": system, "layers": f"not run: {missing}"})
                continue
            prediction = predictions.get(system, predictions["bmt_wrapper"])
            start = starts.get(system, prediction["layers"] if system.startswith("bmt") else None)
            best = search(system, limit, start, args, log, ceilings.get(system))
            probes = sum(1 for r in log if r["system"] == system and r["limit"] == limit)
            row = {"limit": text, "system": system, "probes": probes}
            if best is None:
                rows.append({**row, "layers": 0})
                continue
            res = best["results"]
            times = [max(step) for step in zip(*(x["times"] for x in res), strict=True)]
            capped = system in ceilings and best["layers"] == ceilings[system]
            row.update(layers=f"≥ {best['layers']} (stopped there)" if capped else best["layers"], params=f"{res[0]['params'] / 1e6:.0f}M",
                       peak_rank=_fmt_gib(max(best["rank_peaks"])),
                       peak_sum=_fmt_gib(sum(best["rank_peaks"])),
                       step_s=f"{statistics.median(times):.2f}", loss=f"{res[0]['losses'][-1]:.4f}",
                       predicted=(f"{prediction['layers']} layers, "
                                  f"{_fmt_gib(prediction['peak_per_rank'])}/rank"
                                  if system in PREDICTED else "-"))
            at_prediction = [r for r in log if r["system"] == system and r["limit"] == limit and r["ok"]
                             and r["layers"] == prediction["layers"]]
            if system in PREDICTED and at_prediction:  # measured at the predicted size
                row["vs_plan"] = f"{max(at_prediction[0]['rank_peaks']) / prediction['counted_per_rank']:.3f}x"
            if res[0].get("disk_io"):
                io = max(r["disk_io"]["read"] + r["disk_io"]["written"] for r in res)
                at_plan = best["layers"] == prediction["layers"]
                planned = 2 * prediction["disk_read_per_step"] if at_plan else None
                row["disk_io"] = _fmt_gib(io) + (f" ({_fmt_gib(planned)})" if planned else "")
                if res[0].get("offload_reads"):  # the shards' traffic is mapped pages: only its reads are timed
                    read = max(r["offload_reads"]["bytes_read"] for r in res) / len(res[0]["losses"])
                    row["disk_io"] += f" + shards read {_fmt_gib(read)}"
            if system == "ddp":
                ddp_layers = best["layers"]
            if system == OFFLOAD:  # the ratio to the state-on-disk row of this limit, if it ran
                disk = next((x for x in rows if x["limit"] == text and x["system"] == "bmt_wrapper_disk"), None)
                if disk and isinstance(disk.get("layers"), int) and disk["layers"]:
                    row["vs_disk"] = f"{best['layers'] / disk['layers']:.2f}x"
            row["vs_ddp"] = f"{best['layers'] / ddp_layers:.2f}x" if ddp_layers else "-"
            if not args.no_reference and system == "bmt_wrapper":  # one process is slow: bmt_wrap's size only
                if best["layers"] not in reference:
                    print(f"  one process, {best['layers']} layers ...", file=sys.stderr, flush=True)
                    reference[best["layers"]] = probe("single", best["layers"], 0, args.world_size,
                                                      args.steps, args.timeout)
                ref = reference[best["layers"]]
                if ref["ok"]:
                    pairs = zip(res[0]["losses"], ref["results"][0]["losses"], strict=True)
                    row["dloss"] = f"{max(abs(a - b) for a, b in pairs):.1e}"
            rows.append(row)
            publish(table(rows, args, [*loads, _load()]), args.out, command_line(None))  # each row when done
        loads.append(_load())
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "probes": log}, indent=1, default=str))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]),
               Path(sys.argv[7]))
    else:
        main()
