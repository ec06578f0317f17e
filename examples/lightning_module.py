"""A PyTorch Lightning module, sharded by bmt_wrap: a stock Lightning script with three changes,
``bmt.init_distributed()`` first, ``BMTrainModelWrapper`` around the network inside the module, and
``strategy=ShardedStrategy()``.

``gradient_clip_val`` clips over every rank, and checkpoints are directories written with
``torch.distributed.checkpoint`` (every rank its part of the module and optimizer) that
``fit(ckpt_path=...)`` resumes from. The network is a byte-level Llama from its default config with the
sizes shrunk; the data are windows of the bytes of the installed torch package's source.

    torchrun --nproc_per_node=2 examples/lightning_module.py [--steps 200] [--resume out/lightning_module/ckpt/last.ckpt]
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import torch
from corpus import byte_llama, byte_windows, lm_arguments, load_corpus
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import bmt_wrap as bmt
from bmt_wrap.integrations.lightning import ShardedStrategy


class ByteLM(pl.LightningModule):
    """Next-byte prediction with a wrapped transformers Llama."""

    def __init__(self, layers: int, dim: int, data: list[dict[str, torch.Tensor]], batch: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = bmt.BMTrainModelWrapper(byte_llama(layers, dim))  # the one line bmt_wrap adds
        self.data, self.batch = data, batch
        self.losses: list[float] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.net(**batch).loss
        self.losses.append(float(self.all_gather(loss.detach()).mean()))
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch, shuffle=False)


def main() -> None:
    parser = lm_arguments(__doc__.splitlines()[0], "out/lightning_module")
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--resume", default=None, help="a checkpoint directory to continue from")
    args = parser.parse_args()

    bmt.init_distributed(seed=0)  # before the module wraps its network
    world = bmt.world_size()
    data = byte_windows(load_corpus(4 << 20), args.steps * args.batch * world, args.seq, seed=1)
    module = ByteLM(args.layers, args.dim, data, args.batch)
    out = Path(args.out_dir)
    trainer = pl.Trainer(accelerator="auto", devices=world, strategy=ShardedStrategy(), max_steps=args.steps,
                         gradient_clip_val=1.0, logger=False, enable_progress_bar=False,
                         callbacks=[ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=args.save_every,
                                                    save_last=True)])
    trainer.fit(module, ckpt_path=args.resume)
    if trainer.is_global_zero:
        (out / "metrics.json").write_text(json.dumps({"losses": module.losses, "global_step": trainer.global_step}))
        print(f"trained to step {trainer.global_step}: loss {module.losses[-1]:.4f}")


if __name__ == "__main__":
    main()
