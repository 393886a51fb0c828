"""The bottom layer: what the processes of one job agree on. Standard library only (no torch).

- :mod:`ftrain.contract.config`: the shared config file: sections, typed keys, overrides, errors.
- :mod:`ftrain.contract.worker_env`: the environment a node agent gives the workers it starts.
- :mod:`ftrain.contract.heartbeat`: the datagrams a worker sends its agent.
- :mod:`ftrain.contract.events`: the event catalogue (one typed record per event) and the event log.
- :mod:`ftrain.contract.exits`: exit codes of the ``ftrain`` commands.

Every other package (``checkpoint``, ``ftrain``, ``agents``, ``chaos``, the CLI) may import it;
it imports none of them.
"""
