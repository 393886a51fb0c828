"""Checkpoint service: asynchronous sharded DCP saves to any fsspec URL.

Owns storage, manifests (the commit point), per-file digests, verification before load,
fallback to the last good step, resharding and retention. May import torch, fsspec, xxhash
and tenacity; never ``ftrain`` or ``agents``.

Not implemented yet: tracked by the checkpoint issue.
"""
