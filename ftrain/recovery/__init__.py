"""Live recovery: how a round that lost ranks goes on without a restart from storage.

- :mod:`~ftrain.recovery.live`: a live worker, kept across rounds by its node agent: it leaves a
  broken round, rebuilds its process group in-process and takes its state from a survivor, the
  memory tier or storage, whichever is newest and whole.
- :mod:`~ftrain.recovery.peer_state`: a full replica's state sent from a live peer, checked
  against the receiver's own before any of it is used.
- :mod:`~ftrain.recovery.memory_tier` (with :mod:`~ftrain.recovery.tier_schedule`,
  :mod:`~ftrain.recovery.tier_wire`, :mod:`~ftrain.recovery.tier_binding`,
  :mod:`~ftrain.recovery.tier_store`): sharded state kept in host memory, each rank's and a
  buddy's copy, and in ``checkpoint.memory_dir`` across restarts.
- :mod:`~ftrain.recovery.round_watchdog`: a round that stalls is ended, never waited on.

May import the rest of the runtime, :mod:`ftrain.checkpoint` and :mod:`ftrain.contract`; the
train loop (:mod:`ftrain.train`) calls in here, never the reverse at import time.
"""
