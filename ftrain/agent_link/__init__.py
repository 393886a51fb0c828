"""The worker's end of the contract with its node agent (:mod:`ftrain.contract` holds the messages).

- :mod:`~ftrain.agent_link.heartbeat`: step beats and "alive" datagrams to the agent, stack dumps
  on SIGUSR1, and the watchdog that ends a worker whose agent is gone.
- :mod:`~ftrain.agent_link.fence`: the commit fence: a checkpoint counts only if its round is
  still the job's (one etcd transaction).
- :mod:`~ftrain.agent_link.flight_recorder`, :mod:`~ftrain.agent_link.flight_gate`: torch's
  record of each rank's collectives, served to the agent on its socket for hang verdicts.

Imports no other room of the runtime: the agent's side lives in :mod:`ftrain.agents`, which never
imports this package.
"""
