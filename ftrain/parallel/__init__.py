"""Parallelism: how one model is spread over the ranks of a round.

- :mod:`~ftrain.parallel.strategies`: one module per strategy (ddp, zero1, zero2, fsdp, hsdp, tp,
  fsdp+tp), found by name: its config checks, layout, memory model and which mechanisms it uses.
- the torch mechanisms strategies combine: :mod:`~ftrain.parallel.ddp` (DDP, ZeRO-1),
  :mod:`~ftrain.parallel.fsdp` (FSDP2), :mod:`~ftrain.parallel.tp` (column/row splits),
  :mod:`~ftrain.parallel.deterministic` (the fixed-order reduction),
  :mod:`~ftrain.parallel.grad_norm` (clipping across meshes),
  :mod:`~ftrain.parallel.activation_checkpointing`; :mod:`~ftrain.parallel.base` is the train
  loop's handle on a model and its optimizer, and :mod:`~ftrain.parallel.parallelize` puts one
  together.
- pipelines: torch-free arithmetic of stages and schedules
  (:mod:`~ftrain.parallel.pipeline_stages`, :mod:`~ftrain.parallel.pipeline_schedule`, which the
  configuration checks and ``ftrain plan`` use) and the torch pipeline itself
  (:mod:`~ftrain.parallel.pipeline`).

This file imports nothing, so that the torch-free modules here stay torch-free to import.
"""
