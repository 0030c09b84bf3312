"""Ids checked on the device (the CUDA path, forced here on CPU): the flag rides in the batch header,
the rank holding a bad id raises the named error (table, feature, id, range), every other rank stops
too; with ``validate_ids=False`` the kernels still keep every id inside its own table."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_dmp import bad_batch
from test_prefetch import bad_prefetch

from lightning_shardrec.testing import run_ranks


def on_device(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run with the ids checked as on CUDA (restored after: the rank pool is reused)."""

    def run(rank: int, world: int) -> Any:
        from lightning_shardrec.modules import features

        saved = features.checks_on_device
        features.checks_on_device = lambda device: True
        try:
            return fn(rank, world)
        finally:
            features.checks_on_device = saved

    run.__name__ = fn.__name__
    return run


def device_bad_batch(rank: int, world: int) -> Any:
    return on_device(bad_batch)(rank, world)


def device_bad_prefetch(rank: int, world: int) -> Any:
    return on_device(bad_prefetch)(rank, world)


def test_a_bad_id_found_on_the_device_is_named_on_its_rank_and_stops_every_rank() -> None:
    (msgs0, n0), (msgs1, n1) = run_ranks(device_bad_batch, 2)
    assert "IdOutOfRangeError: feature 'f2' (table 't_small'): id 5 outside [0, 2)" in msgs1[0]
    assert "ShardingError: rank 0: ranks [1] rejected their batch" in msgs0[0]
    assert n0 == n1 == 2


def test_a_bad_prefetched_id_found_on_the_device_raises_at_its_forward() -> None:
    (m0, n0, left0), (m1, n1, left1) = run_ranks(device_bad_prefetch, 2)
    assert "ShardingError: rank 0: ranks [1] rejected their batch" in m0[2]
    assert "IdOutOfRangeError: feature 'f2' (table 't_small'): id 5 outside [0, 2)" in m1[2]
    assert n0 == n1 == 2 and left0 == left1 == 0


def test_id_ranges_flag_only_static_features_out_of_their_range() -> None:
    from lightning_shardrec import KeyedJaggedTensor
    from lightning_shardrec.gpu_check.syncs import SyncOps
    from lightning_shardrec.modules.features import IdRanges

    ranges = IdRanges([4, 3], ["t_a", "t_dyn"], static=[0])
    lengths = torch.tensor([1, 1, 2, 0])

    def flag(values: list[int]) -> bool:
        kjt = KeyedJaggedTensor(["a", "d"], torch.tensor(values), lengths=lengths)
        with SyncOps() as count:
            bad = ranges.out_of_range(kjt)
        assert count.total == 0  # no read of the device
        return bool(bad)

    assert not flag([0, 3, -(2**62), 99])  # the dynamic table's feature takes any id
    assert flag([4, 0, 1, 2]) and flag([0, -1, 1, 2])
    kjt = KeyedJaggedTensor(["a", "d"], torch.tensor([0, 4, 7, 7]), lengths=lengths)
    with pytest.raises(ValueError, match=r"feature 'a' \(table 't_a'\): id 4 outside \[0, 4\)"):
        ranges.explain(kjt)


def _kernel(backend: str):  # type: ignore[no-untyped-def]
    from lightning_shardrec import FusedOptimConfig
    from lightning_shardrec.kernels import make_kernel
    from lightning_shardrec.kernels.base import TableSpec

    tables = [TableSpec(name=n, num_embeddings=r, embedding_dim=4) for n, r in (("t_a", 5), ("t_b", 3))]
    optim = FusedOptimConfig(optimizer="adagrad", lr=0.1)
    return make_kernel(tables, [0, 1], optim, pooled=True, device="cpu", kernel=backend)


MESSAGE = r"kernel='torch': an id is outside its table's rows \(tables 't_a' \[0, 5\), 't_b' \[0, 3\)\)"


def test_the_torch_kernel_keeps_every_id_inside_its_own_table() -> None:
    from lightning_shardrec import KeyedJaggedTensor

    kernel = _kernel("torch")
    # one flat buffer [t_a; t_b]: t_a's id 6 would read t_b's row 1, t_b's id 4 past the end: both fail
    for values in ([6, 0], [0, 4], [-1, 0]):
        kjt = KeyedJaggedTensor(["a", "b"], torch.tensor(values), lengths=torch.tensor([1, 1]))
        with pytest.raises(RuntimeError, match=MESSAGE):
            kernel(kjt)
    ok = KeyedJaggedTensor(["a", "b"], torch.tensor([4, 2]), lengths=torch.tensor([1, 1]))
    assert kernel(ok).shape == (1, 8)


def test_the_fbgemm_kernel_bounds_checks_ids_on_the_device() -> None:
    pytest.importorskip("fbgemm_gpu")
    from lightning_shardrec import KeyedJaggedTensor

    kernel = _kernel("fbgemm")
    weights = kernel.split_weights()
    bad = KeyedJaggedTensor(["a", "b"], torch.tensor([1, 3]), lengths=torch.tensor([1, 1]))  # t_b has 3 rows
    with torch.no_grad():
        out = kernel(bad)
    # WARNING mode (TorchRec's default): the bad id reads row 0 of its own table, never past it
    assert torch.equal(out[0, :4], weights[0][1]) and torch.equal(out[0, 4:], weights[1][0])
