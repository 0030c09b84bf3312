"""Tables named like ModuleDict's methods (``items``, ``keys``, ...) shard, train, gather and
checkpoint under their names, one of each sharding type, on 2 ranks."""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_shardrec.testing import run_ranks

KINDS = {
    "items": "row_wise",
    "keys": "table_wise",
    "values": "column_wise",
    "update": "data_parallel",
    "pop": "table_wise",
}
ROWS, DIM, BATCH = 12, 8, 6  # global batch, 3 samples per rank


def _ebc():
    from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig

    torch.manual_seed(0)
    return EmbeddingBagCollection(
        [EmbeddingBagConfig(name=n, num_embeddings=ROWS, embedding_dim=DIM, feature_names=[f"f_{n}"]) for n in KINDS]
    )


def _kjt(lo: int, hi: int):
    from lightning_shardrec import KeyedJaggedTensor

    bags = {
        n: [[(3 * i + j + k) % ROWS for k in range(1 + (i + j) % 3)] for i in range(BATCH)] for j, n in enumerate(KINDS)
    }
    lengths = [len(bags[n][i]) for n in KINDS for i in range(lo, hi)]
    values = [v for n in KINDS for i in range(lo, hi) for v in bags[n][i]]
    return KeyedJaggedTensor([f"f_{n}" for n in KINDS], torch.tensor(values), lengths=torch.tensor(lengths))


def _plan(world: int):
    from lightning_shardrec.planner import EmbeddingComputeKernel, ParameterSharding, ShardingType, ShardMetadata

    out = {}
    for i, (name, kind) in enumerate(KINDS.items()):
        st = ShardingType(kind)
        if st is ShardingType.ROW_WISE:
            shards = [ShardMetadata((r * ROWS // world, 0), (ROWS // world, DIM), r) for r in range(world)]
        elif st is ShardingType.COLUMN_WISE:
            shards = [ShardMetadata((0, r * DIM // world), (ROWS, DIM // world), r) for r in range(world)]
        elif st is ShardingType.DATA_PARALLEL:
            shards = [ShardMetadata((0, 0), (ROWS, DIM), r) for r in range(world)]
        else:
            shards = [ShardMetadata((0, 0), (ROWS, DIM), i % world)]
        kernel = EmbeddingComputeKernel.DENSE if st is ShardingType.DATA_PARALLEL else EmbeddingComputeKernel.FUSED
        out[name] = ParameterSharding(st, kernel, [s.rank for s in shards], shards)
    return out


def _sharded_run(rank, world, path):
    from lightning_shardrec.checkpoint import convert_to_full, gather_full_state, save_sharded
    from lightning_shardrec.distributed import DistributedModelParallel
    from lightning_shardrec.planner import ShardingPlan

    dmp = DistributedModelParallel(_ebc(), plan=ShardingPlan({"": _plan(world)}), device="cpu")
    lo, hi = rank * BATCH // world, (rank + 1) * BATCH // world
    pooled = dmp(_kjt(lo, hi))
    pooled.values().sum().backward()  # fused tables step in backward
    weights, _ = gather_full_state(dmp.sharded)
    save_sharded(path, dmp.sharded, {}, {}, rank)
    if rank == 0:
        convert_to_full(path, f"{path}.full")
    return pooled.values().detach(), weights, sorted(dmp.local_shards())


def test_clashing_table_names_shard_gather_and_checkpoint(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    results = run_ranks(_sharded_run, 2, path)
    reference = _ebc()
    want = reference(_kjt(0, BATCH)).values()
    keys = [f"embedding_bags.{n}.weight" for n in KINDS]
    for rank, (pooled, weights, local) in enumerate(results):
        torch.testing.assert_close(pooled, want[rank * 3 : (rank + 1) * 3])  # forward before any update
        assert sorted(weights) == sorted(keys) and set(local) <= set(keys)
    assert {k for _, _, local in results for k in local} == set(keys)
    full = torch.load(f"{path}.full", weights_only=True)["state_dict"]
    assert sorted(full) == sorted(keys)
    reference.load_state_dict(full)  # the unsharded model reads the checkpoint under the same names
    for n in ("items", "keys", "values", "pop"):  # fused tables moved in backward, and were saved moved
        torch.testing.assert_close(full[f"embedding_bags.{n}.weight"], results[0][1][f"embedding_bags.{n}.weight"])
        assert not torch.equal(full[f"embedding_bags.{n}.weight"], _ebc().embedding_bags[n].weight.detach())
