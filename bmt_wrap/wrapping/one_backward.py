"""One backward per forward of a wrapped model: a second through the same graph is refused by name.

Plain PyTorch runs ``backward(retain_graph=True)`` twice and doubles the gradients. A wrapped model gives back,
during the first backward, what a second would read: each block's gathered parameters and recompute state, and
the root group's gathered buffer, which then holds the flat gradient. The second backward failed in autograd's
version check on that buffer (a raw ``RuntimeError`` naming a ``[hidden, vocab]`` tensor). Supporting it would
mean keeping every block's recompute state and re-gathering the root for as long as the graph lives, which no
single-backward step should pay for; a hook on the forward's outputs instead refuses it before any of the
model's backward runs, so nothing is half done.
"""

from __future__ import annotations

from typing import Any

import torch

from ..base._compat import pytree
from ..errors import WrapError


def refuse_second_backward(model_name: str, output: Any) -> None:
    """Make a second backward through any grad-requiring tensor of ``output`` raise ``WrapError``."""
    for t in pytree.tree_leaves(output):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(_FirstBackwardOnly(model_name))


class _FirstBackwardOnly:
    """A tensor hook: passes the first gradient through, raises at the second (a second backward)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.fired = False

    def __call__(self, grad: torch.Tensor) -> None:
        if self.fired:
            raise WrapError(
                f"a second backward through one forward of the wrapped {self.model_name} (backward(retain_graph=True) "
                "twice, or torch.autograd.grad then backward): the wrapped model frees what its backward reads "
                "(gathered parameters, recompute state) during the first one. Run the forward again before each "
                "backward; to double the gradients as two plain PyTorch backwards do, call backward once on 2 * loss.")
        self.fired = True
