"""Session-wide fixtures shared by the distributed and integration suites."""

from __future__ import annotations

from typing import Callable

import pytest

from tests.support import RunResult, train_job


@pytest.fixture(scope="session")
def golden(tmp_path_factory) -> Callable[..., RunResult]:
    """``golden(nproc, *overrides)``: an uninterrupted run of the tiny config, run once per
    session and shared by every test that compares against it. Each records a ledger in
    ``<workdir>/ledger``."""
    cache: dict[tuple, RunResult] = {}

    def get(nproc: int, *overrides: str) -> RunResult:
        key = (nproc, tuple(sorted(overrides)))
        if key not in cache:
            workdir = tmp_path_factory.mktemp(f"golden-{nproc}")
            cache[key] = train_job(workdir, nproc, f"--data.ledger_dir={workdir / 'ledger'}", *overrides)
        return cache[key]

    return get
