"""Issue 37's GPU goal: the largest Llama-shaped model one GPU trains when its memory is that of a 24 GiB card.

World size 1, ``torch.cuda.set_per_process_memory_fraction`` capping the device at ``--card`` bytes, bf16
parameters, ``torch.optim.AdamW`` (bf16 state) for every system, batch 1 x ``--seq``. Systems:

- ``plain``: the model on the device, nothing else;
- ``checkpoint``: plain with ``torch.utils.checkpoint`` around every decoder layer;
- ``fsdp2_offload``: ``fully_shard`` per layer and on the root with ``CPUOffloadPolicy(pin_memory=True)``
  (parameters, gradients and the optimizer step on the host);
- ``bmt_offload_host``: ``bmt.BMTrainModelWrapper(model, offload="host")`` of the model built on the host
  (its non-parameter buffers moved to the device): parameter, gradient and AdamW state shards in pinned host
  memory, each block's shard copied to the device one block ahead of its gather (docs/offload.md).

Each probe is a fresh process (``--probe SYSTEM LAYERS``) training ``--offload-steps`` steps after one warm-up; it
fits when no step raised ``torch.cuda.OutOfMemoryError``. Per system the search doubles the layer count
from ``--start`` and then bisects, up to ``--max-layers`` (host memory bounds the offloaded systems: the
row then says "≥"). Where every system fits (the smallest of their largest sizes), tokens/s of each, side
by side. Goals (issue 37): ``bmt_offload_host`` ≥ 10x ``plain``'s largest; its tokens/s ≥ ``fsdp2_offload``'s.

    python benchmarks/gpu_offload.py [--card 24GiB] [--hidden 4096] [--seq 1024] [--max-layers 96]
    python benchmarks/gpu.py --offload-capacity [the same options]   # as section 3 of the GPU session
    python benchmarks/gpu_offload.py --dry-run     # no GPU: the probes it would run, and each size's params

Without a CUDA device (and without ``--dry-run``) it exits at once with a message.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

SYSTEMS = ("plain", "checkpoint", "fsdp2_offload", "bmt_offload_host")
GIB = 2**30
NO_CUDA = ("benchmarks/gpu_offload.py needs a CUDA GPU and none is visible (torch.cuda.is_available() is False); "
           "nothing was measured. --dry-run lists the probes.")


def llama_config(args: argparse.Namespace, layers: int) -> object:
    """A Llama-2-shaped config (width ``--hidden``, MLP 8/3 x width rounded to 256, heads of 128) of ``layers``."""
    from transformers import LlamaConfig

    mlp = -(-int(args.hidden * 8 / 3) // 256) * 256
    return LlamaConfig(hidden_size=args.hidden, intermediate_size=mlp, num_hidden_layers=layers,
                       num_attention_heads=args.hidden // 128, num_key_value_heads=args.hidden // 128,
                       vocab_size=32000, max_position_embeddings=args.seq, torch_dtype="bfloat16")


def parameters(args: argparse.Namespace, layers: int) -> int:
    """The model's parameter count at ``layers`` (built on the meta device)."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in LlamaForCausalLM(llama_config(args, layers)).parameters())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build(system: str, args: argparse.Namespace, layers: int) -> torch.nn.Module:
    """The model as ``system`` trains it, on the device (or its host shards)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    on_host = system in ("fsdp2_offload", "bmt_offload_host")
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: an fp32 copy first would be the limit
    with torch.device("cpu" if on_host else "cuda"):
        model = LlamaForCausalLM(llama_config(args, layers))
    if system == "checkpoint":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif system == "fsdp2_offload":
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        policy = CPUOffloadPolicy(pin_memory=True)
        for layer in model.model.layers:
            fully_shard(layer, offload_policy=policy)
        fully_shard(model, offload_policy=policy)
    elif system == "bmt_offload_host":
        import bmt_wrap as bmt

        for module in model.modules():  # rotary tables and the like compute on the device; parameters stay home
            for name, buf in module.named_buffers(recurse=False):
                module._buffers[name] = buf.cuda()
        model = bmt.BMTrainModelWrapper(model, offload="host")
    return model


def probe(system: str, layers: int, args: argparse.Namespace) -> dict:
    """One rank (world size 1): train ``--offload-steps`` steps of ``layers`` layers under the card's cap."""
    import torch.distributed as dist

    import bmt_wrap as bmt

    torch.cuda.set_per_process_memory_fraction(min(1.0, args.card / torch.cuda.get_device_properties(0).total_memory))
    if system == "fsdp2_offload":
        dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    else:
        bmt.init_distributed(seed=0)
    result: dict = {"system": system, "layers": layers}
    try:
        model = _build(system, args, layers)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        g = torch.Generator(device="cuda").manual_seed(1)
        times = []
        for i in range(args.offload_steps + 1):
            ids = torch.randint(0, 32000, (1, args.seq + 1), device="cuda", generator=g)
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = model(input_ids=ids[:, :-1], labels=ids[:, 1:])
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - start)
        times.sort()
        result.update(ok=True, step_s=times[len(times) // 2], tokens_s=args.seq / times[len(times) // 2],
                      peak=torch.cuda.max_memory_allocated())
    except torch.cuda.OutOfMemoryError:
        result.update(ok=False, why="CUDA out of memory")
    except Exception as exc:  # a system that cannot run at all: its row says why
        result.update(ok=False, why=f"{type(exc).__name__}: {str(exc)[:200]}", fatal=True)
    return result


def run_probe(system: str, layers: int, args: argparse.Namespace) -> dict:
    """``probe`` in a fresh process (nothing a failed probe left behind meets the next)."""
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()))
    cmd = [sys.executable, __file__, "--probe", system, str(layers), "--card", str(args.card), "--hidden",
           str(args.hidden), "--seq", str(args.seq), "--offload-steps", str(args.offload_steps)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.probe_timeout)
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    if not lines:
        return {"system": system, "layers": layers, "ok": False, "why": (out.stderr or "no result")[-200:]}
    return json.loads(lines[-1])


