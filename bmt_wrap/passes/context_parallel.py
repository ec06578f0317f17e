"""Context parallelism's plan, pure: the attentions a ``cp_size=C`` wrap splits, which method "auto" picks
for their heads, and one rank's call with its sequence cut C ways for the activation count
(``base/cp_plan.ContextParallelPlan``; docs/design.md, "Context parallelism").

The attentions are those of a transformers model (what ``cp_size=`` splits: ``wrapping/context_parallel.py``),
so their heads, KV heads, head dim and count come from its config.
"""

from __future__ import annotations

import torch
from torch import nn

from ..base.cp_plan import ContextParallelPlan
from ..base.dtypes import dtype_name
from ..errors import ContextParallelError
from .capture import Call


def resolve_method(method: str, heads: int, cp_size: int) -> str:
    """What ``cp_method`` runs for ``heads`` query heads: "auto" is Ulysses with at least C heads, else the ring
    (``runtime/context_parallel.context_parallel_attention``)."""
    if method not in ("auto", "ulysses", "ring"):
        raise ContextParallelError(f"cp_method={method!r}: use one of ('auto', 'ulysses', 'ring')")
    if method == "auto":
        return "ulysses" if heads >= cp_size else "ring"
    return method


def _sequence(call: Call) -> tuple[int, int]:
    """(batch, sequence length) of the call's token ids (or embeddings)."""
    args, kwargs = call
    tokens = kwargs.get("input_ids", kwargs.get("inputs_embeds", args[0] if args else None))
    if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
        raise ContextParallelError("context parallelism's plan needs the call's input_ids (or inputs_embeds) "
                                   "[batch, seq, ...]: give e.g. --input input_ids=int64[1,4096]")
    return tokens.shape[0], tokens.shape[1]


def local_call(call: Call, cp_size: int) -> Call:
    """``call`` as one CP rank runs it: every tensor whose dim 1 is the sequence holds ``seq / C`` tokens, as
    meta tensors (the split's sizes; which tokens does not change the bytes)."""
    _, seq = _sequence(call)
    if seq % (2 * cp_size):
        raise ContextParallelError(f"a sequence of {seq} tokens does not divide into 2 x cp_size = {2 * cp_size} "
                                   "equal chunks: give a multiple of it")
    return with_sequence(call, seq // cp_size)


def plan_context_parallel(model: nn.Module, cp_size: int, method: str = "auto", call: Call | None = None,
                          activations: int | None = None, recomputed: int = 0) -> ContextParallelPlan:
    """The CP section for ``model`` at ``cp_size`` (its sequence from ``call``, one rank's whole batch;
    ``activations``: a rank's activation bytes counted on ``local_call``; ``recomputed``: attention calls
    inside checkpointed blocks)."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if config is None or not heads:
        raise ContextParallelError(f"{type(model).__name__} has no transformers config with num_attention_heads: "
                                   "context parallelism splits transformers models' attentions (leave cp_size out)")
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layers = config.num_hidden_layers
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    batch, seq = _sequence(call) if call is not None else (None, None)
    padded = call is None or call[1].get("attention_mask") is not None
    return ContextParallelPlan(cp_size=cp_size, method=resolve_method(method, heads, cp_size), layers=layers,
                               heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype_name(dtype),
                               recomputed=min(recomputed, layers), batch=batch, seq_len=seq,
                               activations=activations, padded=padded)


def with_sequence(call: Call, seq_len: int) -> Call:
    """``call`` with ``seq_len`` tokens in every tensor whose dim 1 is the sequence (meta tensors, for a
    capture; ``plan --memory --grow-seq``)."""
    _, seq = _sequence(call)

    def grow(x: object) -> object:
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] == seq:
            return torch.empty((x.shape[0], seq_len, *x.shape[2:]), dtype=x.dtype, device="meta")
        return x

    args, kwargs = call
    return tuple(grow(a) for a in args), {k: grow(v) for k, v in kwargs.items()}
