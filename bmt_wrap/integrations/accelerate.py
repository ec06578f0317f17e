"""Hugging Face ``accelerate`` with a wrapped model: ``from bmt_wrap.integrations.accelerate import Accelerator``.

accelerate's own ``Accelerator`` treats every multi-process model as data-parallel, which a sharded
model is not: it wraps it in DDP (which cannot broadcast parameters each rank holds a part of) and
saves rank 0's optimizer shard as the whole optimizer. This subclass changes exactly those things for
models and optimizers holding sharded parameters, and nothing for others (``clip_grad_norm_`` needs no
change: torch's clipping takes the norm of sharded parameters over every rank):

- ``prepare`` leaves a wrapped model unwrapped (it reduces its own gradients) and places nothing;
- ``get_state_dict`` (and so ``save_model``) gathers full tensors into the main process only;
- ``save_state``/``load_state`` write each sharded optimizer with ``torch.distributed.checkpoint`` into
  ``optimizer_sharded`` (``optimizer_sharded_<i>`` for more), every rank its own part, and leave a
  one-line placeholder in ``optimizer.bin`` that says where the state is. The model is saved as
  accelerate saves it (full tensors in ``model.safetensors``, readable without bmt_wrap).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import accelerate
import torch
from accelerate.optimizer import AcceleratedOptimizer
from torch import nn

from ..errors import CheckpointError
from ..save_load.dcp import holds_sharded_parameters, load_sharded, owner_of, save_sharded
from ..wrapping.sharded_module import full_state_dict

#: The key of the placeholder written where accelerate expects an optimizer state dict.
PLACEHOLDER_KEY = "bmt_wrap.sharded_optimizer_state"


def sharded_optimizer_dir(index: int) -> str:
    """The folder, inside a ``save_state`` directory, holding sharded optimizer ``index``."""
    return "optimizer_sharded" if index == 0 else f"optimizer_sharded_{index}"


class ShardedAcceleratedOptimizer(AcceleratedOptimizer):
    """accelerate's optimizer wrapper for an optimizer over sharded parameters: during ``save_state`` its
    ``state_dict()`` is a placeholder naming the sharded folder, and loading that placeholder reads it."""

    _placeholder: str | None = None  # set for the one state_dict() call save_state makes on every rank
    _owner: nn.Module | None = None
    _checkpoint_dir: Path | None = None  # the directory load_state is reading

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state (LocalShards for sharded parameters), or save_state's placeholder."""
        if self._placeholder is not None:
            name, self._placeholder = self._placeholder, None
            return {PLACEHOLDER_KEY: name}
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict, or the sharded state a ``save_state`` placeholder points to (a collective)."""
        name = state_dict.get(PLACEHOLDER_KEY) if isinstance(state_dict, dict) else None
        if name is None:
            super().load_state_dict(state_dict)
            return
        if self._checkpoint_dir is None or self._owner is None:
            raise CheckpointError(f"this optimizer state is a placeholder for the sharded folder {name!r}: load it "
                                  "with accelerator.load_state(directory) on every rank")
        load_sharded(self._checkpoint_dir / name, self._owner, self.optimizer, with_model=False)


class Accelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` that trains bmt_wrap models (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _install_state_hooks(self)

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> nn.Module:
        """A wrapped model gets mixed precision and compilation, never DDP or device placement."""
        if holds_sharded_parameters(model):
            return super().prepare_model(model, device_placement=False, evaluation_mode=True)
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        """As accelerate does, with a wrapper that saves a sharded optimizer per rank."""
        prepared = super().prepare_optimizer(optimizer, device_placement=device_placement)
        if type(prepared) is AcceleratedOptimizer and holds_sharded_parameters(optimizer):
            prepared.__class__ = ShardedAcceleratedOptimizer  # adds behaviour only, no state of its own
            _sharded_optimizers(self).append(prepared)
        return prepared

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """Full tensors of a wrapped model on the main process only (``{}`` elsewhere), gathered one group
        at a time, as accelerate's FSDP full state dict is; every rank must call it (``save_model`` does)."""
        if holds_sharded_parameters(model):
            return full_state_dict(self.unwrap_model(model) if unwrap else model, rank0_only=True)
        return super().get_state_dict(model, unwrap=unwrap)


def adopt(accelerator: accelerate.Accelerator) -> Accelerator:
    """Make an existing ``accelerate.Accelerator`` (one a library built, e.g. transformers' Trainer) this
    subclass, before anything is prepared; returns it."""
    if not isinstance(accelerator, Accelerator):
        accelerator.__class__ = Accelerator  # adds behaviour only, no state of its own
        _install_state_hooks(accelerator)
    return accelerator


def _install_state_hooks(accelerator: accelerate.Accelerator) -> None:
    def before_save(models: list[nn.Module], weights: list[Any], output_dir: str) -> None:
        for i, opt in enumerate(_sharded_optimizers(accelerator)):
            save_sharded(Path(output_dir) / sharded_optimizer_dir(i), owner_of(opt.optimizer, models), opt.optimizer,
                         with_model=False)
            opt._placeholder = sharded_optimizer_dir(i)

    def before_load(models: list[nn.Module], input_dir: str) -> None:
        for opt in _sharded_optimizers(accelerator):
            opt._owner = owner_of(opt.optimizer, models)
            opt._checkpoint_dir = Path(input_dir)

    accelerator.register_save_state_pre_hook(before_save)
    accelerator.register_load_state_pre_hook(before_load)


def _sharded_optimizers(accelerator: accelerate.Accelerator) -> list[ShardedAcceleratedOptimizer]:
    """The sharded optimizers this accelerator prepared, in order (their folders are numbered so)."""
    if "bmt_sharded_optimizers" not in accelerator.__dict__:
        accelerator.bmt_sharded_optimizers = []
    return accelerator.bmt_sharded_optimizers
