"""Losses: ``FusedCrossEntropy`` (BMTrain's ``bmtrain.loss``)."""

from .cross_entropy import FusedCrossEntropy

__all__ = ["FusedCrossEntropy"]
