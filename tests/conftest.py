"""Shared pytest setup: deterministic seeds, one intra-op thread (2-core CI), a private kernel cache."""

import os

import pytest
import torch

from lightning_shardrec.kernels.autotune import CACHE_ENV

torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``kernel="auto"``'s timings go to a temporary directory (inherited by spawned ranks), never ~/.cache."""
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("kernel_cache"))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
