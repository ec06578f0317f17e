"""Context parallelism's executor: attention over the whole sequence when each CP rank holds part of it, with
autograd, on the one ``Communicator`` (gloo on CPU, so no GPU-only kernel is needed; docs/design.md,
"Context parallelism").

Every rank holds its tokens' q, k, v ([batch, heads, local tokens, head dim]; k and v may have fewer heads,
GQA) and each token's index in the whole sequence (``base/cp_plan.local_indices``). Masks are rebuilt from
those indices (causal: a key is seen when its index is not after the query's; a sliding window: and fewer
than ``window`` tokens before it) and a [batch, local tokens] key-padding mask, so any split works, the
load-balanced one included. Two methods:

- **Ulysses** (DeepSpeed): one all-to-all turns the sequence split into a head split, each rank attends its
  heads over every token (torch's SDPA), and one all-to-all turns it back. Heads need not divide by C (rank p
  takes ``H // C + (p < H % C)``); under GQA whole groups move together, and with fewer KV heads than ranks
  K/V are repeated to the query heads first. It needs at least C query heads. Without padding or a window no
  mask is built (SDPA's ``is_causal`` on the tokens in sequence order), so its memory is linear in S.
- **Ring**: K/V travel around the CP ranks (C-1 neighbour transfers, the next one in flight while this one's
  block is computed); each rank merges the blocks' softmaxes by their log-sum-exps (online softmax). The
  backward is the same ring again, carrying each block's dK/dV along until it is back with its owner.

A neighbour transfer is an ``all_to_all`` with one non-empty piece (to the next rank, from the previous): on
gloo every op of a process runs on one FIFO worker behind an order check, so a ``send`` and a ``recv`` posted
as two ops would wait on each other across ranks; one op posts both.

A query row with no key to see (a padded query whose keys are all padding) gets zeros and zero gradients,
as torch's SDPA gives.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..errors import ContextParallelError
from .comm import Communicator

METHODS = ("auto", "ulysses", "ring")


# ---- what every rank needs to know about the others' tokens ---------------------------------------------------
def _gather_tokens(comm: Communicator, token_index: torch.Tensor, key_mask: torch.Tensor | None, batch: int,
                   label: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Every CP rank's token indices [C, local] and key masks [C, batch, local] (one all-gather)."""
    local = token_index.numel()
    mine = torch.empty(1 + batch, local, dtype=torch.int64, device=token_index.device)
    mine[0] = token_index
    mine[1:] = 1 if key_mask is None else key_mask.to(torch.int64)
    if comm.world_size == 1:
        every = mine.unsqueeze(0)
    else:
        every = mine.new_empty(comm.world_size, 1 + batch, local)
        comm.all_gather_into(every.view(-1), mine.view(-1), label=f"{label} token indices")
    return every[:, 0], every[:, 1:].bool()


