"""TorchRec's test helpers at its path (``torchrec.test_utils``), for TorchRec users' own tests.

``get_free_port``, the sanitizer checks and skips (``is_asan``, ``skip_if_asan``, ``skip_if_asan_class``),
``init_distributed_single_host``, ``seed_and_log`` and the state/buffer/parameter key comparison, with
TorchRec's signatures and meaning.
"""

from __future__ import annotations

import ctypes
import functools
import os
import random
import socket
import time
import unittest
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

_T = TypeVar("_T")
_ASAN_WHY = "Skipping test run since we are in ASAN mode."


def get_free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (bound to port 0, read back, released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _has_symbol(name: str) -> bool:
    return hasattr(ctypes.CDLL(None), name)


def is_asan() -> bool:
    """The interpreter runs with AddressSanitizer."""
    return _has_symbol("__asan_init")


def is_tsan() -> bool:
    """The interpreter runs with ThreadSanitizer."""
    return _has_symbol("__tsan_init")


def is_asan_or_tsan() -> bool:
    return is_asan() or is_tsan()


def skip_if_asan(func: Callable[..., _T]) -> Callable[..., _T | None]:
    """A test that skips itself (``unittest.SkipTest``) under a sanitizer."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> _T | None:
        if is_asan_or_tsan():
            raise unittest.SkipTest(_ASAN_WHY)
        return func(*args, **kwargs)

    return wrapper


def skip_if_asan_class(cls: _T) -> _T:
    """A ``unittest.TestCase`` class skipped as a whole under a sanitizer."""
    if is_asan_or_tsan():
        cls.__unittest_skip__ = True  # type: ignore[attr-defined]
        cls.__unittest_skip_why__ = _ASAN_WHY  # type: ignore[attr-defined]
    return cls


def init_distributed_single_host(
    rank: int, world_size: int, backend: str, local_size: int | None = None
) -> dist.ProcessGroup:
    """(Re)initialise the default process group on one host (``MASTER_ADDR``/``MASTER_PORT`` from the
    environment) and set ``LOCAL_WORLD_SIZE``/``LOCAL_RANK``; returns the world group."""
    os.environ["LOCAL_WORLD_SIZE"] = str(local_size or world_size)
    os.environ["LOCAL_RANK"] = str(rank % local_size if local_size else rank)
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(rank=rank, world_size=world_size, backend=backend)
    return dist.group.WORLD  # type: ignore[return-value]


def seed_and_log(wrapped_func: Callable[..., _T]) -> Callable[..., _T]:
    """Seed torch, ``random`` and numpy from the clock before each call, printing the seed."""

    @functools.wraps(wrapped_func)
    def wrapper(*args: Any, **kwargs: Any) -> _T:
        seed = int(time.time() * 1000) % (1 << 31)
        print(f"Using random seed: {seed}")
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        return wrapped_func(*args, **kwargs)

    return wrapper


def get_state_buffers_parameters(model: nn.Module) -> dict[str, Any]:
    return {
        "state_dict": model.state_dict(),
        "named_buffers": dict(model.named_buffers()),
        "named_parameters": dict(model.named_parameters()),
    }


def assert_state_buffers_parameters_equal(
    model_1: nn.Module,
    model_2: nn.Module,
    check_named_buffers: bool = True,
    check_named_parameters: bool = True,
    check_state_dict: bool = True,
) -> None:
    """The two models have the same state-dict, buffer and parameter *keys* (TorchRec's check; not values)."""
    one, two = get_state_buffers_parameters(model_1), get_state_buffers_parameters(model_2)
    checks = {"named_buffers": check_named_buffers, "named_parameters": check_named_parameters}
    checks["state_dict"] = check_state_dict
    for what, wanted in checks.items():
        if wanted and one[what].keys() != two[what].keys():
            only_1, only_2 = sorted(one[what].keys() - two[what].keys()), sorted(two[what].keys() - one[what].keys())
            raise AssertionError(f"{what} keys differ: only in model_1 {only_1}, only in model_2 {only_2}")


__all__ = [
    "assert_state_buffers_parameters_equal",
    "get_free_port",
    "get_state_buffers_parameters",
    "init_distributed_single_host",
    "is_asan",
    "is_asan_or_tsan",
    "is_tsan",
    "seed_and_log",
    "skip_if_asan",
    "skip_if_asan_class",
]
