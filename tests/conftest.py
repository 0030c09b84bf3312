"""Shared pytest setup: deterministic seeds, one intra-op thread (2-core CI)."""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
