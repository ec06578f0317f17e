"""Expert parallelism in the one-liner: ``BMTrainModelWrapper(model, ep_size=E)`` (or a mesh dim "ep").

The pass (``passes/experts.py``) finds the MoE layers; here each EP rank keeps its ``num_experts / E``
experts of each layer (rank 0's values: every rank takes its slice of them) and its experts module runs
through ``runtime/experts.py`` (tokens dispatched to their owners and combined back). The plan then lays
the kept experts out in buffers of their own, ZeRO-3 sharded over the ranks owning the same experts
(``FlatBufferSpec.ep_split``); everything else is sharded over every rank as without EP.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from .. import passes
from ..base.expert_plan import ExpertPlan, MoELayer
from ..base.plan import WrapPlan
from ..base.tp_plan import TensorParallelPlan
from ..errors import ExpertParallelError, PlanError
from ..job.distributed import get_state
from ..runtime.comm import Communicator, ParallelLayout
from ..runtime.experts import expert_parallel_call


def expert_parallel_section(model: nn.Module, layout: ParallelLayout, plan: WrapPlan | None,
                            tp: TensorParallelPlan | None = None,
                            capacity_factor: float | None = None) -> ExpertPlan | None:
    """The plan's experts section for this job: ``plan=``'s own or the pass's (every rank runs it, so its
    errors come alike on every rank, before the model changes); None without expert parallelism. ``tp``
    (the TP section) may split the dense parts, never an expert weight; ``capacity_factor``
    (``ep_capacity_factor=``) is the section's, None dropless."""
    given = plan.experts if isinstance(plan, WrapPlan) else None
    if capacity_factor is not None and (isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float))
                                        or not 0 < capacity_factor < float("inf")):
        raise ExpertParallelError(f"ep_capacity_factor must be a positive number (each expert takes at most "
                                  f"ceil(factor x tokens x k / experts) pairs) or None (dropless), got "
                                  f"{capacity_factor!r}")
    if layout.ep_size == 1:
        if capacity_factor is not None:
            raise ExpertParallelError(f"ep_capacity_factor={capacity_factor!r} caps what each expert takes under "
                                      "expert parallelism: give ep_size= (or a mesh dim 'ep'), or drop it")
        if given is not None and given.ep_size > 1:
            raise PlanError(f"plan= was made for ep_size={given.ep_size}; this job wraps without expert "
                            "parallelism: pass the same ep_size=, or make the plan again")
        return None
    if layout.pp_size > 1:
        raise ExpertParallelError(f"ep_size={layout.ep_size} with {layout.describe()}: expert parallelism beside "
                                  "pipeline parallelism is not built yet; wrap without pp_size")
    if tp is not None and tp.sequence is not None and tp.sequence.enabled:
        # TP peers would route different parts of the sequence: their experts' gradients would be parts.
        raise ExpertParallelError(f"ep_size={layout.ep_size} with sequence_parallel=True: expert parallelism "
                                  "beside sequence parallelism is not built yet; wrap without sequence_parallel")
    if given is not None:
        if given.ep_size != layout.ep_size:
            raise PlanError(f"plan= was made for ep_size={given.ep_size}, this job wraps with ep_size="
                            f"{layout.ep_size}; make the plan again for this size")
        section = given
    elif plan is not None:
        raise PlanError("plan= has no experts section: use model.plan of a model wrapped with ep_size=")
    else:
        section = passes.plan_experts(model, layout.ep_size, layout.mesh.shard)
    passes.check_tp_split(section, tp)
    section.capacity_factor = None if capacity_factor is None else float(capacity_factor)
    named = [la.experts for la in section.layers
             if la.layout == "list" and not isinstance(model.get_submodule(la.experts), nn.ModuleList)]
    if named:
        raise ExpertParallelError(f"ep_size={layout.ep_size}: {named[0]} holds its experts in a ModuleDict; expert "
                                  "parallelism splits packed 3-D expert weights or a ModuleList of experts (whose "
                                  "order numbers them): use a ModuleList, or wrap without ep_size")
    return section


