"""TorchRec's ``torchrec.sparse.tests.utils`` helpers for ``KeyedTensor`` regroup tests, at its path.

``build_kts`` makes two ``KeyedTensor``s of random ``[batch_size, dim]`` columns: one of ``dense_<i>`` keys,
one of ``sparse_<i>`` keys. ``build_groups`` deals their keys at random into ``num_groups`` groups (a key in
exactly one group), then optionally drops one key from each group of two or more (``skips``) and appends a
random key to each group (``duplicates``), as TorchRec's do; both draw from Python's and torch's global RNGs.
"""

from __future__ import annotations

import random

import torch

from lightning_shardrec.sparse.keyed_tensor import KeyedTensor


def _random_kt(prefix: str, count: int, dim: int, batch_size: int, device: torch.device, grad: bool) -> KeyedTensor:
    keys = [f"{prefix}_{i}" for i in range(count)]
    columns = [torch.randn(batch_size, dim, device=device, requires_grad=grad) for _ in keys]
    return KeyedTensor.from_tensor_list(keys, columns, key_dim=1)


def build_kts(
    dense_features: int,
    sparse_features: int,
    dim_dense: int,
    dim_sparse: int,
    batch_size: int,
    device: torch.device,
    run_backward: bool,
) -> list[KeyedTensor]:
    """``[dense KeyedTensor, sparse KeyedTensor]``; the columns require grad when ``run_backward``."""
    return [
        _random_kt("dense", dense_features, dim_dense, batch_size, device, run_backward),
        _random_kt("sparse", sparse_features, dim_sparse, batch_size, device, run_backward),
    ]


def build_groups(
    kts: list[KeyedTensor], num_groups: int, skips: bool = False, duplicates: bool = False
) -> list[list[str]]:
    """The keys of ``kts`` dealt at random into ``num_groups`` groups (some may be empty)."""
    if num_groups < 1:
        raise ValueError(f"build_groups: num_groups must be >= 1, got {num_groups}")
    keys: list[str] = []
    for kt in kts:
        keys.extend(kt.keys())
    groups: list[list[str]] = [[] for _ in range(num_groups)]
    for key in keys:
        groups[random.randrange(num_groups)].append(key)
    if skips:
        for group in groups:
            if len(group) > 1:
                del group[random.randrange(len(group))]
    if duplicates:
        for group in groups:
            group.append(random.choice(keys))
    return groups


__all__ = ["build_groups", "build_kts"]
