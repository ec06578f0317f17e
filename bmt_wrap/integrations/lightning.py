"""PyTorch Lightning with a wrapped model: ``Trainer(strategy=ShardedStrategy(), ...)``.

Lightning's DDP strategy sets up the processes and shards the data as a sharded model needs, but then
wraps the model in DDP (which fails on shards of different sizes), broadcasts parameters from rank 0
outside fitting (which would overwrite other ranks' shards) and saves rank 0's optimizer shard as the
whole optimizer. ``ShardedStrategy`` keeps the first part and replaces the rest:

- the model is used as it is (it reduces its own gradients); ``gradient_clip_val`` needs nothing:
  ``torch.nn.utils.clip_grad_norm_`` on sharded parameters takes the norm over every rank;
- ``accumulate_grad_batches``: the accumulating batches' backwards run under the wrapped networks'
  ``no_sync()`` (DDP's strategy does this only for a DDP module), so they communicate no gradient;
- a checkpoint (``ModelCheckpoint``, ``trainer.save_checkpoint``) is a directory: the module's and the
  optimizers' state written with ``torch.distributed.checkpoint`` (every rank its own part), and
  ``meta.pt`` with the rest (loops, callbacks, schedulers, hyperparameters). ``fit(ckpt_path=...)``
  resumes from it, at the same or another world size.

Call ``bmt.init_distributed()`` at the start of the script and wrap the network inside the
LightningModule (in ``__init__`` or ``configure_model``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

from ..errors import CheckpointError, WrapError
from ..job.distributed import is_initialized
from ..save_load.atomic import require_directory
from ..save_load.dcp import holds_sharded_parameters, load_directory, save_directory
from ..wrapping.grad_sync import no_sync

#: The file, inside a checkpoint directory, holding everything but the module and optimizer states.
META = "meta.pt"


class ShardedStrategy(DDPStrategy):
    """Lightning strategy for LightningModules holding models wrapped by ``bmt.BMTrainModelWrapper``."""

    strategy_name = "bmt_wrap"

    def setup_environment(self) -> None:
        """Join the job (the process group bmt_wrap created is reused)."""
        if not is_initialized():
            raise WrapError("ShardedStrategy needs bmt_wrap's process setup: call bmt.init_distributed() at the "
                            "start of the script, before building and wrapping the model")
        super().setup_environment()

    def setup(self, trainer: pl.Trainer) -> None:
        """DDP's set-up without its model handling: no DDP wrapper, no broadcast of parameters."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if not holds_sharded_parameters(self.model):
            raise WrapError(f"{type(self.model).__name__} holds no sharded parameters: ShardedStrategy trains "
                            "a network wrapped by bmt.BMTrainModelWrapper inside the LightningModule (wrap it "
                            "in __init__ or configure_model), or use strategy='ddp' for a plain model")
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    # ---- checkpoints --------------------------------------------------------------------------------
    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning's accumulating batches: backwards under ``no_sync()`` of every network in the module."""
        assert self.model is not None
        with no_sync(self.model):
            yield

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Load after the optimizers exist: their sharded state is read straight into them."""
        return True

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state with each sharded parameter as this rank's ``LocalShard``."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.lightning_module)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state by parameter name, sharded state as ``LocalShard``s."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.lightning_module, optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Write the checkpoint directory ``filepath`` (every rank: its part; rank 0: ``meta.pt``), replacing
        an earlier one there only once complete."""
        if storage_options is not None:
            raise TypeError("ShardedStrategy writes checkpoints with torch.distributed.checkpoint and takes no "
                            "storage_options")
        path = Path(filepath)
        if path.is_file():
            raise CheckpointError(f"{path} is a file; a sharded checkpoint is a directory: save elsewhere")
        sharded = {"state_dict": checkpoint["state_dict"], "optimizer_states": checkpoint.get("optimizer_states", [])}
        meta = {k: v for k, v in checkpoint.items() if k not in sharded}
        meta["optimizer_states"] = len(sharded["optimizer_states"])  # how many; the states are in DCP files
        save_directory(path, sharded, {META: meta})

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Read a checkpoint directory into the module and optimizers; return the rest for Lightning."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        path = Path(checkpoint_path)
        require_directory(path)
        if not (path / META).is_file():
            raise CheckpointError(f"{path} is not a ShardedStrategy checkpoint (no {META} in it): resume from a "
                                  "directory that ShardedStrategy saved")
        meta = torch.load(path / META, map_location="cpu", weights_only=False)
        saved_optimizers = meta["optimizer_states"]
        if saved_optimizers and saved_optimizers != len(self.optimizers):
            raise CheckpointError(f"{path} holds {saved_optimizers} optimizer(s), configure_optimizers made "
                                  f"{len(self.optimizers)}: resume with the same optimizers")
        module = self.lightning_module
        state = {"state_dict": self.lightning_module_state_dict(),
                 "optimizer_states": [self.optimizer_state(o) for o in self.optimizers] if saved_optimizers else []}
        load_directory(path, state)
        set_model_state_dict(module, state["state_dict"])
        for optimizer, saved in zip(self.optimizers if saved_optimizers else [], state["optimizer_states"],
                                    strict=True):
            set_optimizer_state_dict(module, optimizer, saved)
        meta["state_dict"] = {}  # loaded above; Lightning's own restore calls are no-ops here
        meta["optimizer_states"] = []
        return meta

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Nothing: ``load_checkpoint`` already loaded the module."""

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Nothing: ``load_checkpoint`` already loaded the optimizers."""
