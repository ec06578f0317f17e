"""BMTrain's ``bmtrain.pipe_layer`` module path (one pipeline stage only)."""

from ..explicit.block import PipelineTransformerBlockList

__all__ = ["PipelineTransformerBlockList"]
