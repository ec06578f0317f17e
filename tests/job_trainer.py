"""A transformers ``Trainer`` job run under torchrun by tests/test_integrations.py, the way a user runs one.

Usage: ``torchrun --nproc_per_node=2 job_trainer.py OUT_DIR [EXAMPLES]``. In one job, on the same tiny GPT-2 (its
default config, sizes shrunk; dropout 0, since two ranks cannot draw one process's masks), the same data
and seed, five steps each with the Trainer's defaults (AdamW, linear schedule, ``max_grad_norm=1.0``):

1. plain model, stock ``transformers.Trainer`` (which puts DDP on top): the reference;
2. wrapped model, ``bmt_wrap.integrations.transformers.Trainer``, checkpointing at step 3, then
   ``save_model``;
3. a fresh wrapped model resumed from that step-3 checkpoint.

Rank 0 writes ``OUT_DIR/results.pt``: each run's log history and final full weights, and the weights
``from_pretrained`` reads back from ``save_model``'s folder. The test judges them. Then the example runs in
EXAMPLES (tests/in_job.py), in this job.
"""

from __future__ import annotations

import os
import sys

import torch
from in_job import run_examples
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
from transformers import Trainer as StockTrainer

import bmt_wrap as bmt
from bmt_wrap.integrations.transformers import Trainer

STEPS, SAVE_AT, SEQ, VOCAB = 5, 3, 16, 128


def build() -> GPT2LMHeadModel:
    """GPT-2 from its default config, shrunk; the same weights on every call."""
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=3, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return GPT2LMHeadModel(cfg)


def dataset() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (64, SEQ), generator=gen)
    return [{"input_ids": row, "labels": row} for row in ids]


def args(out: str, **kwargs: object) -> TrainingArguments:
    kwargs.setdefault("save_strategy", "no")
    return TrainingArguments(output_dir=out, max_steps=STEPS, per_device_train_batch_size=2, learning_rate=1e-2,
                             logging_steps=1, report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0,
                             disable_tqdm=True, **kwargs)


def main(out: str, examples: str) -> None:
    bmt.init_distributed(seed=0)
    rank = bmt.rank()
    results: dict[str, object] = {}

    ddp = StockTrainer(model=build(), args=args(f"{out}/ddp"), train_dataset=dataset())
    ddp.train()
    results["ddp"] = {"log": ddp.state.log_history, "weights": {k: v.detach().clone() for k, v in
                                                                ddp.model.state_dict().items()}}

    model = bmt.BMTrainModelWrapper(build())
    trainer = Trainer(model=model, args=args(f"{out}/bmt", save_strategy="steps", save_steps=SAVE_AT),
                      train_dataset=dataset())
    trainer.train()
    results["bmt"] = {"log": trainer.state.log_history, "weights": model.state_dict()}
    trainer.save_model(f"{out}/final")

    resumed_model = bmt.BMTrainModelWrapper(build())
    resumed = Trainer(model=resumed_model, args=args(f"{out}/resumed"), train_dataset=dataset())
    resumed.train(resume_from_checkpoint=f"{out}/bmt/checkpoint-{SAVE_AT}")
    results["resumed"] = {"log": resumed.state.log_history, "weights": resumed_model.state_dict()}

    if rank == 0:
        reloaded = GPT2LMHeadModel.from_pretrained(f"{out}/final")
        results["from_pretrained"] = {k: v.detach().clone() for k, v in reloaded.state_dict().items()}
        results["files"] = sorted(os.listdir(f"{out}/bmt/checkpoint-{SAVE_AT}"))
        torch.save(results, f"{out}/results.pt")
    bmt.barrier()
    run_examples(examples)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "[]")
