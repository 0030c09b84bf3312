"""TorchRec's ways of setting the tables' fused optimizer: apply_optimizer_in_backward, sharders' fused_params."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimConfig, KeyedJaggedTensor
from lightning_shardrec.errors import UnsupportedFeatureError
from lightning_shardrec.optim import EmbOptimType, RowWiseAdagrad, apply_optimizer_in_backward
from lightning_shardrec.optim.fused_settings import config_of_fused_params, config_of_optimizer
from lightning_shardrec.testing import run_ranks


def _ebc() -> EmbeddingBagCollection:
    return EmbeddingBagCollection(
        [
            EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t", feature_names=["f"]),
            EmbeddingBagConfig(num_embeddings=6, embedding_dim=4, name="u", feature_names=["g"]),
        ]
    )


def _kjt() -> KeyedJaggedTensor:
    # f: one bag of id 2 three times; g: one bag of id 1
    return KeyedJaggedTensor(["f", "g"], torch.tensor([2, 2, 2, 1]), lengths=torch.tensor([3, 1]))


def _one_step(rank, world, how):
    from lightning_shardrec.distributed import DistributedModelParallel, EmbeddingBagCollectionSharder

    torch.manual_seed(0)
    ebc = _ebc()
    kwargs = {}
    if how == "in_backward":
        apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.5})
    elif how == "fused_params":
        sharder = EmbeddingBagCollectionSharder(
            fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.5}
        )
        kwargs["sharders"] = [sharder]
    before = {k: v.detach().clone() for k, v in ebc.state_dict().items()}
    dmp = DistributedModelParallel(ebc, device=torch.device("cpu"), **kwargs)
    dmp(_kjt()).wait().values().sum().backward()
    after = {k: shards[0][1].detach().clone() for k, shards in dmp.local_shards().items()}
    return before, after, dmp.fused_optimizer.config


@pytest.mark.parametrize("how", ["in_backward", "fused_params"])
def test_sgd_set_the_torchrec_way_moves_a_bag_by_lr_times_count(how):
    before, after, config = run_ranks(_one_step, 1, how)[0]
    assert config.optimizer is EmbOptimType.SGD and config.lr == 0.5
    step = after["embedding_bags.t.weight"] - before["embedding_bags.t.weight"]
    assert torch.allclose(step[2], torch.full((4,), -1.5))  # 3 ids in the bag, lr 0.5
    assert torch.count_nonzero(step[[0, 1, 3, 4, 5, 6, 7, 8, 9]]) == 0
    step_u = after["embedding_bags.u.weight"] - before["embedding_bags.u.weight"]
    assert torch.allclose(step_u[1], torch.full((4,), -0.5))


def test_unsharded_module_steps_in_backward_as_torch():
    ebc = _ebc()
    apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.5})
    before = ebc.embedding_bags["t"].weight.detach().clone()
    ebc(_kjt()).values().sum().backward()
    assert torch.allclose(ebc.embedding_bags["t"].weight[2] - before[2], torch.full((4,), -1.5))


def test_optimizer_classes_map_to_fused_rules():
    assert config_of_optimizer(torch.optim.SGD, {"lr": 0.5}, "t") == FusedOptimConfig(optimizer="sgd", lr=0.5)
    # only the given arguments pass on (TorchRec's fused_params): fbgemm's eps 1e-8, not torch's 1e-10
    assert config_of_optimizer(torch.optim.Adagrad, {}, "t") == FusedOptimConfig(optimizer="adagrad", eps=1e-8)
    assert config_of_optimizer(torch.optim.Adagrad, {"lr": 0.1}, "t") == FusedOptimConfig(
        optimizer="adagrad", lr=0.1, eps=1e-8
    )
    assert config_of_optimizer(RowWiseAdagrad, {"lr": 0.1}, "t") == FusedOptimConfig(
        optimizer="rowwise_adagrad", lr=0.1, eps=1e-8
    )
    assert config_of_optimizer(torch.optim.AdamW, {"lr": 0.1}, "t").weight_decay == 0.0  # torch's 0.01 not passed on
    adam = config_of_optimizer(torch.optim.Adam, {"lr": 0.1, "betas": (0.8, 0.9), "weight_decay": 0.1}, "t")
    assert adam == FusedOptimConfig(optimizer="adam", lr=0.1, beta1=0.8, beta2=0.9, weight_decay=0.1)
    assert config_of_optimizer(torch.optim.AdamW, {}, "t").optimizer is EmbOptimType.ADAMW


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        (
            torch.optim.SGD,
            {"lr": 0.5, "momentum": 0.9},
            r"table 't': SGD\(momentum=0.9\) is not supported by the fused sgd rule",
        ),
        (torch.optim.Adam, {"amsgrad": True}, r"Adam\(amsgrad=True\) is not supported by the fused adam rule"),
        (torch.optim.Adagrad, {"lr_decay": 0.1}, r"Adagrad\(lr_decay=0.1\) is not supported"),
        (torch.optim.Adam, {"foreach": True}, r"Adam\(foreach=True\) is not supported; the fused rule picks"),
        (torch.optim.SGD, {"lr": 0.1, "bogus": 1}, r"SGD has no argument\(s\) \['bogus'\]"),
        (torch.optim.RMSprop, {}, r"optimizer RMSprop cannot run fused inside backward; use one of torch.optim"),
    ],
)
def test_optimizer_settings_not_honoured_are_refused(cls, kwargs, match):
    with pytest.raises(UnsupportedFeatureError, match=match):
        config_of_optimizer(cls, kwargs, "table 't'")


@pytest.mark.needs_fbgemm
def test_fused_params_map_fbgemm_enums():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType as FbgemmOptim

    got = config_of_fused_params(
        {"optimizer": FbgemmOptim.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05, "eps": 1e-6, "weight_decay": 0.01},
        FusedOptimConfig(),
        "x",
    )
    assert got == FusedOptimConfig(optimizer="rowwise_adagrad", lr=0.05, eps=1e-6, weight_decay=0.01)
    with pytest.raises(ValueError, match="unknown embedding optimizer <EmbOptimType.LAMB: 'lamb'>"):
        config_of_fused_params({"optimizer": FbgemmOptim.LAMB}, FusedOptimConfig(), "x")


def test_fused_params_map_fbgemm_keys():
    got = config_of_fused_params(
        {"optimizer": "exact_rowwise_adagrad", "learning_rate": 0.05, "eps": 1e-6, "weight_decay": 0.01},
        FusedOptimConfig(),
        "x",
    )
    assert got == FusedOptimConfig(optimizer="rowwise_adagrad", lr=0.05, eps=1e-6, weight_decay=0.01)
    adamw = config_of_fused_params({"optimizer": "adam", "weight_decay_mode": "DECOUPLED"}, FusedOptimConfig(), "x")
    assert adamw.optimizer is EmbOptimType.ADAMW
    assert EmbOptimType.EXACT_SGD is EmbOptimType.SGD
    with pytest.raises(UnsupportedFeatureError, match=r"x: fused_params key 'cache_load_factor' \(= 0.2\) is not"):
        config_of_fused_params({"cache_load_factor": 0.2}, FusedOptimConfig(), "x")
    with pytest.raises(UnsupportedFeatureError, match="weight_decay_mode=COUNTER is not supported with sgd"):
        config_of_fused_params({"optimizer": "sgd", "weight_decay_mode": "COUNTER"}, FusedOptimConfig(), "x")


def _conflict(rank, world, case):
    from lightning_shardrec.distributed import DistributedModelParallel, EmbeddingBagCollectionSharder

    ebc = _ebc()
    try:
        if case == "two_tables":
            apply_optimizer_in_backward(torch.optim.SGD, [ebc.embedding_bags["t"].weight], {"lr": 0.5})
            DistributedModelParallel(ebc, device="cpu")
        elif case == "two_rules":
            apply_optimizer_in_backward(torch.optim.SGD, [ebc.embedding_bags["t"].weight], {"lr": 0.5})
            apply_optimizer_in_backward(torch.optim.SGD, [ebc.embedding_bags["u"].weight], {"lr": 0.1})
            DistributedModelParallel(ebc, device="cpu")
        elif case == "explicit":
            apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.5})
            DistributedModelParallel(ebc, device="cpu", embedding_optimizer="adagrad")
        elif case == "plan_twice":
            from lightning_shardrec.planner import ShardingPlan

            DistributedModelParallel(ebc, ShardingPlan({}), device="cpu", plan=ShardingPlan({}))
        elif case == "env":
            DistributedModelParallel(ebc, env=object())
        elif case == "from_local":
            from lightning_shardrec.distributed import ShardingEnv

            DistributedModelParallel(ebc, env=ShardingEnv.from_local(4, 0))
        elif case == "wrapper":
            DistributedModelParallel(ebc, device="cpu", data_parallel_wrapper=object())
        elif case == "sharder_override":

            class Mine(EmbeddingBagCollectionSharder):
                def sharding_types(self, compute_device_type):
                    return ["table_wise"]

            DistributedModelParallel(ebc, device="cpu", sharders=[Mine()])
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("two_tables", r"tables \['u'\] have no in-backward optimizer while other tables do; TorchRec would train"),
        ("two_rules", "the tables would train with different fused optimizers; one per model"),
        ("explicit", re.escape("embedding_optimizer=adagrad(lr=0.01, eps=1e-08, weight_decay=0.0) conflicts")),
        ("wrapper", "data_parallel_wrapper=object.* is not supported"),
        ("sharder_override", r"Mine.sharding_types\(\) is overridden; .* ParameterConstraints"),
    ],
)
def test_settings_that_would_not_be_honoured_are_refused(case, match):
    message = run_ranks(_conflict, 1, case)[0]
    assert message.startswith("UnsupportedFeatureError"), message
    assert re.search(match, message), message


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("plan_twice", "TypeError: DistributedModelParallel: a plan was given both second and as plan=; pass it once"),
        ("env", "TypeError: DistributedModelParallel: env must be a ShardingEnv, got object"),
        ("from_local", r"UnsupportedFeatureError: .*env=ShardingEnv\(world_size=4, rank=0\) has no process group"),
    ],
)
def test_dmp_arguments_in_torchrec_order_are_checked(case, match):
    message = run_ranks(_conflict, 1, case)[0]
    assert re.search(match, message), message
