"""BMTrain's explicit API: the block lists and ``DistributedModule``; ``CheckpointBlock`` itself is the
in-place binding the wrapper gives each block too (``wrapping/bound_block.py``)."""
