"""torch.compile and wrapped models: graphs and graph breaks dynamo makes in 3 training steps, per way of
compiling, beside plain PyTorch compiled per layer (docs/compile.md quotes the table).

    python benchmarks/compile_graphs.py [--backend inductor] [--out benchmarks/results/compile_graphs.md]

World size 1, SGD lr 0.1, 3 steps on the same batches; each case runs in a fresh process (dynamo's caches
and counters start empty). Models: tests/toy.py's ToyGPT (3 layers) and transformers GPT-2 and Llama from
their default configs with the sizes shrunk (3 layers, hidden 64, vocab 128; GPT-2's dropout 0 so losses
compare). "max |Δloss|" is against the same model trained plainly, uncompiled, in the same process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

CASES = [  # (model, how)
    ("toy", "plain, every layer compiled"), ("toy", "wrap, then block.compile()"),
    ("toy", "layer.compile(), then wrap"), ("toy", "torch.compile(layer), then wrap"),
    ("toy", "torch.compile(wrapped)"),
    ("gpt2", "plain, every layer compiled"), ("gpt2", "wrap, then block.compile()"),
    ("gpt2", "torch.compile(wrapped)"),
    ("llama", "plain, every layer compiled"), ("llama", "wrap, then block.compile()"),
    ("llama", "torch.compile(layer), then wrap"), ("llama", "torch.compile(wrapped)"),
]
STEPS = 3


def _build(name: str):  # noqa: ANN202 - a model
    import torch
    from toy import ToyGPT
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if name == "toy":
        return ToyGPT(n_layers=3)
    if name == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=3, n_head=4,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))


def _layers(model):  # noqa: ANN001, ANN202 - the model's list of layers
    for path in ("layers", "transformer.h", "model.layers"):
        try:
            return model.get_submodule(path)
        except AttributeError:
            continue
    raise ValueError(type(model).__name__)


def _losses(model, name: str, batches) -> list[float]:  # noqa: ANN001
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for ids in batches:
        loss = model(ids, ids) if name == "toy" else model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(float(loss))
    return out


def run_case(name: str, how: str, backend: str) -> dict:
    """One case in this process: graphs, breaks and the loss difference to the uncompiled plain model."""
    import torch
    from torch._dynamo.utils import counters

    import bmt_wrap as bmt

    bmt.init_distributed(seed=0)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 128 if name != "toy" else 64, (2, 16), generator=g) for _ in range(STEPS)]
    reference = _losses(_build(name), name, batches)
    model = _build(name)
    if how == "plain, every layer compiled":
        for layer in _layers(model):
            layer.compile(backend=backend)
    elif how == "layer.compile(), then wrap":
        for layer in _layers(model):
            layer.compile(backend=backend)
        model = bmt.BMTrainModelWrapper(model)
    elif how == "torch.compile(layer), then wrap":
        layers = _layers(model)
        for i in range(len(layers)):
            layers[i] = torch.compile(layers[i], backend=backend)
        model = bmt.BMTrainModelWrapper(model)
    else:
        model = bmt.BMTrainModelWrapper(model)
        if how == "wrap, then block.compile()":
            for spec in model.plan.blocks():
                model.get_submodule(spec.name).compile(backend=backend)
        else:
            model = torch.compile(model, backend=backend)
    losses = _losses(model, name, batches)
    counts = {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values())}
    blocks = len(getattr(getattr(model, "_orig_mod", model), "plan", None).blocks()) if how[:5] != "plain" else None
    return {"graphs": counts["graphs"], "breaks": counts["breaks"], "blocks": blocks,
            "dloss": max(abs(a - b) for a, b in zip(losses, reference, strict=True))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "compile_graphs.md")
    parser.add_argument("--case", type=int, help=argparse.SUPPRESS)  # one case, in a fresh process
    args = parser.parse_args()
    if args.case is not None:
        print(json.dumps(run_case(*CASES[args.case], args.backend)))
        return
    from report import publish

    lines = [f"World size 1, torch.compile backend {args.backend}, {STEPS} SGD steps; graphs = dynamo's unique "
             "graphs, breaks = its graph breaks; each case in a fresh process", "",
             "| model | how | blocks | graphs | breaks | max abs loss diff vs uncompiled plain |", "|---|---|---|---|---|---|"]
    env = {**os.environ, "WORLD_SIZE": "1", "RANK": "0", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    for i, (name, how) in enumerate(CASES):
        proc = subprocess.run([sys.executable, __file__, "--backend", args.backend, "--case", str(i)],
                              capture_output=True, text=True, env=env, timeout=900)
        if proc.returncode != 0:
            lines.append(f"| {name} | {how} | - | failed: {proc.stderr.strip().splitlines()[-1][:80]} | - | - |")
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        lines.append(f"| {name} | {how} | {'-' if r['blocks'] is None else r['blocks']} | {r['graphs']} | "
                     f"{r['breaks']} | {r['dloss']:.1e} |")
    publish(lines, args.out)


if __name__ == "__main__":
    main()
