"""Checkpoint I/O: consolidated files under original names (``save``/``load``) and resumable sharded
checkpoints that reshard across world sizes (``save_checkpoint``/``load_checkpoint``)."""

from .consolidate import consolidated_optimizer_state, consolidated_state_dict
from .consolidated import LoadResult, load, save
from .sharded import CheckpointInfo, load_checkpoint, save_checkpoint

__all__ = ["CheckpointInfo", "LoadResult", "consolidated_optimizer_state", "consolidated_state_dict", "load",
           "load_checkpoint", "save", "save_checkpoint"]
