"""What every module with sharded parameters does differently from plain torch, and nothing else:

- ``state_dict()`` is a collective returning full CPU tensors under the original names (one group
  gathered at a time), and ``load_state_dict`` takes full tensors and keeps this rank's slices;
- ``.to()/.half()/.cuda()`` that would change a sharded parameter raise ``WrapError`` (cast before
  wrapping, or use ``mixed_precision=``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ._compat import register_state_dict_hooks
from .errors import WrapError
from .runtime.group import ShardGroup
from .runtime.param import DistributedParameter


class _GatherCache:
    """The one group gathered while a state_dict is being written (groups are visited in order)."""

    group: ShardGroup | None = None
    views: list[list[torch.Tensor]] | None = None
    depth = 0

    @classmethod
    def value(cls, p: DistributedParameter) -> torch.Tensor:
        group = p.shard_group
        if cls.group is not group:
            cls.clear()
            cls.group = group
            cls.views = [b.slot_views(f) for b, f in zip(group.buffers, group.gather_values(), strict=True)]
        assert cls.views is not None
        return cls.views[group.buffers.index(p.flat_buffer)][p.slot_index]

    @classmethod
    def clear(cls) -> None:
        cls.group, cls.views = None, None


def _save_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    for attr, p in module._parameters.items():
        key = prefix + attr
        if isinstance(p, DistributedParameter) and key in state_dict and state_dict[key] is not p:
            state_dict[key] = _GatherCache.value(p).detach().to("cpu", copy=True)


def _load_pre_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any, strict: bool,
                   missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    for attr, p in module._parameters.items():
        key = prefix + attr
        if not isinstance(p, DistributedParameter) or key not in state_dict:
            continue
        full = state_dict[key]
        if tuple(full.shape) != tuple(p.full_shape):
            error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(full.shape)} "
                              f"from checkpoint, the shape in current model is {tuple(p.full_shape)}.")
            state_dict[key] = p.detach()
            continue
        p.load_full(full.detach().to(p.device, p.dtype))
        state_dict[key] = p.detach()  # what torch then copies is this rank's slice onto itself


def install_state_hooks(module: nn.Module) -> None:
    """Make ``module``'s own sharded parameters save as full tensors and load from full tensors."""
    if getattr(module, "_bmt_state_hooks", False):
        return
    register_state_dict_hooks(module, _save_hook, _load_pre_hook)
    module._bmt_state_hooks = True


def _install_below(root: nn.Module) -> None:
    # Bare DistributedParameters are assigned to modules after they are built, so their holders are
    # found here rather than when the parameter is made.
    for m in root.modules():
        if any(isinstance(p, DistributedParameter) for p in m._parameters.values()):
            install_state_hooks(m)


class ShardedModuleMixin:
    """Mixed into blocks, ``DistributedModule`` and wrapped roots (see the module docstring)."""

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """Full tensors on CPU under the original names; a collective (every rank must call it)."""
        _install_below(self)  # type: ignore[arg-type]
        _GatherCache.depth += 1
        try:
            return super().state_dict(*args, **kwargs)  # type: ignore[misc]
        finally:
            _GatherCache.depth -= 1
            if _GatherCache.depth == 0:
                _GatherCache.clear()

    def load_state_dict(self, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        """Load full tensors; each rank keeps its slices of sharded parameters."""
        _install_below(self)  # type: ignore[arg-type]
        return super().load_state_dict(state_dict, *args, **kwargs)  # type: ignore[misc]

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        for p in self.parameters():  # type: ignore[attr-defined]
            if isinstance(p, DistributedParameter):
                moved = fn(p)
                if moved is not p and (moved.dtype != p.dtype or moved.device != p.device):
                    raise WrapError(
                        f"cannot move or cast {p.fqn!r} after it was sharded ({p.dtype} on {p.device} -> "
                        f"{moved.dtype} on {moved.device}). Call .to()/.half()/.cuda() before wrapping, or "
                        "pass mixed_precision=bmt.MixedPrecision(...) to the wrapper.")
        return super()._apply(lambda t: t if isinstance(t, DistributedParameter) else fn(t),  # type: ignore[misc]
                              recurse)
