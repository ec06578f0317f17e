"""An accelerate training loop, sharded by bmt_wrap: a stock accelerate script with two changes,
``BMTrainModelWrapper(model)`` and ``Accelerator`` imported from bmt_wrap's integration.

``accelerator.prepare`` leaves the wrapped model as it is (no DDP), ``clip_grad_norm_`` clips over
every rank, and ``save_state``/``load_state`` write and read the optimizer sharded (every rank its part).
The model is a byte-level Llama from its default config with the sizes shrunk; the data are windows of
the bytes of the installed torch package's source. ``--stop-at N`` ends after step N with a saved
state; ``--resume`` continues from it, exactly where it stopped.

    torchrun --nproc_per_node=2 examples/accelerate_loop.py [--steps 200] [--out-dir out/accelerate_loop]
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from corpus import byte_llama, byte_windows, lm_arguments, load_corpus
from torch.utils.data import DataLoader

import bmt_wrap as bmt
from bmt_wrap.integrations.accelerate import Accelerator


def main() -> None:
    parser = lm_arguments(__doc__.splitlines()[0], "out/accelerate_loop")
    parser.add_argument("--stop-at", type=int, default=None, help="save the state after this step and stop")
    parser.add_argument("--resume", action="store_true", help="continue from the state in --out-dir")
    args = parser.parse_args()

    bmt.init_distributed(seed=0)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    model = bmt.BMTrainModelWrapper(byte_llama(args.layers, args.dim))  # the one line bmt_wrap adds
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    data = byte_windows(load_corpus(4 << 20), args.steps * args.batch * accelerator.num_processes, args.seq, seed=1)
    loader = DataLoader(data, batch_size=args.batch, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    out = Path(args.out_dir)
    metrics_path = out / "metrics.json"
    losses: list[float] = []
    start = 0
    if args.resume:
        accelerator.load_state(out / "state")
        losses = json.loads(metrics_path.read_text())["losses"]
        start = len(losses)
        accelerator.print(f"resumed from step {start}")
        loader = accelerator.skip_first_batches(loader, start)
    for step, batch in enumerate(loader, start=start):
        loss = model(**batch).loss
        accelerator.backward(loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(accelerator.reduce(loss.detach(), "mean")))
        if (step + 1) % 20 == 0:
            accelerator.print(f"step {step + 1}: loss {losses[-1]:.4f}, gradient norm {float(norm):.3f}")
        if step + 1 == args.stop_at:
            accelerator.save_state(out / "state")
            break
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        metrics_path.write_text(json.dumps({"losses": losses, "finished": len(losses) == args.steps}))
    accelerator.save_model(model, out / "final")  # full tensors in model.safetensors; every rank joins
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
