"""Checkpoint errors: one base, retryable kept apart from fatal."""

from __future__ import annotations


class CheckpointError(Exception):
    """Base of every error the checkpoint service raises."""


class TransientStorageError(CheckpointError):
    """A storage failure worth retrying: connection refused/reset, timeouts, 5xx, throttling."""


class FatalStorageError(CheckpointError):
    """A storage failure retrying cannot fix: bad credentials, missing bucket, bad URL."""


class ChecksumMismatchError(CheckpointError):
    """A file's bytes do not match the digest recorded in the manifest."""


class ManifestError(CheckpointError):
    """A manifest is missing, unparsable, of an unknown format, or fails its HMAC."""


class StaleRoundError(CheckpointError):
    """The writer's rendezvous round is no longer current: a zombie may not commit."""


class UnsafePickleError(CheckpointError):
    """A pickle from storage (``.metadata``, or a non-tensor item inside a ``.distcp`` shard)
    asked to load something outside its allow-list, or is not a pickle DCP writes at all."""


class UnsafeMetadataError(UnsafePickleError):
    """``.metadata`` points outside the step's manifest: a file name, offset, length or
    transform that no writer of this project produces (a forged or corrupt ``.metadata``)."""


class NoCheckpointError(CheckpointError):
    """No committed, verified checkpoint exists to load."""
