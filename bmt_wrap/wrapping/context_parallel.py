"""Context parallelism in the one-liner (``cp_size=C``), for transformers models whose attentions call
transformers' attention interface (docs/design.md, "Context parallelism").

Applying registers one attention function with transformers (``AttentionInterface``, with SDPA's mask
builder) and selects it; hooks on the root split each training call's inputs (``base/cp_plan.py``): the
sequence tensors to this rank's load-balanced part, ``position_ids`` (whole-sequence positions, so rotary
angles are the global ones), the padding mask, labels shifted on the whole sequence (``shift_labels=``) with
the whole batch's token count (``num_items_in_batch=``). The split travels to each attention as two tensor
keyword arguments the model's forward passes down (``bmt_cp_index``: the local tokens' sequence indices,
``bmt_cp_keys``: their padding mask), so a checkpointed block's recompute replays them with its own call.
The loss the model returns is then this rank's part, and ``slice_loss`` makes it the slice's. CP peers
must be given the same batch: one all-reduce of a digest per call checks it (a sampler sharded over the
world instead of the data-parallel ranks would otherwise train on a mix of sequences without an error).

Without gradients (``generate()``, evaluation) nothing is split: every CP rank runs the whole sequence with
transformers' SDPA, as one process would.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ..base._compat import is_fake
from ..base.cp_plan import check_padding_mask, count_items, local_indices, shift_labels, split_sequence
from ..base.mesh import MeshLayout
from ..errors import ContextParallelError, UnsupportedError
from ..job.tp_inputs import digests
from ..runtime.comm import Communicator
from ..runtime.context_parallel import METHODS, context_parallel_attention, slice_loss
from .compiled import never_traced

#: The name the attention function is registered under with transformers.
CP_ATTENTION = "bmt_wrap_cp"
_INDEX, _KEYS = "bmt_cp_index", "bmt_cp_keys"


def _capturing(t: torch.Tensor) -> bool:
    """True while the first call is captured on meta or fake tensors (no communication then)."""
    return t.is_meta or is_fake(t) or torch.compiler.is_exporting()


def _cp_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: over the whole sequence across the CP ranks for a split call, else
    transformers' SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    index, keys = kwargs.pop(_INDEX, None), kwargs.pop(_KEYS, None)
    if index is None or _capturing(query):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if dropout:
        raise ContextParallelError(f"{type(module).__name__} drops attention probabilities (p={dropout}); context "
                                   "parallelism does not implement attention dropout: set the config's "
                                   "attention_dropout to 0, or leave cp_size out")
    comm, method = module._bmt_cp
    out = context_parallel_attention(query, key, value, comm, token_index=index, key_mask=keys,
                                     causal=getattr(module, "is_causal", True), scale=scaling,
                                     window=kwargs.get("sliding_window"), method=method, label="cp attention")
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(CP_ATTENTION, _cp_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(CP_ATTENTION, sdpa_mask)  # the unsplit calls' masks are SDPA's


def _attentions(model: nn.Module) -> list[nn.Module]:
    """The modules that call transformers' attention interface (they read ``config._attn_implementation``)."""
    return [m for m in model.modules() if m is not model and hasattr(m, "config") and hasattr(m, "is_causal")
            and any(isinstance(c, nn.Linear) for c in m.children())]


