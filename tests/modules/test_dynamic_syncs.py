"""Host syncs of the dynamic tables' GPU path, counted on CPU: the sync-free tensor ops (the path any
non-CPU device takes) run with the compiled loops disabled, under a dispatch mode that counts the ops
which make a GPU's host wait (``.item()``, ``nonzero``, boolean indexing, ``unique``, ...)."""

from __future__ import annotations

import torch

from lightning_shardrec import DynamicConfig
from lightning_shardrec.gpu_check.syncs import SyncOps
from lightning_shardrec.modules import DynamicIdMapper
from lightning_shardrec.modules.dynamic.hashing import bucket_of
from lightning_shardrec.modules.dynamic.mapper_group import MapperGroup
from tests.modules.test_dynamic_group import CONFIGS, _batches, _mappers, tensor_ops_only


def test_the_counter_sees_each_kind_of_sync() -> None:
    x = torch.arange(6)
    for expr, kind in [
        (lambda: x.sum().item(), "item"),
        (lambda: bool((x > 2).any()), "item"),
        (lambda: (x > 2).nonzero(), "nonzero"),
        (lambda: x[x > 2], "bool_index"),
        (lambda: x.unique(), "unique"),
        (lambda: x.tolist(), "tolist"),
        (lambda: torch.tensor([1, 2], device=x.device), "h2d_copy"),
        (lambda: torch.repeat_interleave(x, x), "repeat_interleave"),
        (lambda: torch.bincount(x), "bincount"),
    ]:
        with SyncOps() as count:
            expr()
        assert dict(count.kinds) == {kind: 1}, kind
    with SyncOps() as count:  # the sync-free forms
        torch.repeat_interleave(x, x, output_size=15)
        torch.where(x > 2, x, -1).sort()
        torch.tensor([1, 2]).to(x.device, non_blocking=True)
    assert count.total == 0


def test_a_group_maps_a_training_step_in_at_most_two_host_syncs() -> None:
    """One sync for the new rows' count; one more only where a table holds part of its buckets
    (the range check). The issue counted 14-25 before."""
    for config in CONFIGS:
        for whole in (False, True):
            mappers = _mappers(config)
            if whole:
                mappers = [m for m in mappers if (m.bucket_lo, m.bucket_hi) == (0, m.num_buckets)]
            group = MapperGroup(mappers)
            group.state()  # binding the buffers (once, not per step) copies the bucket ranges in
            with tensor_ops_only():
                for step, batch in enumerate(_batches(mappers, 12, seed=3)):
                    train = step % 4 != 3
                    with SyncOps() as count:
                        group.map(torch.cat(batch), [len(b) for b in batch], train)
                    assert count.total <= int(train) + int(not whole), (config, whole, step, dict(count.kinds))


def test_one_table_maps_a_training_step_in_one_host_sync() -> None:
    mapper = DynamicIdMapper("t", DynamicConfig(num_buckets=4, min_count=2, ttl_steps=3), 32)
    mapper.bucket_ranges()  # made once per device
    with tensor_ops_only():
        for step in range(10):
            ids = torch.randint(0, 60, (40,))
            with SyncOps() as count:
                mapper.map(ids, train=step % 3 != 2)
            assert count.total == int(step % 3 != 2), dict(count.kinds)


def test_put_where_writes_only_the_masked_entries() -> None:
    from lightning_shardrec.modules.dynamic.slots import put_where

    buf = torch.arange(10) * 10
    index = torch.tensor([3, 3, 5, 0, 7])
    mask = torch.tensor([False, True, True, False, False])
    with SyncOps() as count:
        put_where(buf, index, torch.tensor([-1, -2, -3, -4, -5]), mask)
    assert buf.tolist() == [0, 10, 20, -2, 40, -3, 60, 70, 80, 90] and count.total == 0
    put_where(buf, index, 7, torch.zeros(5, dtype=torch.bool))  # none masked in: nothing changes
    assert buf.tolist() == [0, 10, 20, -2, 40, -3, 60, 70, 80, 90]
    put_where(buf, torch.tensor([1, 1, 2]), torch.tensor(5), torch.tensor([True, True, False]))  # one value, twice
    assert buf.tolist() == [0, 5, 20, -2, 40, -3, 60, 70, 80, 90]


def test_ids_routed_by_bucket_are_range_checked_on_the_device() -> None:
    """The sharded path's groups (``routed=True``): the range check is a device-side assert, so a training
    step maps in one host sync even where a table holds part of its buckets; an id outside still fails."""
    import pytest

    for config in CONFIGS:
        mappers = _mappers(config)
        group = MapperGroup(mappers, routed=True)
        group.state()
        with tensor_ops_only():
            for step, batch in enumerate(_batches(mappers, 6, seed=5)):
                with SyncOps() as count:
                    group.map(torch.cat(batch), [len(b) for b in batch], True)
                assert count.total <= 1, (config, step, dict(count.kinds))
            outside = torch.tensor([b for b in range(200) if not 1 <= bucket_of(torch.tensor([b]), 3).item() < 3][:1])
            with pytest.raises(RuntimeError, match=r"dynamic tables \['a', 'b', 'c'\]: an id routed here is outside"):
                group.map(outside, [0, 1, 0], True)
