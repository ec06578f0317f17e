"""Optimizers on sharded parameters: fused Adam (in memory, host memory, on disk), OptimManager, clipping."""

from .adam import AdamOptimizer
from .adam_disk import AdamDiskOptimizer
from .adam_offload import AdamOffloadOptimizer
from .fusion import Run, plan_runs
from .grad_norm import clip_grad_norm_
from .grad_scaler_guard import check_no_grad_scaler, install_grad_scaler_guard
from .muon import Muon, muon_plan
from .optim_manager import OptimManager
from .sharding import REPLICATED_ATTR

__all__ = [
    "AdamDiskOptimizer", "AdamOffloadOptimizer", "AdamOptimizer", "Muon", "OptimManager", "REPLICATED_ATTR",
    "Run", "check_no_grad_scaler", "clip_grad_norm_", "install_grad_scaler_guard", "muon_plan", "plan_runs",
]
