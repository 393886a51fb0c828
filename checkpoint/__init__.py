"""Checkpoint service: asynchronous sharded DCP saves to any fsspec URL.

Owns storage (one backend per URL scheme, :mod:`ftrain.checkpoint.backends`), manifests (the commit
point), per-file digests, verification before load, fallback to the last good step, resharding,
retention and its own config section (:mod:`ftrain.checkpoint.config`). May import ``contract``, torch,
fsspec, xxhash and tenacity; never ``ftrain``, ``agents`` or ``chaos``.
"""