def largest(system: str, args: argparse.Namespace, log: list[dict]) -> dict | None:
    """The largest layer count ``system`` trains (doubling from ``--start``, then bisection), or None."""
    def fits(k: int) -> dict:
        r = run_probe(system, k, args)
        print(f"  {system} {k} layers: {'ok' if r['ok'] else r['why']}", file=sys.stderr, flush=True)
        log.append(r)
        return r

    first = fits(args.start)
    if not first["ok"]:
        return None
    best, lo, hi = first, args.start, None
    while hi is None and lo < args.max_layers:
        k = min(2 * lo, args.max_layers)
        r = fits(k)
        if r["ok"]:
            best, lo = r, k
        else:
            hi = k
    while hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        r = fits(mid)
        best, lo, hi = (r, mid, hi) if r["ok"] else (best, lo, mid)
    return best


def parse_card(text: str) -> int:
    """``24GiB`` or a byte count."""
    return int(float(text.removesuffix("GiB")) * GIB) if text.endswith("GiB") else int(text)


def add_options(p: argparse.ArgumentParser) -> None:
    """This section's options (benchmarks/gpu.py takes them too)."""
    p.add_argument("--card", type=parse_card, default=24 * GIB, help="the device memory to emulate")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--offload-steps", type=int, default=2, help="timed steps per probe")
    p.add_argument("--start", type=int, default=2)
    p.add_argument("--max-layers", type=int, default=96)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--probe-timeout", type=float, default=600)


def dry_run(args: argparse.Namespace) -> list[str]:
    """What the search would probe, and the model's size at a few layer counts (no GPU needed)."""
    sizes = [f"{k} layers: {parameters(args, k) / 1e9:.2f}B parameters"
             for k in sorted({args.start, args.max_layers, (args.start + args.max_layers) // 2})]
    return [*sizes, "probes: " + ", ".join(f"{s} from {args.start} layers up to {args.max_layers}"
                                           for s in args.systems.split(","))]


def capacity_lines(args: argparse.Namespace) -> list[str]:
    """Each system's largest size under the cap, and tokens/s where every one fits (needs CUDA)."""
    systems = args.systems.split(",")
    log: list[dict] = []
    best = {s: largest(s, args, log) for s in systems}
    device = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    lines = [f"{device}; device capped at {args.card / GIB:.0f} GiB (set_per_process_memory_fraction), world size "
             f"1, Llama-shaped width {args.hidden}, seq {args.seq}, batch 1, bf16, torch AdamW, {args.offload_steps} steps "
             "after one warm-up", "",
             "| system | largest layers | parameters | vs plain | peak CUDA memory | tokens/s there | why it stops |",
             "|---|---|---|---|---|---|---|"]
    plain = best.get("plain")
    for s in systems:
        b = best[s]
        failed = next((r for r in reversed(log) if r["system"] == s and not r["ok"]), None)
        why = failed["why"] if failed else f"--max-layers {args.max_layers}"
        if b is None:
            lines.append(f"| {s} | 0 | - | - | - | - | {why} |")
            continue
        capped = "≥ " if failed is None else ""
        n = parameters(args, b["layers"])
        ratio = f"{n / parameters(args, plain['layers']):.1f}x" if plain else "-"
        lines.append(f"| {s} | {capped}{b['layers']} | {n / 1e9:.2f}B | {ratio} | {b['peak'] / GIB:.1f} GiB | "
                     f"{b['tokens_s']:.0f} | {why} |")
    common = min((b["layers"] for b in best.values() if b), default=0)
    if common and all(best.values()):
        lines += ["", f"Tokens/s at {common} layers (every system fits):", "", "| system | tokens/s | step s |",
                  "|---|---|---|"]
        for s in systems:
            r = run_probe(s, common, args)
            lines.append(f"| {s} | {r['tokens_s']:.0f} | {r['step_s']:.2f} |" if r["ok"] else f"| {s} | - | {r['why']} |")
    return lines


def main() -> None:
    """Search each system's largest size, then tokens/s where all fit; print and write the tables."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(p)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--probe", nargs=2, metavar=("SYSTEM", "LAYERS"))
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "gpu_offload.md")
    args = p.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit(NO_CUDA)
    if args.probe:
        print(json.dumps(probe(args.probe[0], int(args.probe[1]), args)))
        return
    if args.dry_run:
        print("\n".join(dry_run(args)))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from report import publish

    publish(capacity_lines(args), args.out)


if __name__ == "__main__":
    main()
