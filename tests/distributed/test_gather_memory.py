"""Gathering whole tables to one rank costs the other ranks nothing and that rank one band.

``full_state_dict(dst=0)`` and the full-format save's gather (``FullGather.bands()``) at 8 and 16
ranks: each rank's resident peak (``VmHWM``) over what it held before is measured around the
gather. Before the banded tensor-collective gather, ``full_state_dict`` gathered every shard to
every rank with ``all_gather_object``: each rank's peak grew by every table (64 MiB here).
The gathered tables must equal what every rank contributed (the sharded model's rows).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lightning"))

from _memory import MiB, peak, reset_peak, rss  # noqa: E402

from lightning_shardrec.testing import run_ranks  # noqa: E402

TABLES, ROWS, DIM = 4, 2**18, 16  # 16 MiB per table, 64 MiB in all, row-wise over every rank
BAND = 2 * MiB  # the gathers' band, set small so one band is far below one table
ALLOWANCE = 6 * MiB  # what else moves around a gather (descriptions, allocator slack); a table is 16 MiB
TABLE = ROWS * DIM * 4
TOTAL = TABLES * TABLE


def _dmp(world: int):
    from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimConfig
    from lightning_shardrec.distributed import DistributedModelParallel
    from lightning_shardrec.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    configs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{i}"])
        for i in range(TABLES)
    ]
    planner = EmbeddingShardingPlanner(
        Topology(world, compute_device="cpu"),
        batch_size=8,
        constraints={c.name: ParameterConstraints(sharding_types=["row_wise"]) for c in configs},
    )
    ebc = EmbeddingBagCollection(configs, device=torch.device("meta"))
    return DistributedModelParallel(
        torch.nn.ModuleDict({"ebc": ebc}),
        planner=planner,
        device="cpu",
        embedding_optimizer=FusedOptimConfig(optimizer="sgd", lr=0.1),
    )


def _fill(dmp) -> None:
    """Every row of table ``t`` holds its global row index plus ``t`` (checkable on the gathering rank)."""
    for coll in dmp.sharded.values():
        for name, shards in coll.local_shards().items():
            for meta, w in shards:
                rows = torch.arange(meta.shard_offsets[0], meta.shard_offsets[0] + w.shape[0], dtype=torch.float32)
                w.copy_((rows + int(name[1:]))[:, None].expand_as(w))


def _right(weight: torch.Tensor, table: int) -> bool:
    first = weight[:, 0] == torch.arange(ROWS, dtype=torch.float32) + table
    return bool(first.all() and (weight == weight[:, :1]).all())


def gather_peaks(rank: int, world: int) -> dict[str, object]:
    """Peak over the resident size before each gather to rank 0, and whether rank 0 got the right tables."""
    from lightning_shardrec.checkpoint import sharded_state
    from lightning_shardrec.distributed.comm import band_gather

    defaults = sharded_state.PIECE_BYTES, band_gather.BAND_BYTES
    sharded_state.PIECE_BYTES, band_gather.BAND_BYTES = BAND, BAND
    try:
        return _peaks(world)
    finally:  # the rank processes serve later tests
        sharded_state.PIECE_BYTES, band_gather.BAND_BYTES = defaults


def _peaks(world: int) -> dict[str, object]:
    from lightning_shardrec.checkpoint import FullGather

    dmp = _dmp(world)
    _fill(dmp)
    out: dict[str, object] = {}
    reset_peak()
    before = rss()
    state = dmp.full_state_dict(dst=0)
    out["full_state_dict"] = peak() - before
    out["right"] = sorted(state) == [f"ebc.embedding_bags.t{i}.weight" for i in range(TABLES)] and all(
        _right(state[f"ebc.embedding_bags.t{i}.weight"], i) for i in range(TABLES)
    )
    out["empty"] = state == {}
    del state
    reset_peak()
    before = rss()
    for _ in FullGather(dmp.sharded, 0).bands():  # the full-format save: each band written, then dropped
        pass
    out["save"] = peak() - before
    return out


def _figures(found: list[dict[str, object]], world: int) -> str:
    each = ", ".join(f"{r}: {f['full_state_dict'] / MiB:.1f}/{f['save'] / MiB:.1f}" for r, f in enumerate(found))  # type: ignore[operator]
    return f"peak MiB over before (full_state_dict/save) per rank at {world} ranks: {each}; band {BAND / MiB:.0f} MiB"


def _check(world: int) -> None:
    found = run_ranks(gather_peaks, world, timeout=900)
    print(_figures(found, world))
    msg = _figures(found, world)
    assert found[0]["right"], "rank 0 did not gather every table right"
    assert all(f["empty"] for f in found[1:]), "a rank other than dst got a state dict"
    assert found[0]["full_state_dict"] < TOTAL + BAND + ALLOWANCE, msg  # the result itself and one band
    assert found[0]["save"] < BAND + ALLOWANCE, msg
    for f in found[1:]:  # never a full table (16 MiB), let alone every table (before: 64 MiB each)
        assert f["full_state_dict"] < BAND + ALLOWANCE and f["save"] < BAND + ALLOWANCE, msg


def test_gathers_to_one_rank_grow_no_other_rank_at_8_ranks():
    _check(8)


@pytest.mark.slow
@pytest.mark.scale
def test_gathers_to_one_rank_grow_no_other_rank_at_16_ranks():
    _check(16)
