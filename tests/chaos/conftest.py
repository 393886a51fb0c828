"""Chaos fixtures: one golden-run cache for the session (scenarios sharing a config reuse it)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def golden_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("chaos-golden")
