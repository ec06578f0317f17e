"""Losses: ``FusedCrossEntropy`` (BMTrain's ``bmtrain.loss``)."""

from . import _function
from .cross_entropy import FusedCrossEntropy

__all__ = ["FusedCrossEntropy", "_function"]
