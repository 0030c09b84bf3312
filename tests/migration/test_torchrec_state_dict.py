"""DistributedModelParallel's state dict with the model's own keys (ShardedTensor tables), as TorchRec's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig
from lightning_shardrec.testing import run_ranks


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(num_embeddings=12, embedding_dim=4, name="rw", feature_names=["a"]),
                EmbeddingBagConfig(num_embeddings=8, embedding_dim=4, name="tw", feature_names=["b"]),
                EmbeddingBagConfig(num_embeddings=6, embedding_dim=4, name="dp", feature_names=["c"]),
            ]
        )
        self.bag = nn.EmbeddingBag(10, 4, mode="sum")
        self.top = nn.Linear(4, 1)


def _dmp(world):
    from lightning_shardrec.distributed import DistributedModelParallel
    from lightning_shardrec.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    torch.manual_seed(0)
    model = Model()
    plain = {k: v.detach().clone() for k, v in model.state_dict().items()}
    kinds = {"rw": "row_wise", "tw": "table_wise", "dp": "data_parallel", "bag": "column_wise"}
    planner = EmbeddingShardingPlanner(
        Topology(world, compute_device="cpu"),
        constraints={t: ParameterConstraints(sharding_types=[k]) for t, k in kinds.items()},
    )
    return DistributedModelParallel(model, planner=planner, device="cpu", embedding_optimizer="sgd"), plain


def _round_trip(rank, world):
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    from lightning_shardrec.errors import ShardedWeightError

    dmp, plain = _dmp(world)
    state = copy.deepcopy(dmp.state_dict())  # values are views of the live weights, as TorchRec's
    kinds = {k: type(v).__name__ for k, v in state.items()}
    full = dmp.full_state_dict()
    same_as_plain = all(torch.equal(full[k], plain[k]) for k in plain)
    # load a changed plain state dict (full tensors): every rank takes its slices
    changed = {k: v + 1.0 for k, v in plain.items()}
    dmp.load_state_dict(changed)
    after = dmp.full_state_dict()
    loaded = all(torch.equal(after[k], changed[k]) for k in plain)
    # and the sharded layout back (ShardedTensors of the same plan)
    dmp.load_state_dict(state)
    back = dmp.full_state_dict()
    restored = all(torch.equal(back[k], plain[k]) for k in plain)
    try:
        dmp.module.bag.weight  # noqa: B018
        weight = "no error"
    except ShardedWeightError as e:
        weight = str(e)
    rw = state["ebc.embedding_bags.rw.weight"]
    assert isinstance(rw, ShardedTensor)
    return sorted(state), sorted(plain), kinds, same_as_plain, loaded, restored, weight, tuple(rw.size())


@pytest.mark.parametrize("world", [1, 2])
def test_state_dict_has_the_model_keys_and_round_trips(world):
    for keys, plain_keys, kinds, same, loaded, restored, weight, size in run_ranks(_round_trip, world):
        assert keys == plain_keys
        assert kinds["ebc.embedding_bags.rw.weight"] == "ShardedTensor"
        assert kinds["ebc.embedding_bags.tw.weight"] == "ShardedTensor"
        assert kinds["ebc.embedding_bags.dp.weight"] == "Tensor"
        assert kinds["top.weight"] == "Tensor"
        assert same and loaded and restored
        assert size == (12, 4)
        assert "EmbeddingBag 'bag'.weight: the table is sharded" in weight
        assert "self.bag(torch.arange(10), torch.arange(10)) returns the whole table" in weight


def _bad_loads(rank, world):
    dmp, plain = _dmp(world)
    out = []
    for bad in ({**plain, "ebc.embedding_bags.rw.weight": torch.zeros(3, 4)}, {"top.weight": plain["top.weight"]}):
        try:
            dmp.load_state_dict(bad)
        except (KeyError, ValueError) as e:
            out.append(str(e))
    result = dmp.load_state_dict({"top.weight": plain["top.weight"]}, strict=False)
    out.append(sorted(result.missing_keys)[:1])
    return out


def test_load_state_dict_names_what_does_not_fit():
    shape, missing, not_strict = run_ranks(_bad_loads, 1)[0]
    assert "'ebc.embedding_bags.rw.weight' has shape (3, 4), table 'rw' is [12, 4]" in shape
    assert "missing keys ['bag.weight', 'ebc.embedding_bags.dp.weight'" in missing
    assert not_strict == ["bag.weight"]
