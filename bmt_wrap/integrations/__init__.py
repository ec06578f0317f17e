"""Integrations with the tools people train with; each is imported on its own, needing only its tool.

- ``bmt_wrap.integrations.accelerate``: ``Accelerator`` (accelerate's, for wrapped models);
- ``bmt_wrap.integrations.transformers``: ``Trainer`` (transformers', for wrapped models);
- ``bmt_wrap.integrations.lightning``: ``ShardedStrategy`` (a Lightning strategy for wrapped models).

docs/integrations.md lists what is tested with which versions.
"""
