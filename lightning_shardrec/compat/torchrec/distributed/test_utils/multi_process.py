"""TorchRec's ``MultiProcessTestBase`` / ``MultiProcessContext`` (``torchrec.distributed.test_utils.multi_process``),
on this library's shared spawn helper (:func:`lightning_shardrec.testing.run_ranks`).

``_run_multi_process_test(callable=f, world_size=2, **kwargs)`` calls ``f(rank=r, world_size=2, **kwargs)``
on every rank and fails the test with each failing rank's traceback. The ranks already share a process
group (the helper's workers, reused between calls); ``with MultiProcessContext(rank, world_size, backend)``
inside ``f`` uses it (and creates one only when none exists), so TorchRec-style callables run unchanged.
``f`` must be importable (a module-level function), as with TorchRec.
"""

from __future__ import annotations

import unittest
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_shardrec.testing import run_ranks


class MultiProcessContext:
    """This rank's process group and device (CPU, or ``cuda:rank`` when there are enough GPUs)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        local_size: int | None = None,
        use_deterministic_algorithms: bool = True,
        disable_cuda_tf_32: bool = True,
    ) -> None:
        self.rank, self.world_size, self.backend, self.local_size = rank, world_size, backend, local_size
        enough_gpus = torch.cuda.is_available() and world_size <= torch.cuda.device_count()
        self.device = torch.device(f"cuda:{rank}") if enough_gpus else torch.device("cpu")
        if enough_gpus:
            torch.cuda.set_device(self.device)
        self._deterministic = use_deterministic_algorithms
        self._own_group = False
        self.pg: dist.ProcessGroup | None = None

    def __enter__(self) -> MultiProcessContext:
        if dist.is_initialized():
            if dist.get_world_size() != self.world_size or dist.get_rank() != self.rank:
                raise RuntimeError(
                    f"MultiProcessContext(rank={self.rank}, world_size={self.world_size}): this process is rank "
                    f"{dist.get_rank()} of {dist.get_world_size()} already"
                )
        else:  # run by hand (not through MultiProcessTestBase): MASTER_ADDR / MASTER_PORT from the environment
            dist.init_process_group(self.backend, rank=self.rank, world_size=self.world_size)
            self._own_group = True
        self.pg = dist.GroupMember.WORLD
        if self._deterministic:
            torch.use_deterministic_algorithms(True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._deterministic:
            torch.use_deterministic_algorithms(False)
        if self._own_group:
            dist.destroy_process_group()


def _call(rank: int, world_size: int, fn: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    fn(**{**kwargs, "rank": rank, "world_size": world_size})


def _call_per_rank(rank: int, world_size: int, fn: Callable[..., Any], per_rank: Sequence[dict[str, Any]]) -> None:
    fn(**{**per_rank[rank], "rank": rank, "world_size": world_size})


class MultiProcessTestBase(unittest.TestCase):
    """A ``TestCase`` whose tests run a callable on several ranks (gloo on CPU unless ``backend=`` says)."""

    def __init__(self, methodName: str = "runTest", mp_init_mode: str = "spawn") -> None:
        super().__init__(methodName)
        self._mp_init_mode = mp_init_mode  # TorchRec's argument; the shared helper always spawns

    def _run_multi_process_test(self, *, callable: Callable[..., None], world_size: int = 2, **kwargs: Any) -> None:
        backend = kwargs.get("backend", "gloo")
        run_ranks(_call, world_size, callable, kwargs, backend=backend)

    def _run_multi_process_test_per_rank(
        self, *, callable: Callable[..., None], world_size: int, kwargs_per_rank: list[dict[str, Any]]
    ) -> None:
        if len(kwargs_per_rank) != world_size:
            raise ValueError(
                f"_run_multi_process_test_per_rank: kwargs_per_rank has {len(kwargs_per_rank)} entries for "
                f"world_size {world_size}"
            )
        backend = kwargs_per_rank[0].get("backend", "gloo") if kwargs_per_rank else "gloo"
        run_ranks(_call_per_rank, world_size, callable, kwargs_per_rank, backend=backend)


__all__ = ["MultiProcessContext", "MultiProcessTestBase"]
