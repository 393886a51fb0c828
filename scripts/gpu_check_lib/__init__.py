"""The parts of ``scripts/gpu_check.py`` (``make gpu-check``): one module per kind of check.

- :mod:`.core`: the check's result, the mode (GPU or dry), running checks side by side under one
  time budget, each with a timeout of its own;
- :mod:`.training`: ``ftrain train`` per model and strategy, at one rank and at two ranks
  sharing one device, and ``ftrain plan`` against measured peak memory;
- :mod:`.live`: live recovery of a SIGKILLed worker under ``ftrain agent``;
- :mod:`.flight`: the flight recorder on a one-rank NCCL group (:mod:`.flight_worker`);
- :mod:`.ckpt`: ``bench/checkpoint.py`` and the figures of its final JSON line.

What must stay true: a check never claims more than it ran (dry mode runs on the CPU and says
so; a figure a check could not measure is absent or explained, never invented), and every
process a check starts is killed, with everything under it, before the check returns.
"""
