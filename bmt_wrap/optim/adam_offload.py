"""``AdamOffloadOptimizer``: AdamOptimizer with its fp32 master and moments in host memory."""

from __future__ import annotations

from .adam import AdamOptimizer


class AdamOffloadOptimizer(AdamOptimizer):
    """Adam whose fp32 master weights and moments live in their own host (CPU) buffers, pinned when CUDA
    is present; the update runs on the CPU and the parameter receives the master's value (rounded to its
    dtype). Every dtype keeps a master copy, so state never aliases the parameters. Results equal
    ``AdamOptimizer``'s bit for bit on CPU.
    """

    _offload = True
