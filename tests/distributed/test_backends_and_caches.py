"""Backend spellings that take CUDA tensors, and the per-batch-shape caches kept bounded."""

from __future__ import annotations

import pytest
import torch

from lightning_shardrec.distributed.comm.bounded_cache import BoundedCache
from lightning_shardrec.distributed.comm.collectives import backend_uses_cuda
from lightning_shardrec.distributed.comm.pooled_all_to_all import ColumnBlocks


@pytest.mark.parametrize(
    ("backend", "cuda"),
    [
        ("nccl", True),
        ("NCCL", True),
        ("cuda:nccl", True),
        ("cpu:gloo,cuda:nccl", True),
        ("cuda:nccl,cpu:gloo", True),
        (" cpu:gloo , cuda:nccl ", True),
        ("gloo", False),
        ("cpu:gloo", False),
        ("mpi", False),
        ("", False),
    ],
)
def test_backend_spellings(backend: str, cuda: bool) -> None:
    assert backend_uses_cuda(backend) is cuda


def test_bounded_cache_keeps_the_most_recently_used() -> None:
    cache: BoundedCache[int] = BoundedCache(size=2)
    made: list[int] = []

    def make(k: int) -> int:
        made.append(k)
        return k * 10

    assert [cache.get(k, lambda k=k: make(k)) for k in (1, 2, 1, 3, 1, 2)] == [10, 20, 10, 30, 10, 20]
    assert made == [1, 2, 3, 2]  # 2 was dropped when 3 came (1 had just been used)
    assert len(cache) == 2


def test_bounded_cache_refuses_a_size_below_one() -> None:
    with pytest.raises(ValueError, match="BoundedCache: size must be >= 1, got 0"):
        BoundedCache(size=0)


def test_column_block_gathers_stay_bounded_over_many_batch_sizes() -> None:
    blocks = ColumnBlocks.from_columns([4, 5, 0, 1, 6, 7, 2, 3], [4, 4])
    for b in range(1, 40):
        forward, backward = blocks.gathers(b, torch.device("cpu"))
        fresh = ColumnBlocks.from_columns([4, 5, 0, 1, 6, 7, 2, 3], [4, 4]).gathers(b, torch.device("cpu"))
        assert torch.equal(forward, fresh[0]) and torch.equal(backward, fresh[1])
        assert torch.equal(forward[backward], torch.arange(forward.numel()))  # inverse permutations
    assert len(blocks._gathers) == blocks._gathers.size
