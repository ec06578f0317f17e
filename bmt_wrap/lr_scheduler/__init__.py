"""Learning-rate schedules with warmup (BMTrain's ``bmtrain.lr_scheduler``)."""

from .schedules import Cosine, Exponential, Linear, Noam, NoDecay
from .warmup import WarmupLRScheduler

__all__ = ["Cosine", "Exponential", "Linear", "NoDecay", "Noam", "WarmupLRScheduler"]
