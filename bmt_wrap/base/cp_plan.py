"""Context parallelism's split of a sequence, pure: which tokens each CP rank holds, and the labels and token
count that keep the loss the whole sequence's (docs/design.md, "Context parallelism").

Load-balanced under causal masks (Megatron CP, torchtitan): the sequence is cut into 2C equal chunks and CP
rank i holds chunks i and 2C-1-i, so every rank's queries see about as many keys. A token's *index* (its
place in the sequence) orders the causal mask; its *position* (rotary angle) is whatever ``position_ids``
says, split the same way. Labels are shifted on the whole sequence before the split, so the label of a
chunk's last token is the first token of the next chunk, which another rank holds.
"""

from __future__ import annotations

import torch

from ..errors import ContextParallelError

#: transformers' and torch's cross-entropy ``ignore_index``.
IGNORE_INDEX = -100


def local_indices(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The sequence indices CP rank ``cp_rank`` holds, in its local order: chunks ``cp_rank`` and
    ``2C-1-cp_rank`` of ``2C`` equal chunks."""
    if not isinstance(cp_size, int) or cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ContextParallelError(f"cp_rank {cp_rank!r} must be in [0, cp_size) with cp_size {cp_size!r} >= 1")
    chunks = 2 * cp_size
    if seq_len % chunks:
        raise ContextParallelError(
            f"a sequence of {seq_len} tokens does not divide into 2 x cp_size = {chunks} equal chunks (context "
            f"parallelism's load-balanced split): pad it to a multiple of {chunks} (tokenizer(..., "
            f"pad_to_multiple_of={chunks}), right padding with attention_mask 0 and labels {IGNORE_INDEX}: "
            "exact for a causal model, whose real tokens never see later ones)")
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
