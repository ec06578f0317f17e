"""Apply a plan's tensor-parallel section in place: slice each split module's parameters to this TP rank,
mark them as BMTrain marks TP parameters, give the module a forward with the TP collectives, and set the
head counts its parent reshapes with. Runs before ZeRO wrapping, which then shards over the dp group.

The model's own forward still runs (never a traced graph): only the split modules' forwards change.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import passes
from ..base._compat import pytree
from ..base.plan import WrapPlan
from ..base.tp_plan import TensorParallelPlan, TPEntry
from ..errors import PlanError
from ..job.tp_inputs import check_tp_inputs_agree
from ..runtime.comm import Communicator, ParallelLayout
from ..runtime.tp_marks import mark_tp, tp_slice
from ..runtime.tp_ops import copy_to_tp, gather_from_tp, reduce_from_tp, reduce_scatter_to_tp, scatter_to_tp
from .compiled import never_traced
from .sequence_parallel import apply_sequence_parallel


def tensor_parallel_section(model: nn.Module, discovery: passes.Discovery,
                            layout: ParallelLayout | None, plan: WrapPlan | None,
                            tp_plan: dict[str, str] | None, sequence_parallel: bool = False
                            ) -> TensorParallelPlan | None:
    """The plan's TP section: ``plan=``'s own, or the pass's for this model (with its sequence-parallel
    section when ``sequence_parallel``); None without TP."""
    given = plan.tensor_parallel if isinstance(plan, WrapPlan) else None
    if layout is None:
        if given is not None:
            raise PlanError(f"plan= was made for tp_size={given.tp_size}; this job wraps without tensor "
                            "parallelism: pass the same tp_size=, or make the plan again")
        if tp_plan is not None:  # nothing to split over one rank, but a wrong name is still an error
            passes.plan_tensor_parallel(model, 1, discovery, tp_plan)
        return None
    if given is not None:
        if given.tp_size != layout.tp_size:
            raise PlanError(f"plan= was made for tp_size={given.tp_size}, this job wraps with tp_size="
                            f"{layout.tp_size}; make the plan again for this size")
        passes.refuse_outside_reads(model, given)
        return given
    if plan is not None:
        raise PlanError("plan= has no tensor_parallel section: use model.plan of a model wrapped with TP")
    tp = passes.plan_tensor_parallel(model, layout.tp_size, discovery, tp_plan)
    if sequence_parallel:
        tp.sequence = passes.plan_sequence_parallel(model, tp, discovery)
    return tp


def guard_tp_inputs(model: nn.Module) -> None:
    """Refuse, on every rank of the TP group, a forward whose tensors differ between TP peers (each peer
    computes part of one batch: different batches would mix two computations without an error)."""
    def check(module: nn.Module, args: tuple, kwargs: dict) -> None:
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        check_tp_inputs_agree(tensors, f"{type(module).__name__}.forward's inputs")

    model.register_forward_pre_hook(never_traced(check), with_kwargs=True, prepend=True)


def apply_tensor_parallel(model: nn.Module, tp: TensorParallelPlan, comm: Communicator) -> None:
    """Split ``model`` per ``tp`` for TP rank ``comm.rank`` of ``comm.world_size`` (= ``tp.tp_size``)."""
    modules = dict(model.named_modules())
    replaced: dict[int, nn.Parameter] = {}  # a tied parameter is sliced once and stays tied
    for entry in tp.entries:
        module = modules[entry.module]
        for name, dim in entry.split_dims.items():
            old = getattr(module, name)
            if id(old) not in replaced:
                replaced[id(old)] = split_parameter(old, dim, comm.rank, comm.world_size, entry.parts)
            setattr(module, name, replaced[id(old)])
        module._bmt_tp = _TPState(comm, entry)
        module.forward = types.MethodType(_FORWARDS[entry.style], module)
    for head in tp.heads:
        setattr(modules[head.module], head.attribute, head.local)
    if tp.sequence is not None and tp.sequence.enabled:
        apply_sequence_parallel(model, tp.sequence, comm)


def tp_split(module: nn.Module) -> tuple[str, Communicator] | None:
    """How ``apply_tensor_parallel`` split ``module``: its style and TP group, or None if it did not."""
    state = getattr(module, "_bmt_tp", None)
    return (state.style, state.comm) if state is not None else None


def split_parameter(param: nn.Parameter, dim: int, rank: int, size: int, parts: int = 1) -> nn.Parameter:
    """This rank's slice of ``param`` along ``dim`` (with ``parts`` > 1: of each block, ``tp_slice``), carrying
    BMTrain's TP attributes (the full shape, the blocks)."""
    local = nn.Parameter(tp_slice(param.detach(), dim, rank, size, parts).clone(),
                         requires_grad=param.requires_grad)
    mark_tp(local, dim, size, parts)
    return local


class _TPState:
    """What a split module's forward needs: the TP communicator, and an embedding's row range."""

    def __init__(self, comm: Communicator, entry: TPEntry) -> None:
        self.comm, self.style, self.kind = comm, entry.style, entry.kind
        self.sequence: Any = None  # a SequenceState where sequence parallelism moves this module's activations
        rows = entry.full_shapes["weight"][0] // comm.world_size
        self.rows = (comm.rank * rows, (comm.rank + 1) * rows)

    def __deepcopy__(self, memo: dict[int, Any]) -> _TPState:
        return self  # a communicator is not copied with the module (meta skeletons, reference copies)


def _matmul(self: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The local product: ``nn.Linear``'s, or transformers' ``Conv1D``'s (weight ``[in, out]``), as each does."""
    if self._bmt_tp.kind != "conv1d":
        return F.linear(x, self.weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    out = flat @ self.weight if bias is None else torch.addmm(bias, flat, self.weight)
    return out.view(*x.shape[:-1], out.shape[-1])


def _on_parts(self: nn.Module) -> bool:
    return self._bmt_tp.sequence is not None and self._bmt_tp.sequence.active


def _colwise(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # Under sequence parallelism the input was gathered whole, and that gather's backward sums its gradient.
    return _matmul(self, x if _on_parts(self) else copy_to_tp(x, self._bmt_tp.comm), self.bias)


def _colwise_gather(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return gather_from_tp(_colwise(self, x), self._bmt_tp.comm, dim=-1)


def _rowwise(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # The bias is added once, after the sum: each rank's partial product has none.
    y = _matmul(self, x, None)
    if _on_parts(self):
        y = reduce_scatter_to_tp(y, self._bmt_tp.comm, self._bmt_tp.sequence.dim)
    else:
        y = reduce_from_tp(y, self._bmt_tp.comm)
    return y if self.bias is None else y + self.bias


def _rowwise_split_input(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _rowwise(self, scatter_to_tp(x, self._bmt_tp.comm, dim=-1))


def _vocab_embedding(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    # Tokens outside this rank's rows look up row 0 and are zeroed; the sum over TP ranks is the full lookup.
    # Each rank's rows get gradient only from its own tokens (BMTrain's VPEmbedding: docs/migration.md).
    lo, hi = self._bmt_tp.rows
    outside = (ids < lo) | (ids >= hi)
    out = F.embedding((ids - lo).masked_fill(outside, 0), self.weight, None, self.max_norm, self.norm_type,
                      self.scale_grad_by_freq, self.sparse)
    return reduce_from_tp(out.masked_fill(outside.unsqueeze(-1), 0.0), self._bmt_tp.comm)


_FORWARDS = {"colwise": _colwise, "colwise_gather": _colwise_gather, "rowwise": _rowwise,
             "rowwise_split_input": _rowwise_split_input, "vocab_embedding": _vocab_embedding}
