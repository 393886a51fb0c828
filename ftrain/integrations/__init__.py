"""ftrain's checkpoints for training loops that a framework owns or shapes (docs/hf-trainer.md,
docs/lightning.md).

Each module adapts one framework to :class:`ftrain.Session` and imports that framework itself, so
importing this package imports none: ``ftrain.integrations.hf_trainer`` needs ``transformers``
and ``accelerate`` (the ``hf`` extra), ``ftrain.integrations.lightning`` needs ``lightning``
(the ``lightning`` extra: Fabric). Integrations build on the session's public API only; they
add no checkpoint format of their own (a run's steps are a session's, docs/library.md).
"""