def _split_call(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """The root pre-hook: this rank's part of a training call's sequence (nothing without gradients)."""
    if not torch.is_grad_enabled():
        return None
    comm: Communicator = model._bmt_cp_comm
    cp, rank = comm.world_size, comm.rank
    signature = model._bmt_cp_signature
    call = dict(signature.bind_partial(*args, **kwargs).arguments)
    for name, param in signature.parameters.items():  # the forward's **kwargs become keywords again
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            call.update(call.pop(name, {}))
    tokens = call.get("input_ids") if call.get("input_ids") is not None else call.get("inputs_embeds")
    if tokens is None:
        raise ContextParallelError(f"{type(model).__name__} was called without input_ids or inputs_embeds: context "
                                   "parallelism splits their sequence dimension (dim 1)")
    if _capturing(tokens):  # the first call's capture on a meta copy: shapes only, no split
        return None
    given = [call[n] for n in ("input_ids", "inputs_embeds", "attention_mask", "position_ids", "labels")
             if isinstance(call.get(n), torch.Tensor)]
    seen = digests(comm, given, "cp input digests")
    if len(set(seen)) > 1:  # every rank sees the same table: all raise
        raise ContextParallelError(
            f"the inputs differ between the ranks of one context-parallel group (CP ranks "
            f"{[r for r, d in enumerate(seen) if d != seen[0]]} differ from CP rank 0): CP peers must get the same "
            "batch, which they split between them. Shard the data over the data-parallel ranks: "
            "DistributedSampler(dataset, num_replicas=bmt.data_parallel_size(), rank=bmt.data_parallel_rank())")
    batch, seq = tokens.shape[:2]
    sequence = getattr(model, "_bmt_sequence", None)  # sequence_parallel=True's state, over the TP ranks
    index = local_indices(seq, cp, rank, sequence.comm.world_size if sequence is not None else 1).to(tokens.device)
    mask = call.get("attention_mask")
    keys = torch.ones(batch, seq, dtype=torch.bool, device=tokens.device) if mask is None else check_padding_mask(mask)
    positions = call.get("position_ids")
    if positions is None:
        positions = torch.arange(seq, device=tokens.device).unsqueeze(0).expand(batch, seq)
    for name in ("input_ids", "inputs_embeds", "attention_mask", "token_type_ids"):
        if call.get(name) is not None:
            call[name] = call[name].index_select(1, index)
    call["position_ids"] = positions.index_select(positions.dim() - 1, index)
    labels = call.get("labels")
    if labels is not None:
        shifted = shift_labels(labels)
        call.setdefault("num_items_in_batch", count_items(shifted))  # a Trainer's count over accumulation wins
        call["shift_labels"] = split_sequence(shifted, cp, rank)
        call["labels"] = split_sequence(labels, cp, rank)
    call[_INDEX], call[_KEYS] = index, keys.index_select(1, index)
    model._bmt_cp_split = labels is not None
    return (), call


def _whole_loss(model: nn.Module, args: tuple, output: Any) -> Any:
    """The root post-hook: the slice's loss from this rank's part."""
    if not getattr(model, "_bmt_cp_split", False):
        return None
    model._bmt_cp_split = False
    loss = getattr(output, "loss", None)
    if loss is not None:
        output["loss"] = slice_loss(loss, model._bmt_cp_comm)
    return output


def check_context_parallel(model: nn.Module, mesh: MeshLayout, method: str) -> None:
    """Raise before anything changes when ``model`` cannot be split over ``mesh``'s CP ranks as asked."""
    if method not in METHODS:
        raise ContextParallelError(f"cp_method={method!r}: use one of {METHODS}")
    others = [f"pp {mesh.pp}"] if mesh.pp > 1 else []
    others += [f"ep {mesh.ep}"] if mesh.ep > 1 else []
    if others:
        raise UnsupportedError(f"cp_size={mesh.cp} beside {', '.join(others)} is not implemented yet (#52): context "
                               "parallelism runs with data parallelism (ZeRO-3, HSDP) and tensor parallelism only "
                               "for now")
    if getattr(model, "config", None) is None or not hasattr(model, "set_attn_implementation"):
        raise UnsupportedError(f"cp_size= splits transformers models whose attentions call transformers' attention "
                               f"interface; {type(model).__name__} is not one. Leave cp_size out, or call "
                               "bmt_wrap.runtime.context_parallel.context_parallel_attention in its attention")
    if not _attentions(model):
        raise UnsupportedError(f"cp_size=: no attention module of {type(model).__name__} reads its config's "
                               "attention implementation; leave cp_size out for this model")


def apply_context_parallel(model: nn.Module, comm: Communicator, method: str = "auto") -> str:
    """Make ``model``'s training calls split their sequences over ``comm``'s CP ranks (checked first by
    ``check_context_parallel``); returns the plan's note saying where CP applies."""
    attentions = _attentions(model)
    _register()
    model.set_attn_implementation(CP_ATTENTION)
    for module in attentions:
        module._bmt_cp = (comm, method)
    model._bmt_cp_comm = comm
    model._bmt_cp_signature = inspect.signature(model.forward)
    model.register_forward_pre_hook(never_traced(_split_call), with_kwargs=True, prepend=True)
    model.register_forward_hook(never_traced(_whole_loss))
    names = {id(m): n for n, m in model.named_modules()}
    where = [names[id(m)] for m in attentions]
    return (f"context parallelism over {comm.world_size} ranks ({method}): each training call's sequence is split "
            f"(chunks i and 2C-1-i); attention across the ranks in {len(where)} module(s) ({', '.join(where[:3])}"
            f"{' ...' if len(where) > 3 else ''}); everything else runs on this rank's tokens")
