"""Node agent: one per host.

Owns membership in etcd (a lease per agent), rendezvous rounds whose number is the fencing
token, worker supervision (torchrun as a local launcher), heartbeats and hang dumps, elastic
restarts. Must stay importable without torch: the agent starts fast and outlives worker
crashes. Only the torchrun rendezvous backend (:mod:`ftrain.agents.torchrun_rdzv`, loaded in the
torchrun launcher) may import torch. May import ``contract``; never ``ftrain`` or ``chaos``.
"""
