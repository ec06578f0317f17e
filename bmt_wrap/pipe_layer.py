"""BMTrain's ``bmtrain.pipe_layer`` module path (one pipeline stage only)."""

from .block import PipelineTransformerBlockList

__all__ = ["PipelineTransformerBlockList"]