def keep_own_list_experts(model: nn.Module, section: ExpertPlan, layout: ParallelLayout) -> None:
    """Each list of experts keeps this EP rank's (rank 0's values), numbered from 0 as the plan names them on
    every rank; before planning, so rank 0 plans what every rank holds. ``name_list_experts`` gives them
    their own numbers back once the plan is applied."""
    for layer in section.layers:
        if layer.layout != "list":
            continue
        experts = model.get_submodule(layer.experts)
        for name, p in experts.named_parameters():  # every rank takes part in each expert's broadcast
            with torch.no_grad():
                p.copy_(_from_rank0(p.detach(), f"{layer.experts}.{name}"))
        owned = layer.owned(layout.ep_rank, layout.ep_size)
        mine = list(experts.children())[owned.start:owned.stop]
        experts._modules = dict(zip(map(str, range(len(mine))), mine, strict=True))
        experts.__class__ = _own_experts_class(type(experts))


def name_list_experts(model: nn.Module, section: ExpertPlan, layout: ParallelLayout) -> None:
    """After the plan is applied: each list's experts under their own numbers (rank 1 of 2 holds experts
    ``E/2 ..`` under those names), as ``named_parameters()`` names the originals; marked for the readers
    (``job/tp_values.list_expert_names``)."""
    for layer in section.layers:
        if layer.layout == "list":
            experts = model.get_submodule(layer.experts)
            start = layer.owned(layout.ep_rank, layout.ep_size).start
            mine = list(experts._modules.values())
            experts._modules = {str(start + j): m for j, m in enumerate(mine)}
            for j, m in enumerate(mine):  # where each one sits, so the readers name its peers on other EP ranks
                for suffix, p in m.named_parameters():
                    p._bmt_list_expert = (start + j, len(mine), suffix)
            experts._bmt_ep_list = True  # its state dict holds every EP rank's experts (wrapping/sharded_module.py)


class _OwnExperts(nn.ModuleList):
    """A list holding one EP rank's experts under their own numbers: ``self[i]`` is its i-th, the index its
    forward receives (local expert indices), as iteration and ``len`` already are."""

    def __getitem__(self, idx: Any) -> Any:
        if isinstance(idx, int):
            return list(self._modules.values())[idx]
        return super().__getitem__(idx)


_OWN_CLASSES: dict[type, type] = {}


def _own_experts_class(cls: type) -> type:
    """``cls`` with ``_OwnExperts``' indexing (one subclass per class, so isinstance checks still hold)."""
    if cls not in _OWN_CLASSES:
        _OWN_CLASSES[cls] = type(cls.__name__, (_OwnExperts, cls), {"__module__": cls.__module__})
    return _OWN_CLASSES[cls]


def apply_expert_parallel(model: nn.Module, section: ExpertPlan, layout: ParallelLayout) -> None:
    """Keep this EP rank's experts of each layer (rank 0's values) and route each experts module's calls
    through the EP ranks; before ``apply_plan``, which lays the kept experts out."""
    assert layout.ep is not None
    for layer in section.layers:
        experts = model.get_submodule(layer.experts)
        owned = layer.owned(layout.ep_rank, layout.ep_size)
        for name, p in list(experts.named_parameters(recurse=False)):  # packed (a list kept its own already)
            full = _from_rank0(p.detach(), f"{layer.experts}.{name}")
            setattr(experts, name, nn.Parameter(full[owned.start:owned.stop].clone(), requires_grad=p.requires_grad))
        for attr in layer.counts:  # its forward sizes its work by them: this rank's share
            setattr(experts, attr, len(owned))
        _route(experts, layer, layout.ep, section)


def _from_rank0(p: torch.Tensor, name: str) -> torch.Tensor:
    """``p`` with rank 0's values (every rank keeps a different slice: the shards' own broadcast from rank 0
    does not reach them); a meta tensor stays meta (``init_parameters`` fills the slices later)."""
    state = get_state()
    if p.is_meta or state.world_size == 1:
        return p
    flat = p.contiguous().view(-1).clone()
    state.comm.broadcast(flat, 0, label=f"{name} experts")
    return flat.view(p.shape)


def _route(experts: nn.Module, layer: MoELayer, comm: Communicator, section: ExpertPlan) -> None:
    """Make ``experts``' forward the EP call, running its own forward on the tokens each rank receives (each
    expert at most the section's capacity of them)."""
    local = experts.forward

    def forward(self: nn.Module, hidden: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs:
            raise ExpertParallelError(f"{layer.experts} was called with more than (tokens, indices, weights) "
                                      "under ep_size=: the plan's probe saw only those")
        return expert_parallel_call(local, hidden, indices, weights, comm, layer.num_experts, layer.experts,
                                    section.capacity(layer, hidden.shape[0]))

    experts.forward = types.MethodType(forward, experts)
