"""What a training rank holds beside the tensors the plan counts, measured in this process for
``bmt-wrap plan --memory`` (docs/design.md "Capacity: the process's peak").

Two numbers: the baseline (the interpreter, torch, bmt_wrap, the model library, and what a first real step
leaves behind) and the bytes beside the tensors each layer adds (the allocator's heap around a layer's
many small tensors, the runtime's per-block state): 1 to 1.4 MiB per transformers layer on Llama, GPT-2
and Qwen2, 2.8 per T5 layer pair, which a one-layer baseline misses (15-19 MiB at the depths 1.5 GiB fits
on 2 ranks, as much as the plan's margin). Python's own objects are 0.14 MiB of it per layer (tracemalloc).
"""

from __future__ import annotations

import gc
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .base._compat import pytree
from .base.host_allocator import release_free_heap
from .passes.capture import Call


@dataclass(frozen=True)
class ProcessBaseline:
    """A rank's resident bytes beside its tensors: once, and per layer of the model grown."""

    resident: int
    per_layer: int = 0
    before_training: int | None = None  # the process before its first step (what wrapping sits on)


def resident_bytes() -> int:
    """This process's resident memory (VmRSS), or 0 where /proc is absent."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
    except OSError:
        return 0


def live_tensor_bytes() -> int:
    """Bytes of the distinct CPU storages of every tensor Python can reach."""
    storages: dict[int, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on some library objects warns (deprecated proxies)
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for t in tensors:
        if t.device.type != "cpu":
            continue
        try:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # fake, sparse and wrapper tensors own no CPU storage
            continue
    return sum(storages.values())


def train_one_step(factory: Callable[[], nn.Module], inputs: Call, optimizer_state: str | None,
                   offload: str | None) -> int:
    """Wrap ``factory()``'s model in this process's job, train it one step on zeros of the inputs' shapes
    with the optimizer the answer is for, and drop everything (a dropped model frees its shards); the
    resident bytes beside the live tensors just before the drop."""
    from .job.distributed import init_distributed, is_initialized, shutdown
    from .optim import AdamDiskOptimizer
    from .wrapping.wrapper import BMTrainModelWrapper

    owned = not is_initialized()
    if owned:
        init_distributed()
    try:
        args, kwargs = pytree.tree_map(lambda t: torch.zeros(t.shape, dtype=t.dtype), inputs)
        with tempfile.TemporaryDirectory() as tmp:
            options = {"offload": offload, "offload_dir": tmp} if offload else {}
            model = BMTrainModelWrapper(factory(), **options)
            opt = (AdamDiskOptimizer(model.parameters(), offload_dir=tmp) if optimizer_state == "disk"
                   else torch.optim.AdamW(model.parameters(), fused=True))
            out = model(*args, **kwargs)
            loss = out if isinstance(out, torch.Tensor) else out["loss"]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del out, loss
            gc.collect()
            release_free_heap()
            beside = resident_bytes() - live_tensor_bytes()
            del model, opt
    finally:
        if owned:
            shutdown()
    return beside


def grows_by_layers(keyword: str) -> bool:
    """True for a ``--grow`` keyword that counts layers (``n_layers``, ``num_hidden_layers``, ``n_layer``):
    only then does each step of it add blocks, and the bytes beside their tensors."""
    return "layer" in keyword.lower()


def settled_resident_bytes() -> int:
    """This process's resident bytes once freed objects and heap have left, as they leave a job run under
    EXACT_SETTING (this process may not run under it)."""
    gc.collect()
    release_free_heap()
    return resident_bytes()


def before_first_step(build: Callable[[int], nn.Module]) -> int | None:
    """The process as a rank is while it wraps, before its first step: the model's library imported (a
    meta-device ``build(1)`` imports what the factory imports lazily), nothing run. None when the factory
    cannot build on the meta device."""
    try:
        with torch.device("meta"):
            build(1)
    except Exception:  # noqa: BLE001  any factory: its own errors surface when the step below builds it
        return None
    return settled_resident_bytes()


def measure(build: Callable[[int], nn.Module], inputs: Call, optimizer_state: str | None, offload: str | None,
            per_layer: bool) -> ProcessBaseline:
    """The process before its first step, then the baseline after one step of ``build(1)``; with
    ``per_layer``, the bytes beside the tensors each layer adds, from steps of ``build(2)`` and ``build(4)``
    after it. Those two, not 1 and 3: a layer's first step leaves heap the later reuse, and a one-layer
    model's blocks are often its sublayers."""
    before = before_first_step(build)
    train_one_step(lambda: build(1), inputs, optimizer_state, offload)
    resident = settled_resident_bytes()
    before = min(before, resident) if before is not None else None
    if not per_layer:
        return ProcessBaseline(resident, before_training=before)
    two, four = (train_one_step(lambda k=k: build(k), inputs, optimizer_state, offload) for k in (2, 4))
    return ProcessBaseline(resident, max(0, (four - two) // 2), before)