def _allowed(q_index: torch.Tensor, k_index: torch.Tensor, k_mask: torch.Tensor, causal: bool,
             window: int | None = None) -> torch.Tensor:
    """Which keys each query sees: [batch, 1, queries, keys]. ``window``: a causal sliding window, keys less
    than ``window`` tokens back (transformers' ``sliding_window``)."""
    allowed = k_mask[:, None, None, :]
    back = q_index[:, None] - k_index[None, :]
    if causal:
        allowed = allowed & (back >= 0)[None, None]
    if window is not None:
        allowed = allowed & (back < window)[None, None]
    return allowed


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, token_index: torch.Tensor,
           key_mask: torch.Tensor | None, causal: bool = True, window: int | None = None) -> None:
    if window is not None and (not causal or not isinstance(window, int) or window < 1):
        raise ContextParallelError(f"a sliding window ({window!r}) must be a positive int on a causal attention")
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ContextParallelError(f"context-parallel attention takes q [batch, heads, tokens, dim] and k, v of one "
                                   f"shape [batch, kv heads, tokens, dim]; got q {tuple(q.shape)}, k "
                                   f"{tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ContextParallelError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    if token_index.shape != (q.shape[2],):
        raise ContextParallelError(f"token_index must give each of the {q.shape[2]} local tokens its index in the "
                                   f"whole sequence (shape [{q.shape[2]}]), got {tuple(token_index.shape)}")
    if key_mask is not None and key_mask.shape != (q.shape[0], q.shape[2]):
        raise ContextParallelError(f"key_mask must be [batch, local tokens] = [{q.shape[0]}, {q.shape[2]}], got "
                                   f"{tuple(key_mask.shape)}")


# ---- Ulysses ---------------------------------------------------------------------------------------------------
def _even(count: int, ranks: int) -> list[int]:
    """``count`` heads over ``ranks``, the first ``count % ranks`` ranks one more."""
    return [count // ranks + (p < count % ranks) for p in range(ranks)]


def _seq_to_heads(x: torch.Tensor, comm: Communicator, heads: list[int], label: str) -> torch.Tensor:
    """[B, H, local, D] split by sequence -> [B, heads[rank], C x local, D] split by heads (rank-major tokens)."""
    b, _, local, d = x.shape
    row = b * local * d
    mine = heads[comm.rank]
    out = x.new_empty(comm.world_size * mine * row)
    comm.all_to_all(out, x.transpose(0, 1).contiguous().view(-1), [mine * row] * comm.world_size,
                    [h * row for h in heads], label=label)
    return out.view(comm.world_size, mine, b, local, d).permute(2, 1, 0, 3, 4).reshape(b, mine, -1, d)


def _heads_to_seq(y: torch.Tensor, comm: Communicator, heads: list[int], label: str) -> torch.Tensor:
    """The inverse of ``_seq_to_heads``."""
    b, mine, whole, d = y.shape
    local = whole // comm.world_size
    row = b * local * d
    send = y.view(b, mine, comm.world_size, local, d).permute(2, 1, 0, 3, 4).contiguous().view(-1)
    out = y.new_empty(sum(heads) * row)
    comm.all_to_all(out, send, [h * row for h in heads], [mine * row] * comm.world_size, label=label)
    return out.view(sum(heads), b, local, d).transpose(0, 1)


class _SeqToHeads(torch.autograd.Function):
    """``_seq_to_heads`` with its inverse as backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, heads: list[int], label: str) -> torch.Tensor:
        ctx.comm, ctx.heads, ctx.label = comm, heads, label
        return _seq_to_heads(x, comm, heads, label)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _heads_to_seq(grad.contiguous(), ctx.comm, ctx.heads, f"{ctx.label} backward"), None, None, None


class _HeadsToSeq(torch.autograd.Function):
    """``_heads_to_seq`` with its inverse as backward."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, comm: Communicator, heads: list[int], label: str) -> torch.Tensor:
        ctx.comm, ctx.heads, ctx.label = comm, heads, label
        return _heads_to_seq(y.contiguous(), comm, heads, label)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _seq_to_heads(grad.contiguous(), ctx.comm, ctx.heads, f"{ctx.label} backward"), None, None, None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator, *,
                      token_index: torch.Tensor, key_mask: torch.Tensor | None = None, causal: bool = True,
                      scale: float | None = None, window: int | None = None,
                      label: str = "cp attention") -> torch.Tensor:
    """Attention of this rank's queries over every CP rank's keys, by all-to-all over heads (Ulysses)."""
    _check(q, k, v, token_index, key_mask, causal, window)
    ranks, heads, kv_heads = comm.world_size, q.shape[1], k.shape[1]
    if heads < ranks:
        raise ContextParallelError(
            f"Ulysses splits heads over the {ranks} CP ranks, but this attention has {heads} query head(s): use "
            "cp_method='ring' (K/V passed around the ranks), which needs no heads to split")
    group = heads // kv_heads
    if kv_heads < ranks:  # too few to split: each rank gets its query heads' own copy of their K/V heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        kv_heads, group = heads, 1
    kv_split = _even(kv_heads, ranks)
    q_split = [n * group for n in kv_split]  # whole GQA groups move together
    qh = _SeqToHeads.apply(q, comm, q_split, f"{label} q")
    kh = _SeqToHeads.apply(k, comm, kv_split, f"{label} k")
    vh = _SeqToHeads.apply(v, comm, kv_split, f"{label} v")
    every_index, every_mask = _gather_tokens(comm, token_index, key_mask, q.shape[0], label)
    index, mask = every_index.reshape(-1), every_mask.transpose(0, 1).reshape(q.shape[0], -1)
    gqa = qh.shape[1] != kh.shape[1]
    if window is None and bool(mask.all()):  # no padding: SDPA's own causal mask, none materialised
        out = _unmasked(qh, kh, vh, index, causal, scale, gqa)
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=_allowed(index, index, mask, causal, window),
                                             scale=scale, enable_gqa=gqa)
    return _HeadsToSeq.apply(out, comm, q_split, f"{label} out")


