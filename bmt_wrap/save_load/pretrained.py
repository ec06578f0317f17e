"""``bmt.from_pretrained``: the way to fine-tune a checkpoint larger than one rank's share of memory.

The model is built on the meta device (no storage), wrapped (the layout needs only shapes), and loaded
with ``bmt.load``: each rank allocates its shard and reads exactly its ranges' bytes, so no rank ever holds
the whole model, rank 0 included (docs/design.md "Streaming initialisation").
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError
from ..wrapping.init import init_parameters
from ..wrapping.wrapper import BMTrainModelWrapper
from .consolidated import load


def from_pretrained(model: type | Callable[[], nn.Module], path: str | os.PathLike, *, config: Any = None,
                    dtype: torch.dtype | None = None, strict: bool = True, **wrap_kwargs: Any) -> nn.Module:
    """Build ``model`` on the meta device, wrap it (``wrap_kwargs`` as ``BMTrainModelWrapper``'s) and load
    ``path`` into it; a collective. Each rank's peak is its shard plus one tensor's slice beyond its baseline.

    ``model``: a ``transformers`` model class or Auto class (``AutoModelForCausalLM``), built from
    ``config`` or else ``path``'s ``config.json``, in ``dtype`` or else the config's, and put in eval mode as
    ``transformers``' ``from_pretrained`` does; or any callable returning an ``nn.Module`` (built as is).
    ``path``: a ``save_pretrained`` directory or a checkpoint file. ``strict=False`` initialises the
    parameters the checkpoint lacks (a new head) as construction would, then loads the rest.
    """
    path = Path(path)
    transformers_class = _is_transformers_class(model)
    if transformers_class:
        config = config if config is not None else _config(model, path)
        dtype = dtype if dtype is not None else _config_dtype(config)
    with torch.device("meta"):
        built = (model.from_config(config) if hasattr(model, "from_config")  # type: ignore[union-attr]
                 else model(config)) if transformers_class else model()
    if not isinstance(built, nn.Module):
        raise CheckpointError(f"from_pretrained: {model!r} built a {type(built).__name__}, not an nn.Module: "
                              "pass a transformers model class, or a callable that returns the model")
    if dtype is not None:
        built = built.to(dtype)  # on the meta device: free, and before wrapping, where casting is allowed
    if transformers_class:
        built.eval()
    wrapped = BMTrainModelWrapper(built, **wrap_kwargs)
    if not strict:
        init_parameters(wrapped)  # what the file lacks keeps its constructed value; one module at a time
    load(wrapped, path, strict=strict)
    return wrapped


def _is_transformers_class(model: Any) -> bool:
    module = sys.modules.get("transformers")
    if module is None or not isinstance(model, type):
        return False
    return issubclass(model, module.PreTrainedModel) or hasattr(model, "from_config")


def _config(model: type, path: Path) -> Any:
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} has no config.json to build {model.__name__} from: pass a "
                              "save_pretrained directory, or config=")
    config_class = getattr(model, "config_class", None) or AutoConfig
    return config_class.from_pretrained(path)


def _config_dtype(config: Any) -> torch.dtype | None:
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None
