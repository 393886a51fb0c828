"""Chaos: real fault injection and scenario runs whose invariants prove nothing was lost.

May import every layer below the CLI (``contract``, ``checkpoint``, ``ftrain``, ``agents``,
``testbed``); nothing imports ``chaos`` except tests, benchmarks and the CLI. A fault kind is one
module in :mod:`ftrain.chaos.faults.kinds`.
"""