def _unmasked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, causal: bool,
              scale: float | None, gqa: bool) -> torch.Tensor:
    """SDPA over the whole sequence without an ``attn_mask``: a [batch, 1, S, S] mask costs S^2 bytes, and
    CPU SDPA turns it into a float bias of 4 x S^2 more, where ``is_causal`` keeps it linear in S. The tokens
    arrive in the load-balanced order (chunks 0, 2C-1, 1, 2C-2, ...), so under a causal mask they are put in
    sequence order first and back after."""
    if not causal:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    order = torch.argsort(index)
    q, k, v = (t.index_select(2, order) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    return out.index_select(2, torch.argsort(order))


# ---- ring ------------------------------------------------------------------------------------------------------
def _to_next(comm: Communicator, send: torch.Tensor, label: str) -> tuple[torch.Tensor, Any]:
    """Post ``send`` to the next CP rank and a receive of the previous rank's (async); (buffer, handle)."""
    n, ranks, rank = send.numel(), comm.world_size, comm.rank
    nxt, prv = (rank + 1) % ranks, (rank - 1) % ranks
    recv = torch.empty_like(send)
    handle = comm.all_to_all(recv, send, [n if p == prv else 0 for p in range(ranks)],
                             [n if p == nxt else 0 for p in range(ranks)], async_op=True, label=label)
    return recv, handle


def _scores(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    return (q @ k.transpose(-1, -2)).mul_(scale).masked_fill_(~allowed, float("-inf"))


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (rows that see no key) as 0, so exp(score - lse) is 0 there, not NaN."""
    return lse.masked_fill(torch.isinf(lse), 0.0)


class _Ring(torch.autograd.Function):
    """Ring attention: forward merges blocks by log-sum-exp; backward recomputes each block's probabilities
    from the final log-sum-exp and passes dK/dV around with K/V."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator,
                every_index: torch.Tensor, every_mask: torch.Tensor, causal: bool, window: int | None,
                scale: float, label: str) -> torch.Tensor:
        work = torch.promote_types(q.dtype, torch.float32)  # half inputs: blocks and merges in fp32
        qw = q.to(work)
        group = q.shape[1] // k.shape[1]
        ranks, rank = comm.world_size, comm.rank
        out = torch.zeros_like(qw)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=work, device=q.device)
        kv = torch.cat([k.reshape(-1), v.reshape(-1)])
        for step in range(ranks):
            owner = (rank - step) % ranks
            if step < ranks - 1:
                incoming, handle = _to_next(comm, kv, f"{label} ring k/v")
            allowed = _allowed(every_index[rank], every_index[owner], every_mask[owner], causal, window)
            if bool(allowed.any()):  # a block the causal mask hides whole costs nothing but its transfer
                kb, vb = (t.view(k.shape).to(work).repeat_interleave(group, 1) for t in kv.chunk(2))
                scores = _scores(qw, kb, allowed, scale)
                block_lse = torch.logsumexp(scores, -1)
                block_out = torch.exp(scores - _finite(block_lse).unsqueeze(-1)) @ vb
                merged = torch.logaddexp(lse, block_lse)
                base = _finite(merged).unsqueeze(-1)
                out = out * torch.exp(lse.unsqueeze(-1) - base) + block_out * torch.exp(block_lse.unsqueeze(-1) - base)
                lse = merged
            if step < ranks - 1:
                handle.wait()
                kv = incoming
        ctx.save_for_backward(q, k, v, out, lse, every_index, every_mask)
        ctx.comm, ctx.causal, ctx.window, ctx.scale, ctx.label = comm, causal, window, scale, label
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, every_index, every_mask = ctx.saved_tensors
        comm, scale, label = ctx.comm, ctx.scale, ctx.label
        work = out.dtype
        qw, dout = q.to(work), grad_out.to(work)
        b, kv_heads, local, d = k.shape
        group = q.shape[1] // kv_heads
        ranks, rank = comm.world_size, comm.rank
        finite = _finite(lse).unsqueeze(-1)
        delta = (dout * out).sum(-1, keepdim=True)  # rowsum(dO * O): the softmax's Jacobian term
        dq = torch.zeros_like(qw)
        kv = torch.cat([k.reshape(-1), v.reshape(-1)])
        dkv = torch.zeros(kv.numel(), dtype=work, device=q.device)  # dK/dV of the block in hand, for its owner
        for step in range(ranks):
            owner = (rank - step) % ranks
            if step < ranks - 1:
                incoming, handle = _to_next(comm, kv, f"{label} ring backward k/v")
            allowed = _allowed(every_index[rank], every_index[owner], every_mask[owner], ctx.causal, ctx.window)
            if bool(allowed.any()):
                kb, vb = (t.view(k.shape).to(work).repeat_interleave(group, 1) for t in kv.chunk(2))
                probs = torch.exp(_scores(qw, kb, allowed, scale) - finite)
                dv = probs.transpose(-1, -2) @ dout
                dscores = probs * (dout @ vb.transpose(-1, -2) - delta)
                dq += (dscores @ kb) * scale
                dk = (dscores.transpose(-1, -2) @ qw) * scale
                # GQA: a K/V head's gradient sums its group of query heads
                dkv += torch.cat([dk.view(b, kv_heads, group, local, d).sum(2).reshape(-1),
                                  dv.view(b, kv_heads, group, local, d).sum(2).reshape(-1)])
            if ranks > 1:  # the block's dK/dV go on with it; after the last step they reach their owner
                dkv, moved = _to_next(comm, dkv, f"{label} ring backward dk/dv")
                moved.wait()
            if step < ranks - 1:
                handle.wait()
                kv = incoming
        dk_own, dv_own = (t.view(k.shape).to(k.dtype) for t in dkv.chunk(2))
        return dq.to(q.dtype), dk_own, dv_own, None, None, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator, *,
                   token_index: torch.Tensor, key_mask: torch.Tensor | None = None, causal: bool = True,
                   scale: float | None = None, window: int | None = None,
                   label: str = "cp attention") -> torch.Tensor:
    """Attention of this rank's queries over every CP rank's keys, by passing K/V around a ring."""
    _check(q, k, v, token_index, key_mask, causal, window)
    every_index, every_mask = _gather_tokens(comm, token_index, key_mask, q.shape[0], label)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _Ring.apply(q, k.contiguous(), v.contiguous(), comm, every_index, every_mask, causal, window, scale,
                       label)


