"""ftrain: one import namespace for the whole project.

The runtime (configuration, model, data, parallel strategies, the train loop) is this package's
own modules; ``ftrain.agents``, ``ftrain.checkpoint``, ``ftrain.chaos``, ``ftrain.contract`` and
``ftrain.testbed`` are the top-level folders of the checkout, linked in here (see pyproject.toml).
The runtime may import ``ftrain.contract``, ``ftrain.checkpoint`` and torch; never
``ftrain.agents`` or ``ftrain.chaos`` (tests/unit/test_import_boundaries.py). Importing this
package imports nothing else: torch loads ``ftrain.torchrun_plugin`` in every process that imports
its rendezvous package.
"""

__version__ = "0.1.0"
