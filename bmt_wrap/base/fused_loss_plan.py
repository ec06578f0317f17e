"""The fused-loss section of a plan: which projection to the vocabulary feeds which cross-entropy, whether
the pair runs as one chunked op (``fused_loss=True``), why not when it cannot, and the bytes at stake.

Plain dataclass with a JSON round-trip, like the rest of the plan: ``passes/fused_loss.py`` fills one in,
``wrapping/fused_loss.py`` applies it, ``loss/linear_cross_entropy.py`` is the op.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: Logit elements per chunk of the fused op (64 MiB in fp32): 130 rows of a 128,256-word vocabulary.
CHUNK_ELEMENTS = 1 << 24


def chunk_rows(vocab: int) -> int:
    """Rows per chunk of the fused op for a vocabulary of ``vocab`` words (``CHUNK_ELEMENTS`` logits)."""
    return max(1, CHUNK_ELEMENTS // max(1, vocab))


@dataclass
class FusedLossPlan:
    """What the fused-loss pass found in the captured root graph."""

    enabled: bool  # fused_loss=True was asked for
    head: str | None = None  # the projection's module name (an nn.Linear)
    weight: str | None = None  # its weight's parameter name as the graph reads it (a tied embedding's)
    # Where no nn.Linear makes the logits: "F.linear" or "matmul", the product of the hidden states with the
    # parameter ``weight`` in the model's own code (``F.linear(h, self.embed.weight)``, ``h @ W.t()``).
    product: str | None = None
    pending: bool = False  # the root's graph is not captured yet: the first call's capture decides
    loss: str | None = None  # the cross-entropy call found
    steps: list[str] = field(default_factory=list)  # what runs between the two (casts, reshapes, softcapping)
    reason: str | None = None  # why the pair is not fused (None: it is, when enabled)
    vocab: int | None = None
    rows: int | None = None  # tokens whose logits one call makes, at the captured input
    logits_bytes: int | None = None  # the head's output at the captured input
    unfused_bytes: int | None = None  # vocabulary-wide tensors the unfused pair holds at its peak
    fused_bytes: int | None = None  # what the chunked op holds at once instead (its chunk, the head's gradient)
    saved_bytes: int | None = None  # of the unfused pair's: what autograd keeps for backward (log-probabilities, tanh)
    kept_bytes: int | None = None  # what the chunked op keeps for backward instead (the hidden states' gradient)

    @property
    def found(self) -> bool:
        """True when a projection to the vocabulary feeding a cross-entropy was found (fused or not)."""
        return self.head is not None or self.product is not None

    @property
    def projection(self) -> str:
        """What makes the logits, for the plan's text: the head's module name, or the product and its weight."""
        return self.head if self.head is not None else f"{self.product} with {self.weight}"

    @property
    def fused(self) -> bool:
        """True when the pair runs as one chunked op."""
        return self.enabled and self.reason is None

    @property
    def peak_bytes(self) -> int:
        """What the pair holds at its peak beyond the activations the plan keeps (0 when unknown): unfused,
        the gradients of the log-probabilities and of the logits beside the saved log-probabilities; fused,
        one chunk and the head's fp32 gradient beside the hidden states' gradient."""
        if self.fused:
            return (self.fused_bytes or 0) - (self.kept_bytes or 0)
        return (self.unfused_bytes or 0) - (self.saved_bytes or 0)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> FusedLossPlan:
        """Parse the dict ``dataclasses.asdict`` made."""
        return cls(**raw)



def index_keeps_last_dim(index: Any, ndim: int) -> bool:
    """True when ``t[index]`` on an ``ndim``-dim tensor selects whole rows: plain ints and slices before a
    last dimension left whole, so the same index on the hidden states selects the same tokens."""
    items = index if isinstance(index, tuple) else (index,)
    if not all(i is Ellipsis or isinstance(i, (int, slice)) and not isinstance(i, bool) for i in items):
        return False  # tensors, lists, None and booleans add, gather or mask dimensions
    full = slice(None)
    if Ellipsis in items:
        return items.count(Ellipsis) == 1 and items[-1] == full
    return len(items) < ndim or (len(items) == ndim and items[-1] == full)
