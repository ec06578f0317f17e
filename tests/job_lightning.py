"""A Lightning job run under torchrun by tests/test_integrations.py, as a user writes one.

Usage: ``torchrun --nproc_per_node=2 job_lightning.py OUT_DIR [EXAMPLES]``. The same LightningModule (tiny GPT-2,
AdamW) over the same data, five steps with ``gradient_clip_val=1.0``:

1. plain network, ``strategy="ddp"``: the reference;
2. wrapped network, ``ShardedStrategy``, a checkpoint after step 3 (``ModelCheckpoint``);
3. a fresh wrapped module resumed from it with ``fit(ckpt_path=...)``.

Rank 0 writes ``OUT_DIR/results.pt`` (per run: losses and final full weights of the network). Then the
example runs in EXAMPLES (tests/in_job.py), in this job.
"""

from __future__ import annotations

import sys

import lightning.pytorch as pl
import torch
from in_job import run_examples
from job_trainer import build, dataset
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import bmt_wrap as bmt
from bmt_wrap.integrations.lightning import ShardedStrategy

STEPS, SAVE_AT = 5, 3


class LM(pl.LightningModule):
    def __init__(self, wrap: bool) -> None:
        super().__init__()
        self.net = bmt.BMTrainModelWrapper(build()) if wrap else build()
        self.losses: list[float] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.net(**batch).loss
        self.losses.append(float(self.all_gather(loss.detach()).mean()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset()[:4 * SAVE_AT], batch_size=2, shuffle=False)  # an epoch is SAVE_AT steps


def run(module: LM, strategy: object, ckpt_dir: str | None = None, resume: str | None = None) -> dict[str, object]:
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=-1)] if ckpt_dir else []
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, gradient_clip_val=1.0,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=bool(ckpt_dir), callbacks=callbacks)
    trainer.fit(module, ckpt_path=resume)
    return {"losses": module.losses, "weights": module.net.state_dict()}


def main(out: str, examples: str) -> None:
    bmt.init_distributed(seed=0)
    results = {"ddp": run(LM(wrap=False), "ddp", ckpt_dir=f"{out}/ddp_ckpt"),
               "bmt": run(LM(wrap=True), ShardedStrategy(), ckpt_dir=f"{out}/ckpt")}
    saved = f"{out}/ckpt/epoch=0-step={SAVE_AT}.ckpt"
    results["resumed"] = run(LM(wrap=True), ShardedStrategy(), resume=saved)
    results["ddp_resumed"] = run(LM(wrap=False), "ddp", resume=f"{out}/ddp_ckpt/epoch=0-step={SAVE_AT}.ckpt")
    if bmt.rank() == 0:
        torch.save(results, f"{out}/results.pt")
    bmt.barrier()
    run_examples(examples)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "[]")
