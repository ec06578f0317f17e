"""Context parallelism's split of a sequence, pure: which tokens each CP rank holds, and the labels and token
count that keep the loss the whole sequence's (docs/design.md, "Context parallelism").

Load-balanced under causal masks (Megatron CP, torchtitan): the sequence is cut into 2C equal chunks and CP
rank i holds chunks i and 2C-1-i, so every rank's queries see about as many keys. A token's *index* (its
place in the sequence) orders the causal mask; its *position* (rotary angle) is whatever ``position_ids``
says, split the same way. Labels are shifted on the whole sequence before the split, so the label of a
chunk's last token is the first token of the next chunk, which another rank holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ContextParallelError
from .dtypes import itemsize

#: transformers' and torch's cross-entropy ``ignore_index``.
IGNORE_INDEX = -100


def local_indices(seq_len: int, cp_size: int, cp_rank: int, sp_size: int = 1) -> torch.Tensor:
    """The sequence indices CP rank ``cp_rank`` holds, in its local order: chunks ``cp_rank`` and
    ``2C-1-cp_rank`` of ``2C`` equal chunks (``sp_size``: TP ranks sequence parallelism cuts them over again)."""
    if not isinstance(cp_size, int) or cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ContextParallelError(f"cp_rank {cp_rank!r} must be in [0, cp_size) with cp_size {cp_size!r} >= 1")
    chunks = 2 * cp_size
    # Sequence parallelism then cuts a rank's S/C tokens into sp_size equal parts: S a multiple of C x T too.
    multiple = math.lcm(chunks, cp_size * sp_size)
    if seq_len % multiple:
        why = (f"2 x cp_size = {chunks} equal chunks (context parallelism's load-balanced split)" if multiple == chunks
               else f"2 x cp_size = {chunks} equal chunks whose pairs sequence_parallel=True cuts again over "
                    f"tp_size={sp_size} ranks")
        raise ContextParallelError(
            f"a sequence of {seq_len} tokens does not divide into {why}: pad it to a multiple of {multiple} "
            f"(tokenizer(..., pad_to_multiple_of={multiple}), right padding with attention_mask 0 and labels "
            f"{IGNORE_INDEX}: exact for a causal model, whose real tokens never see later ones)")
    c = seq_len // chunks
    first, second = cp_rank * c, (chunks - 1 - cp_rank) * c
    return torch.cat([torch.arange(first, first + c), torch.arange(second, second + c)])


def split_sequence(t: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """``t``'s tokens (along ``dim``) that CP rank ``cp_rank`` holds, in its local order."""
    return t.index_select(dim, local_indices(t.shape[dim], cp_size, cp_rank).to(t.device))


def reassemble(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every CP rank's part (``parts[r]`` is rank r's ``split_sequence``)."""
    cp_size = len(parts)
    seq_len = sum(p.shape[dim] for p in parts)
    shape = list(parts[0].shape)
    shape[dim] = seq_len
    whole = parts[0].new_empty(shape)
    for rank, part in enumerate(parts):
        whole.index_copy_(dim, local_indices(seq_len, cp_size, rank).to(part.device), part)
    return whole


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Labels shifted on the whole sequence (token t predicts token t+1; the last predicts nothing), the same
    length as the input: what transformers' ``ForCausalLMLoss(shift_labels=...)`` takes."""
    return torch.nn.functional.pad(labels[..., 1:], (0, 1), value=ignore_index)


