"""BMTrain's explicit API: ``CheckpointBlock`` (also the binding the wrapper gives each block) and
``DistributedModule``."""
