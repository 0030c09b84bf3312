"""Planner fixtures."""

from __future__ import annotations

import pytest
from planner_helpers import bag, seq


@pytest.fixture
def small_tables() -> dict:
    return {
        "ebc": [bag("big", 1_000_000, 128), bag("mid", 50_000, 64), bag("small", 1_000, 32)],
        "ec": [seq("hist", 20_000, 32)],
    }
