"""BMTrain's module paths (``bmt.store``, ``bmt.nccl``, ``bmt.nn`` ...): thin modules over the core,
reachable under their old names through ``bmt_wrap._aliases``."""
