"""transformers' ``Trainer`` with a wrapped model: ``from bmt_wrap.integrations.transformers import Trainer``.

The stock ``Trainer`` treats a multi-process model as data-parallel. With a sharded model that means
DDP on top (which fails), clipping and a logged ``grad_norm`` of each rank's shard only, a
``save_model`` in which only rank 0 calls the model's collective ``state_dict()`` (a hang), and an
``optimizer.pt`` holding rank 0's shard as if it were the whole optimizer. This subclass:

- builds its accelerator as ``bmt_wrap.integrations.accelerate.Accelerator`` (no DDP; clipping and the
  logged gradient norm over every rank);
- ``save_model`` gathers the model to rank 0 one group at a time (every rank joins) and writes what
  ``from_pretrained`` reads, with nothing of bmt_wrap in it;
- checkpoints (``save_strategy``) write the optimizer with ``torch.distributed.checkpoint`` into
  ``optimizer_sharded/`` (every rank its part); ``resume_from_checkpoint`` reads it back, at the same
  or another world size.

Everything else (data, schedulers, RNG states, logging, callbacks) is the stock Trainer's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers.trainer import SCHEDULER_NAME

from ..errors import WrapError
from ..save_load.dcp import holds_sharded_parameters, load_sharded, save_sharded
from ..wrapping.sharded_module import full_state_dict
from .accelerate import adopt

#: The folder, inside a Trainer checkpoint, that holds the sharded optimizer state.
SHARDED_OPTIMIZER = "optimizer_sharded"


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` for models wrapped by ``bmt.BMTrainModelWrapper`` (see the module docstring)."""

    def create_accelerator_and_postprocess(self) -> None:
        """The stock accelerator, made bmt_wrap's (no DDP on a sharded model, clipping over every rank)."""
        super().create_accelerator_and_postprocess()
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise WrapError("bmt_wrap's Trainer shards the model itself: leave out the deepspeed= and fsdp= "
                            "training arguments")
        adopt(self.accelerator)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        # Every rank calls _save; the stock one returns at once on all but rank 0, which would then wait in
        # the model's collective state_dict() alone. Gather first, on every rank, into rank 0 only.
        if state_dict is None and holds_sharded_parameters(self.model):
            state_dict = full_state_dict(self.model, rank0_only=True)
        super()._save(output_dir, state_dict=state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not holds_sharded_parameters(self.optimizer):
            super()._save_optimizer_and_scheduler(output_dir)
            return
        save_sharded(Path(output_dir) / SHARDED_OPTIMIZER, self.model, _unwrapped(self.optimizer), with_model=False)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not (Path(checkpoint) / SHARDED_OPTIMIZER).is_dir():
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        load_sharded(Path(checkpoint) / SHARDED_OPTIMIZER, self.model, _unwrapped(self.optimizer), with_model=False)
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))


def _unwrapped(optimizer: Any) -> torch.optim.Optimizer:
    """The optimizer inside accelerate's wrapper (DCP names its state by the model's parameters)."""
    return getattr(optimizer, "optimizer", optimizer)
