"""TorchRec's sharder methods and awaitables (issue 43, item 1).

Expected values are TorchRec 1.8's answers (``/work/venvs/torchrec``): ``EmbeddingBagCollectionSharder()``
``.compute_kernels(t, "cpu")`` is ``["dense"]`` for data_parallel, ``["fused"]`` otherwise;
``.storage_usage(torch.empty(10, 8), "cpu", "fused")`` is ``{"ddr": 320}``, on "cuda" ``{"hbm": 320}``;
``.shardable_parameters(ebc)`` maps table names to the weights; ``fused_params`` is the dict given.
"""

from __future__ import annotations

import pytest
import torch

from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from lightning_shardrec.distributed.embedding import EmbeddingCollectionSharder
from lightning_shardrec.distributed.embeddingbag import EmbeddingBagCollectionSharder, ShardedEmbeddingBagCollection
from lightning_shardrec.distributed.shard import shard_collection
from lightning_shardrec.distributed.types import LazyAwaitable, NoWait, ParameterSharding, ShardingEnv
from lightning_shardrec.errors import UnsupportedFeatureError


def _ebc() -> EmbeddingBagCollection:
    return EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=10, feature_names=["f1"])]
    )


def test_sharder_methods_answer_as_torchrec():
    s = EmbeddingBagCollectionSharder(fused_params={"learning_rate": 0.1})
    assert s.fused_params == {"learning_rate": 0.1} and EmbeddingBagCollectionSharder().fused_params is None
    assert s.module_type is EmbeddingBagCollection and s.sharded_module_type is ShardedEmbeddingBagCollection
    assert s.sharding_types("cuda")[:3] == ["data_parallel", "table_wise", "column_wise"]
    assert s.compute_kernels("data_parallel", "cpu") == ["dense"] and s.compute_kernels("row_wise", "cpu") == ["fused"]
    assert s.storage_usage(torch.empty(10, 8), "cpu", "fused") == {"ddr": 320}
    assert s.storage_usage(torch.empty(10, 8, device="meta"), "cuda", "fused") == {"hbm": 320}
    ebc = _ebc()
    assert list(s.shardable_parameters(ebc)) == ["t1"]
    assert s.shardable_parameters(ebc)["t1"] is next(ebc.parameters())
    assert EmbeddingCollectionSharder().module_type is EmbeddingCollection


