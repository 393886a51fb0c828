"""What every module of :mod:`ftrain.data` shares: its error, and the check of sample ids."""

from __future__ import annotations

import numpy as np


class DataError(ValueError):
    """Bad data or data state (file, sample id, cursor checkpoint); the message names the fix."""


def as_sample_ids(ids: np.ndarray | list[int], num_samples: int, where: str) -> np.ndarray:
    """``ids`` as a 1-D int64 array, each in ``[0, num_samples)``; DataError naming ``where``."""
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise DataError(f"{where}: sample ids must be a 1-D array, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"{where}: sample ids must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and (arr.min() < 0 or arr.max() >= num_samples):
        bad = int(arr[(arr < 0) | (arr >= num_samples)][0])
        raise DataError(
            f"{where}: sample id {bad} is out of range [0, {num_samples}); ids come from a "
            f"DataCursor built with num_samples={num_samples}"
        )
    return arr