def count_items(shifted: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> int:
    """Tokens the loss averages over in the whole batch (``num_items_in_batch``): every CP rank computes it
    from the whole batch, so the mean is the whole sequence's, never a mean of per-rank means."""
    return int((shifted != ignore_index).sum())


def check_padding_mask(mask: torch.Tensor, what: str = "attention_mask") -> torch.Tensor:
    """``mask`` as a boolean [batch, seq] key-padding mask, or ``ContextParallelError``: context parallelism
    rebuilds causal and padding masks from token indices, so only a 0/1 mask per token can be split exactly."""
    if mask.dim() != 2:
        raise ContextParallelError(
            f"{what} has shape {tuple(mask.shape)}; context parallelism splits a 2-D [batch, seq] padding mask "
            "only (it builds the causal mask itself from each token's index). Pass the 2-D 0/1 mask instead of "
            "a 4-D or custom one")
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        raise ContextParallelError(
            f"{what} holds values other than 0 and 1 (packed-sequence ids or additive biases?); context "
            "parallelism splits a 0/1 padding mask only. Unpack the sequences, or leave cp_size out")
    return mask.bool()


@dataclass
class ContextParallelPlan:
    """The context-parallel section of a plan: the attentions split over ``cp_size`` ranks and what each rank
    holds and sends for them per step (``passes/context_parallel.py`` fills one in; docs/design.md, "Context
    parallelism"). ``batch``/``seq_len``: one rank's call (the CP peers take the same one), None when unknown;
    ``activations``: a rank's activation bytes counted at its ``seq_len / cp_size`` tokens."""

    cp_size: int
    method: str  # "ulysses" or "ring": what "auto" resolves to for these heads
    layers: int  # attention calls per forward
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str  # the attention's q/k/v dtype
    recomputed: int = 0  # of ``layers``, those in checkpointed blocks (their forward runs again in backward)
    batch: int | None = None
    seq_len: int | None = None
    activations: int | None = None
    padded: bool = True  # the call passes an attention_mask (Ulysses then builds the whole sequence's mask)

    def local_tokens(self) -> int | None:
        """Tokens one rank holds of each sequence."""
        return None if self.seq_len is None else self.seq_len // self.cp_size

    def _row(self, heads: int) -> int:
        """Bytes of ``heads`` heads of one rank's local tokens (one of q, k, v or the output)."""
        return (self.batch or 0) * heads * (self.local_tokens() or 0) * self.head_dim * itemsize(self.dtype)

    def exchange(self) -> dict[str, int] | None:
        """Bytes a rank sends per training step for the attentions, by pass (None without a sequence).

        Ulysses: four all-to-alls per call (q, k, v in, the output back), each sending (C-1)/C of the local
        tensor (K/V repeated to the query heads when there are fewer KV heads than ranks); backward the same
        four again. Ring: C-1 K/V transfers of the local K and V in forward; C-1 again in backward and C of
        dK/dV (fp32 for half inputs). Each call also all-gathers the token indices and the key mask
        (``(1 + batch) x local`` int64 to C-1 ranks). A checkpointed block's recompute repeats the forward."""
        if self.seq_len is None or self.batch is None:
            return None
        c = self.cp_size
        index = (1 + self.batch) * (self.local_tokens() or 0) * 8 * (c - 1)
        if self.method == "ulysses":
            kv = self.heads if self.kv_heads < c else self.kv_heads
            moved = (2 * self._row(self.heads) + 2 * self._row(kv)) * (c - 1) // c
            forward, backward = moved + index, moved
        else:
            kv = 2 * self._row(self.kv_heads)
            grad = kv * max(4, itemsize(self.dtype)) // itemsize(self.dtype)
            forward, backward = kv * (c - 1) + index, kv * (c - 1) + grad * c
        forward, backward = forward * self.layers, backward * self.layers
        recompute = (forward // self.layers) * self.recomputed if self.layers else 0
        return {"forward": forward, "backward": backward, "recompute": recompute,
                "step": forward + backward + recompute}

    def attention_bytes(self) -> int:
        """Bytes one attention call holds on a rank beyond what the capture of the local call counts for it
        (its saved q, k, v and output) at a block's backward: Ulysses with padding the received and sent
        copies of q, k, v and the output, the whole sequence's boolean mask [batch, 1, S, S] and the float
        bias CPU SDPA makes of it; without padding the output's copy in the local tokens' layout that the
        output projection saves (SDPA's own saved output is the head-split one, which replaces, byte for
        byte, the local output the capture counts, as the head-split q, k, v replace the local ones), and
        K/V repeated to the query heads below C KV heads. The exchanged copies come and go while the
        attention's forward runs, before the block's MLP saves its larger tensors: they are not held at the
        recompute's end, where a block's backward peaks (benchmarks/context.py: counting them put the plan
        36 MiB a rank over a 2-rank job at 9216 tokens). The ring: the K/V block in hand and in flight, and
        one block's scores and probabilities [batch, heads, local, local] in fp32."""
        if self.seq_len is None or self.batch is None:
            return 0
        local = self.local_tokens() or 0
        if self.method == "ulysses":
            kv = self.heads if self.kv_heads < self.cp_size else self.kv_heads
            if not self.padded:
                return self._row(self.heads) + 2 * (self._row(kv) - self._row(self.kv_heads))
            copy = 2 * self._row(self.heads) + 2 * self._row(kv)
            return 2 * copy + self.batch * self.seq_len ** 2 * (1 + itemsize(self.dtype))
        return 4 * self._row(self.kv_heads) + 3 * self.batch * self.heads * local * local * 4

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ContextParallelPlan:
        """The section as ``dataclasses.asdict`` wrote it (the plan's JSON)."""
        return cls(**raw)