def test_shard_refuses_another_collection_type_and_a_plan_without_the_table():
    env = ShardingEnv.from_local(1, 0)
    ec = EmbeddingCollection(
        tables=[EmbeddingConfig(name="t1", embedding_dim=8, num_embeddings=10, feature_names=["f1"])]
    )
    with pytest.raises(TypeError, match="EmbeddingBagCollectionSharder.shard: expects a EmbeddingBagCollection, got"):
        EmbeddingBagCollectionSharder().shard(ec, {}, env, "cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"the plan has no entry for table\(s\) 't1' of EmbeddingBagCollection"):
        EmbeddingBagCollectionSharder().shard(_ebc(), {}, env, "cpu")
    with pytest.raises(UnsupportedFeatureError, match="shard: cannot shard a Linear; shardable: "):
        shard_collection(torch.nn.Linear(2, 2), {}, env, "cpu")


def test_a_one_rank_shard_equals_the_module():
    ebc = _ebc()
    shard = {"shard_offsets": [0, 0], "shard_sizes": [10, 8], "rank": 0}
    table = ParameterSharding("table_wise", "fused", [0], [shard])
    sharded = EmbeddingBagCollectionSharder().shard(ebc, {"t1": table}, ShardingEnv.from_local(1, 0), "cpu")
    from lightning_shardrec import KeyedJaggedTensor

    kjt = KeyedJaggedTensor(keys=["f1"], values=torch.tensor([1, 3, 9]), lengths=torch.tensor([2, 1]))
    torch.testing.assert_close(sharded(kjt).wait().values(), ebc(kjt).values())
    assert sharded.fused_optimizer.param_groups[0]["lr"] == 0.01  # the default optimizer: adagrad, lr 0.01


def test_shard_takes_a_generator_a_dict_of_them_or_shardings_as_torchrec():
    # torchrec.distributed.shard.shard(module, plan, env, device, sharder): TorchRec's "sharded_ebc = shard(ebc,
    # table_row_wise(host_index=0))"; generators run per table with (param, local size, world, device type, sharder)
    from lightning_shardrec import KeyedJaggedTensor
    from lightning_shardrec.distributed.shard import shard, shard_modules
    from lightning_shardrec.distributed.sharding_plan import table_row_wise, table_wise
    from lightning_shardrec.distributed.types import ShardingPlan

    env = ShardingEnv.from_local(1, 0)
    kjt = KeyedJaggedTensor(keys=["f1"], values=torch.tensor([1, 3, 9]), lengths=torch.tensor([2, 1]))
    ebc = _ebc()
    one = shard(ebc, table_row_wise(host_index=0), env, "cpu")
    assert isinstance(one, ShardedEmbeddingBagCollection)
    torch.testing.assert_close(one(kjt).wait().values(), ebc(kjt).values())
    by_table = shard(ebc, {"t1": table_wise(rank=0)}, env, torch.device("cpu"))
    assert by_table.module_sharding_plan["t1"].sharding_type == "table_wise"
    given = shard(ebc, {"t1": by_table.module_sharding_plan["t1"]}, env, "cpu", EmbeddingBagCollectionSharder())
    torch.testing.assert_close(given(kjt).wait().values(), ebc(kjt).values())
    with pytest.raises(ValueError, match=r"shard: the plan names tables \['t9'\] that the module does not have"):
        shard(ebc, {"t9": table_wise(rank=0)}, env, "cpu")
    # shard_modules takes TorchRec's positional order: (module, env, device, plan, sharders, init_params)
    model = torch.nn.Sequential()
    model.add_module("ebc", _ebc())
    out = shard_modules(model, env, torch.device("cpu"), ShardingPlan({"ebc": by_table.module_sharding_plan}))
    assert out is model and isinstance(model.ebc, ShardedEmbeddingBagCollection)

class _Ones(LazyAwaitable[torch.Tensor]):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def _wait_impl(self) -> torch.Tensor:
        self.calls += 1
        return torch.ones(2, 3)


def test_awaitables_wait_once_run_callbacks_and_lazy_ones_wait_when_used():
    a = _Ones()
    a.callbacks.append(lambda t: t * 2)
    assert a.shape == (2, 3)  # an attribute of the result: waits
    assert torch.equal(torch.add(a, 1), torch.full((2, 3), 3.0))  # a torch function: waits
    assert torch.equal(a.wait(), torch.full((2, 3), 2.0)) and a.calls == 1
    assert NoWait(5).wait() == 5


def test_lazy_awaitables_wait_under_operators_and_lazy_getitem():
    # TorchRec's LazyAwaitable operators (torch.fx's magic methods and their reflections), LazyNoWait,
    # LazyGetItemMixin (a[key] stays lazy) and the error for a subclass that skipped super().__init__()
    from lightning_shardrec.distributed.types import LazyGetItemMixin, LazyNoWait

    a = _Ones()
    assert torch.equal(a + 1, torch.full((2, 3), 2.0)) and torch.equal(2 * a, torch.full((2, 3), 2.0))
    assert torch.equal(-a, -torch.ones(2, 3)) and torch.equal(a[0], torch.ones(3)) and a.calls == 1
    assert LazyNoWait(3) + 4 == 7 and 10 - LazyNoWait(3) == 7 and (LazyNoWait(3) == 3) is True
    assert len({LazyNoWait(1), LazyNoWait(1)}) == 2  # still hashable, by identity

    class Parts(LazyGetItemMixin[str, torch.Tensor], LazyAwaitable[dict]):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def _wait_impl(self) -> dict:
            self.calls += 1
            return {"x": torch.tensor(2.0), "y": torch.tensor(5.0)}

    parts = Parts()
    x, y = parts["x"], parts["y"]
    assert isinstance(x, LazyAwaitable) and x._result is None and parts._result is None and parts.calls == 0
    assert torch.add(x, y) == 7.0 and parts.calls == 1

    class Forgot(LazyAwaitable[int]):
        def __init__(self) -> None:  # no super().__init__()
            pass

        def _wait_impl(self) -> int:
            return 1

    with pytest.raises(RuntimeError, match="has not been initialized properly, did you forget to call 'super\\(\\)'"):
        Forgot() + 1

def _unwrap(rank: int, world: int) -> tuple[bool, ...]:
    from lightning_shardrec.distributed.model_parallel import (
        DistributedModelParallel,
        get_default_sharders,
        get_module,
        get_unwrapped_module,
    )
    from lightning_shardrec.distributed.types import EmbeddingModuleShardingPlan

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = _ebc()
            self.head = torch.nn.Linear(8, 1)

    model = Model()
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), sharders=get_default_sharders())
    plan = dmp.plan.plan["ebc"]
    return (
        get_unwrapped_module(dmp) is model,
        isinstance(get_module(dmp), torch.nn.parallel.DistributedDataParallel),  # DDP inside DMP is kept
        get_unwrapped_module(model) is model,
        isinstance(plan, EmbeddingModuleShardingPlan) and plan == dict(plan),
        model.ebc.module_sharding_plan == plan,  # the sharded collection's own plan
    )


def test_model_parallel_helpers_unwrap_and_plans_are_torchrecs_types():
    from lightning_shardrec.testing import run_ranks

    assert run_ranks(_unwrap, 2) == [(True,) * 5] * 2