class _SliceLoss(torch.autograd.Function):
    """Sum over the CP group in forward; in backward, this rank's gradient times C (Megatron's ``loss *
    cp_size``), because ZeRO then averages gradients over a group that holds the CP peers too."""

    @staticmethod
    def forward(ctx: Any, part: torch.Tensor, comm: Communicator, label: str) -> torch.Tensor:
        ctx.ranks = comm.world_size
        whole = part.detach().reshape(1).clone()
        if comm.world_size > 1:
            comm.all_reduce(whole, "sum", label=label)
        return whole.view(part.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad * ctx.ranks, None, None


def slice_loss(part: torch.Tensor, comm: Communicator, label: str = "cp loss") -> torch.Tensor:
    """The loss of the whole data slice from this CP rank's part: ``part`` is this rank's tokens' loss sum
    divided by the slice's token count (``cp_plan.count_items``, transformers' ``num_items_in_batch``), so the
    value is the mean over every token of the slice, never a mean of per-rank means. Its gradient is C times
    this rank's part: averaged over the CP peers (as ZeRO averages a group holding them), the peers' parts
    are summed, which is the slice's gradient (docs/design.md's gradient contract)."""
    if part.numel() != 1:
        raise ContextParallelError(f"slice_loss takes a scalar loss, got shape {tuple(part.shape)}")
    return _SliceLoss.apply(part, comm, label)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator, *,
                               token_index: torch.Tensor, key_mask: torch.Tensor | None = None,
                               causal: bool = True, scale: float | None = None, window: int | None = None,
                               method: str = "auto", label: str = "cp attention") -> torch.Tensor:
    """Whole-sequence attention for this CP rank's tokens: Ulysses where there are at least as many query heads
    as CP ranks (``method="auto"``), else the ring; ``method`` forces one."""
    if method not in METHODS:
        raise ContextParallelError(f"cp_method={method!r}: use one of {METHODS}")
    use_ring = method == "ring" or (method == "auto" and q.shape[1] < comm.world_size)
    attend = ring_attention if use_ring else ulysses_attention
    return attend(q, k, v, comm, token_index=token_index, key_mask=key_mask, causal=causal, scale=scale,
                  window=window, label=label)
