"""How each benchmarked system takes the same freshly built model: one function per system.

Each takes the model, its workload and this rank's first batch, and returns the model to train (possibly
a wrapper object); bmt_wrap's wrapped models carry the plan whose estimates the report sets beside the
measured communication.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

import torch
from torch import nn
from workloads import Batch, Workload

import bmt_wrap as bmt
from bmt_wrap import passes


def single(model: nn.Module, wl: Workload, example: Batch) -> nn.Module:
    """Plain PyTorch in one process (it trains on the whole global batch)."""
    return model


def ddp(model: nn.Module, wl: Workload, example: Batch) -> nn.Module:
    """torch DistributedDataParallel: every rank holds everything, gradients all-reduced."""
    return nn.parallel.DistributedDataParallel(model)


def fsdp2(model: nn.Module, wl: Workload, example: Batch) -> nn.Module:
    """``torch.distributed.fsdp.fully_shard`` on every block, then on the root."""
    from torch.distributed.fsdp import fully_shard

    for block in wl.block_list(model):
        fully_shard(block)
    fully_shard(model)
    return model


def fsdp2_offload(model: nn.Module, wl: Workload, example: Batch) -> nn.Module:
    """``fully_shard`` with ``CPUOffloadPolicy``: shards, gradients and the optimizer step on the host
    (``pin_memory=False``: pinning needs an accelerator, so on a CPU-only machine offload moves nothing)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for block in wl.block_list(model):
        fully_shard(block, offload_policy=policy)
    fully_shard(model, offload_policy=policy)
    return model


def fsdp1(model: nn.Module, wl: Workload, example: Batch) -> nn.Module:
    """``FullyShardedDataParallel`` with a transformer wrap policy on the block class."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    block_cls = type(wl.block_list(model)[0])
    # device_id: FSDP1 refuses CPU-only machines unless told the device explicitly.
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({block_cls}), use_orig_params=True,
                                    device_id=device)


def bmt_wrapper(model: nn.Module, wl: Workload, example: Batch) -> nn.Module:
    """bmt_wrap's one-liner: blocks found, traced and planned automatically."""
    return bmt.BMTrainModelWrapper(model)


#: The toy GPT's TP plan (transformers' vocabulary): MLP pairs, vocabulary-parallel embedding and head.
#: Its attention stays replicated: one fused qkv Linear reshaped with the input's full width cannot be split.
TOY_TP_PLAN = {"blocks.*.fc": "colwise", "blocks.*.out": "rowwise", "wte": "embedding_rowwise",
               "head": "colwise_gather_output"}
#: Systems with tensor parallelism, and their TP size (the worker slices data over the data-parallel ranks).
TP_SIZES = {"bmt_wrapper_tp2": 2}


def bmt_wrapper_tp2(model: nn.Module, wl: Workload, example: Batch) -> nn.Module:
    """The one-liner with ``tp_size=2``: TP over adjacent rank pairs, ZeRO-3 over the data-parallel ranks
    (transformers models by their own tp plan, the toy GPT by ``TOY_TP_PLAN``)."""
    plan = TOY_TP_PLAN if wl.name.startswith("toy") else None
    return bmt.BMTrainModelWrapper(model, tp_size=2, tp_plan=plan)


#: Systems with pipeline stages, and their count (the worker slices data by ``bmt.data_parallel_rank()``).
PIPE_SIZES = {"bmt_wrapper_pp2": 2}


def bmt_wrapper_pp2(model: nn.Module, wl: Workload, example: Batch) -> nn.Module:
    """The one-liner with two pipeline ranks (ZeRO-3 over each stage's data-parallel ranks), GPipe over
    ``$BMT_PP_MICROBATCHES`` micro-batches (default 4), ``$BMT_PP_VIRTUAL`` stages per rank (default 1); wrapped
    with the example batch, so the stages are balanced by the blocks' forward FLOPs and the head's."""
    return bmt.BMTrainModelWrapper(model, pp_size=2, pp_microbatches=int(os.environ.get("BMT_PP_MICROBATCHES", "4")),
                                   pp_virtual_stages=int(os.environ.get("BMT_PP_VIRTUAL", "1")),
                                   example_inputs=wl.call(*example))


#: Systems with expert parallelism, and their EP size (every rank takes its own slice of the data).
EP_SIZES = {"bmt_wrapper_ep2": 2, "bmt_wrapper_ep4": 4}


