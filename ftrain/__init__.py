"""ftrain runtime: configuration, CLI, model, data, parallel strategies and the train loop.

May import ``checkpoint`` and torch; never ``agents`` or ``chaos``.
"""

__version__ = "0.1.0"
