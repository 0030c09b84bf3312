"""TorchRec's plan helpers (``distributed.sharding_plan``) and ``ParameterSharding.sharding_spec``: the same
shards as TorchRec 1.8 builds, and a model sharded by such a plan computes what the unsharded one does."""

from __future__ import annotations

import pytest
import torch

from lightning_shardrec.errors import UnsupportedFeatureError
from lightning_shardrec.testing import run_ranks

SHAPES = {"t0": (10, 16), "t1": (8, 16), "t2": (6, 8), "t3": (4, 8), "t4": (5, 8), "t5": (9, 256)}
# TorchRec 1.8's construct_module_sharding_plan(world_size=2, local_size=2, device_type="cpu") of the same calls:
# (sharding type, ranks, sharding_spec shards as (offsets, sizes, placement rank)); its kernels are "dense"
# (no in-backward optimizer), here "fused" (no sharded dense kernel: the model's fused optimizer trains them)
TORCHREC = {
    "t0": ("row_wise", [0, 1], [([0, 0], [5, 16], 0), ([5, 0], [5, 16], 1)]),
    "t1": ("column_wise", [0, 1], [([0, 0], [8, 8], 0), ([0, 8], [8, 8], 1)]),
    "t2": ("table_wise", [1], [([0, 0], [6, 8], 1)]),
    "t3": ("data_parallel", [0, 1], None),
    "t4": ("table_row_wise", [0, 1], [([0, 0], [3, 8], 0), ([3, 0], [2, 8], 1)]),
    "t5": ("column_wise", [0, 1], [([0, 0], [9, 100], 0), ([0, 100], [9, 156], 1)]),
}


def _ebc(device=None):
    from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig

    tables = [
        EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=[f"f{n}"])
        for n, (r, d) in SHAPES.items()
    ]
    return EmbeddingBagCollection(tables=tables, device=device)


def _plan(world=2):
    from lightning_shardrec.distributed import sharding_plan as sp

    generators = {
        "t0": sp.row_wise(),
        "t1": sp.column_wise(ranks=[0, 1]),
        "t2": sp.table_wise(rank=1),
        "t3": sp.data_parallel(),
        "t4": sp.table_row_wise(host_index=0),
        "t5": sp.column_wise(size_per_rank=[100, 156]),
    }
    return sp.construct_module_sharding_plan(
        _ebc(torch.device("meta")), generators, local_size=2, world_size=world, device_type="cpu"
    )


def test_plan_helpers_build_torchrecs_shards():
    for name, ps in _plan().items():
        spec = ps.sharding_spec
        shards = None if spec is None else [(s.shard_offsets, s.shard_sizes, s.placement.rank()) for s in spec.shards]
        kind = str(getattr(ps.sharding_type, "value", ps.sharding_type))
        assert (kind, list(ps.ranks), shards) == TORCHREC[name], name
        kernel = str(getattr(ps.compute_kernel, "value", ps.compute_kernel))
        assert kernel == ("dense" if kind == "data_parallel" else "fused")


def test_shard_sizes_and_offsets_are_torchrecs():
    from lightning_shardrec.distributed.sharding_plan import calculate_shard_sizes_and_offsets as calc

    assert calc(torch.empty(5, 8), 4, 4, "row_wise") == (
        [[2, 8], [2, 8], [1, 8], [0, 8]],
        [[0, 0], [2, 0], [4, 0], [5, 0]],
    )
    assert calc(torch.empty(9, 256), 2, 2, "column_wise") == ([[9, 128], [9, 128]], [[0, 0], [0, 128]])
    assert calc(torch.empty(10, 256), 4, 2, "grid_shard") == (
        [[5, 128], [5, 128], [5, 128], [5, 128]],
        [[0, 0], [5, 0], [0, 128], [5, 128]],
    )


def test_plan_helper_misuse_is_named():
    from lightning_shardrec.distributed import sharding_plan as sp

    meta = _ebc(torch.device("meta"))
    with pytest.raises(ValueError, match=r"doesn't match the shardable parameters of the module, got \['t0', "):
        sp.construct_module_sharding_plan(meta, {"t0": sp.row_wise()}, world_size=2, local_size=2)
    with pytest.raises(ValueError, match="column_wise: give ranks= .* or size_per_rank="):
        sp.column_wise()
    with pytest.raises(ValueError, match=r"column dim of 8 cannot be evenly divided across \[0, 1, 2\]"):
        sp.column_wise(ranks=[0, 1, 2])(meta.embedding_bags["t2"].weight, 2, 3, "cpu", None)
    with pytest.raises(ValueError, match=r"table_wise\(rank=3\): the rank must be in \[0, 2\)"):
        sp.table_wise(rank=3)(meta.embedding_bags["t2"].weight, 2, 2, "cpu", None)
    with pytest.raises(UnsupportedFeatureError, match=r"row_wise\(sizes_placement=\(\[3, 3\], 'cpu'\)\) is not"):
        sp.row_wise(([3, 3], "cpu"))
    assert set(sp.apply_to_all(meta, sp.row_wise())) == set(SHAPES)


def _sharded(rank, world):
    from lightning_shardrec import KeyedJaggedTensor
    from lightning_shardrec.distributed import DistributedModelParallel
    from lightning_shardrec.planner import ShardingPlan

    torch.manual_seed(3)
    ebc = _ebc()
    full = {k: v.detach().clone() for k, v in ebc.state_dict().items()}
    dmp = DistributedModelParallel(ebc, device=torch.device("cpu"), plan=ShardingPlan({"": _plan(world)}))
    g = torch.Generator().manual_seed(rank)
    lengths = torch.randint(0, 3, (len(SHAPES) * 2,), generator=g)
    values = torch.cat(
        [
            torch.randint(0, SHAPES[n][0], (int(n_ids),), generator=g)
            for n, n_ids in zip([n for n in SHAPES for _ in range(2)], lengths.tolist(), strict=True)
        ]
    )
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f{n}" for n in SHAPES], values=values, lengths=lengths)
    got = dmp(kjt).wait().to_dict()
    want = {}
    for n in SHAPES:
        f = kjt[f"f{n}"]
        w = full[f"embedding_bags.{n}.weight"]
        want[f"f{n}"] = torch.nn.functional.embedding_bag(
            f.values(), w, f.offsets(), mode="sum", include_last_offset=True
        )
    return {k: float((got[k] - want[k]).abs().max()) for k in want}


def test_a_model_sharded_by_the_helpers_plan_computes_the_unsharded_pooling():
    for errors in run_ranks(_sharded, 2):
        assert max(errors.values()) <= 1e-6, errors