def bmt_wrapper_ep(ep: int) -> Callable[[nn.Module, Workload, Batch], nn.Module]:
    """The one-liner with expert parallelism over ``ep`` ranks (ZeRO-3 over the rest)."""
    def wrap(model: nn.Module, wl: Workload, example: Batch) -> nn.Module:
        return bmt.BMTrainModelWrapper(model, ep_size=ep)
    return wrap


def ddp_need(model: nn.Module, wl: Workload, example: Batch) -> int:
    """Bytes per rank DDP holds, by the plan's own measure: a whole replica's parameters, gradients and AdamW
    state, and every block's activations kept (DDP never recomputes) at this rank's batch shape."""
    discovery = passes.discover_blocks(model)
    cap = passes.capture(model, discovery, wl.call(*example))
    est = passes.build_plan(model, discovery, world_size=1, checkpoint=False, capture=cap).estimates["1"]
    return est.params + est.grads + est.optimizer + (est.activations or 0)


def bmt_wrapper_budget(model: nn.Module, wl: Workload, example: Batch) -> nn.Module:
    """The one-liner given DDP's memory as its budget: it decides at the first forward what to keep."""
    return bmt.BMTrainModelWrapper(model, memory_budget=ddp_need(model, wl, example))


def bmt_explicit(model: nn.Module, wl: Workload, example: Batch) -> nn.Module:
    """bmt_wrap's explicit API: the same model written BMTrain-style, loaded with the same weights."""
    return wl.explicit(model)


def bmt_engine(model: nn.Module, wl: Workload, example: Batch) -> nn.Module:
    """bmt_wrap's engine with the blocks marked by hand (a plan built without the passes)."""
    from bmt_wrap.apply_plan import apply_plan
    from bmt_wrap.dtypes import dtype_name
    from bmt_wrap.plan import ROOT, ParamInfo, ShardGroupSpec, WrapPlan, layout_buffers

    names = [f"{wl.blocks}.{i}" for i in range(len(wl.block_list(model)))]
    owner: dict[str, list[ParamInfo]] = {ROOT: [], **{b: [] for b in names}}
    seen: dict[int, ParamInfo] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:  # a tied parameter's second name (GPT-2's head): the first placement holds it
            seen[id(p)].aliases.append(fqn)
            continue
        seen[id(p)] = ParamInfo(fqn, list(p.shape), dtype_name(p.dtype), p.requires_grad)
        owner[next((b for b in names if fqn.startswith(b + ".")), ROOT)].append(seen[id(p)])
    groups = [ShardGroupSpec(name, layout_buffers(infos)) for name, infos in owner.items()]
    return apply_plan(model, WrapPlan(groups=groups, prefetch_depth=1, order=names, capture="explicit"))


def adam_on_disk(model: nn.Module) -> torch.optim.Optimizer:
    """``bmt.optim.AdamDiskOptimizer`` with the hyperparameters every other system's ``torch.optim.AdamW``
    has (lr 1e-4, AdamW's defaults: weight decay 0.01, betas (0.9, 0.999), eps 1e-8; the same decoupled
    update, through the same fused kernel); its state file under ``$BMT_OPTIMIZER_DIR`` or the temp dir."""
    return bmt.optim.AdamDiskOptimizer(model.parameters(), lr=1e-4, weight_decay=0.01,
                                       offload_dir=os.environ.get("BMT_OPTIMIZER_DIR", tempfile.gettempdir()))


SYSTEMS: dict[str, Callable[[nn.Module, Workload, Batch], nn.Module]] = {
    "single": single, "ddp": ddp, "fsdp2": fsdp2, "fsdp2_offload": fsdp2_offload, "fsdp1": fsdp1,
    "bmt_explicit": bmt_explicit,
    "bmt_wrapper": bmt_wrapper, "bmt_wrapper_budget": bmt_wrapper_budget, "bmt_engine": bmt_engine,
    "bmt_wrapper_tp2": bmt_wrapper_tp2, "bmt_wrapper_disk": bmt_wrapper, "bmt_wrapper_pp2": bmt_wrapper_pp2,
    **{name: bmt_wrapper_ep(ep) for name, ep in EP_SIZES.items()},
}
#: Systems that bring their own optimizer (the others train with ``torch.optim.AdamW(lr=1e-4, fused=True)``).
OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {"bmt_wrapper_disk": adam_on_disk}
#: Systems that train on bmt_wrap's communicator, whose bytes ``bmt.comm_stats()`` counts.
OURS = ("bmt_explicit", "bmt_wrapper", "bmt_wrapper_budget", "bmt_engine", "bmt_wrapper_tp2",
        "bmt_wrapper_disk", "bmt_wrapper_pp2", *EP_SIZES)
