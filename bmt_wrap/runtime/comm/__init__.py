"""One communicator interface with backends behind it (gloo point-to-point, torch NCCL, CuPy NCCL,
single process) and two wrappers (counting, debug fingerprinting)."""

from .base import REDUCE_OPS, Communicator, DoneHandle, Handle
from .counting import CountingCommunicator
from .cupy_nccl import CupyNcclCommunicator, cupy_available
from .fingerprint import FingerprintCommunicator
from .gloo import GlooCommunicator
from .layout import ParallelLayout, RankLayout, StagePlacement
from .purpose import collective_purpose
from .single import SingleProcessCommunicator
from .torch_native import TorchCommunicator

__all__ = [
    "REDUCE_OPS", "Communicator", "CountingCommunicator", "CupyNcclCommunicator", "DoneHandle",
    "FingerprintCommunicator", "GlooCommunicator", "Handle", "ParallelLayout", "RankLayout",
    "SingleProcessCommunicator", "StagePlacement", "TorchCommunicator", "collective_purpose", "cupy_available",
]
