"""Train a transformers model with transformers' ``Trainer``, sharded by bmt_wrap: a stock Trainer script
with two changes, ``BMTrainModelWrapper(model)`` and ``Trainer`` imported from bmt_wrap's integration.

The model is a byte-level Llama from its default config with the sizes shrunk; the data are windows of
the bytes of the installed torch package's source. The Trainer's defaults apply (AdamW, linear decay,
``max_grad_norm=1.0``, clipped and logged over all ranks); checkpoints (``--save-every``) hold the
optimizer sharded and resume with ``--resume``. At the end ``save_model`` writes a folder that plain
transformers reads: rank 0 reloads it with ``from_pretrained`` and scores it again.

    torchrun --nproc_per_node=2 examples/trainer_finetune.py [--steps 200] [--out-dir out/trainer_finetune]
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from corpus import byte_llama, byte_windows, lm_arguments, load_corpus
from transformers import AutoModelForCausalLM, TrainingArguments

import bmt_wrap as bmt
from bmt_wrap.integrations.transformers import Trainer


def main() -> None:
    parser = lm_arguments(__doc__.splitlines()[0], "out/trainer_finetune")
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out-dir")
    args = parser.parse_args()

    bmt.init_distributed(seed=0)
    torch.manual_seed(0)
    model = bmt.BMTrainModelWrapper(byte_llama(args.layers, args.dim))  # the one line bmt_wrap adds
    corpus = load_corpus(4 << 20)
    train = byte_windows(corpus, args.steps * args.batch * bmt.world_size(), args.seq, seed=1)
    held_out = byte_windows(corpus, 16 * bmt.world_size(), args.seq, seed=2)
    out = Path(args.out_dir)
    training = TrainingArguments(output_dir=str(out), max_steps=args.steps, per_device_train_batch_size=args.batch,
                                 per_device_eval_batch_size=args.batch, learning_rate=3e-3, warmup_steps=10,
                                 logging_steps=10, save_strategy="steps", save_steps=args.save_every,
                                 report_to=[], use_cpu=not torch.cuda.is_available(), seed=0,
                                 disable_tqdm=True)
    trainer = Trainer(model=model, args=training, train_dataset=train, eval_dataset=held_out)
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    eval_loss = trainer.evaluate()["eval_loss"]
    trainer.save_model(str(out / "final"))
    bmt.print_rank(f"held-out loss {eval_loss:.4f} ({math.exp(eval_loss):.1f} perplexity per byte)")

    if bmt.rank() == 0:
        reloaded = AutoModelForCausalLM.from_pretrained(out / "final").eval()
        with torch.no_grad():
            rows = torch.stack([r["input_ids"] for r in held_out])
            reloaded_loss = float(reloaded(input_ids=rows, labels=rows).loss)
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        (out / "metrics.json").write_text(json.dumps({"losses": losses, "eval_loss": eval_loss,
                                                      "reloaded_eval_loss": reloaded_loss}))
        print(f"plain transformers reloaded {out / 'final'}: held-out loss {reloaded_loss:.4f}")
    bmt.barrier()


if __name__ == "__main__":
    main()
