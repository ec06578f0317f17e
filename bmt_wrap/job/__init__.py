"""The distributed job: ``init_distributed``, the rank layout, and the collectives scripts call on it."""
