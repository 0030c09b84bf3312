"""A collection built on ``meta`` (or under ``tables_on_meta()``) and sharded holds, on every
rank, exactly the shards the same collection built on CPU (same seed) gets: each shard
initialises its own rows and columns from the table's seed, bit for bit, for every
sharding type, pooled and sequence."""

from __future__ import annotations

import warnings

import pytest
import torch
from _plans import plan_of
from torch import nn

from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig
from lightning_shardrec.distributed.sharding import TableSharding
from lightning_shardrec.distributed.sharding.base import shard_init
from lightning_shardrec.planner import EmbeddingComputeKernel, ParameterSharding, ShardingType, ShardMetadata
from lightning_shardrec.testing import run_ranks

SHAPES = {"t_big": (40, 8), "t_small": (2, 12), "t_mid": (10, 8)}  # t_small: fewer rows than ranks
TYPES = [t.value for t in ShardingType]


class Wrapper(nn.Module):
    def __init__(self, coll: nn.Module) -> None:
        super().__init__()
        self.coll = coll
        self.dense = nn.Linear(3, 2)  # built after the tables: must see the same RNG stream


def build(sequence: bool, where: str) -> Wrapper:
    from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
    from lightning_shardrec.modules.table_init import tables_on_meta

    cls, cfg = (EmbeddingCollection, EmbeddingConfig) if sequence else (EmbeddingBagCollection, EmbeddingBagConfig)
    tables = [cfg(name=n, num_embeddings=r, embedding_dim=d, feature_names=[f"f_{n}"]) for n, (r, d) in SHAPES.items()]
    torch.manual_seed(5)
    if where == "context":
        with tables_on_meta():
            return Wrapper(cls(tables))
    return Wrapper(cls(tables, device=where))


def shards_of(rank: int, world: int) -> list[tuple[str, bool, str, bool]]:
    from lightning_shardrec.distributed import DistributedModelParallel
    from lightning_shardrec.planner import ShardingPlan

    out = []
    for sequence in (False, True):
        for kind in TYPES:
            plan = ShardingPlan({"coll": plan_of(dict.fromkeys(SHAPES, kind), SHAPES, world)})
            held = {}
            for where in ("cpu", "meta", "context"):
                model = build(sequence, where)
                on_meta = {p.device.type for p in model.coll.parameters()} == {"meta"}
                assert on_meta == (where != "cpu"), (where, on_meta)
                dmp = DistributedModelParallel(model, plan, device="cpu", embedding_optimizer="sgd", kernel="torch")
                shards = {
                    k: [(m.shard_offsets, w.detach().clone()) for m, w in v] for k, v in dmp.local_shards().items()
                }
                held[where] = (shards, model.dense.weight.detach().clone())
            want, dense = held["cpu"]
            for where in ("meta", "context"):
                got, got_dense = held[where]
                same = got.keys() == want.keys() and all(
                    [o for o, _ in got[k]] == [o for o, _ in want[k]]
                    and all(torch.equal(a, b) for (_, a), (_, b) in zip(got[k], want[k], strict=True))
                    for k in want
                )
                out.append((kind, sequence, where, same and torch.equal(got_dense, dense)))
    return out


def test_meta_built_shards_equal_cpu_built_shards_for_every_sharding_type() -> None:
    for results in run_ranks(shards_of, 2):
        assert len(results) == 2 * len(TYPES) * 2
        assert all(same for *_, same in results), [r for r in results if not r[-1]]


def test_a_custom_init_fn_on_meta_is_exact_whole_and_warns_in_pieces() -> None:
    config = EmbeddingBagConfig(num_embeddings=20, embedding_dim=4, name="t_custom", init_fn=lambda w: w.normal_())
    torch.manual_seed(2)
    real = EmbeddingBagCollection([config]).embedding_bags["t_custom"].weight.detach()
    torch.manual_seed(2)
    meta = EmbeddingBagCollection([config], device="meta")
    whole, top = ShardMetadata((0, 0), (20, 4), 0), ShardMetadata((10, 0), (10, 4), 1)
    plan = ParameterSharding("row_wise", EmbeddingComputeKernel.FUSED, [0, 1], [whole, top])
    table = TableSharding(config, plan, None, meta.init_seed("t_custom"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(shard_init(table, whole, torch.device("cpu")), real)  # table-wise / data-parallel: exact
    with pytest.warns(
        UserWarning, match=r"table 't_custom' was built on meta and has a custom init_fn.*\[10:20, 0:4\]"
    ):
        part = shard_init(table, top, torch.device("cpu"))
    assert part.shape == (10, 4) and not torch.equal(part, real[10:])
