"""BMTrain's ``bmtrain.pipe_layer`` module path."""

from ..explicit.pipeline import PipelineTransformerBlockList

__all__ = ["PipelineTransformerBlockList"]
