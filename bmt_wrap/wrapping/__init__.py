"""The one-liner's path: ``BMTrainModelWrapper`` runs the passes, applies the plan and hooks the model."""
