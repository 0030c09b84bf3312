"""``ShardRecOptions``: the strategy's own options, parsed and checked once, the rest ``DDPStrategy``'s."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from lightning_shardrec import FusedOptimConfig, ParameterConstraints, ShardRecStrategy
from lightning_shardrec.distributed.comm.collectives import CommPrecision
from lightning_shardrec.kernels import KernelBackend
from lightning_shardrec.lightning import ShardRecOptions

DDP_ARGS = {
    "process_group_backend",
    "timeout",
    "find_unused_parameters",
    "static_graph",
    "gradient_as_bucket_view",
    "start_method",
}


def test_the_strategy_takes_ddps_arguments_and_exactly_the_options():
    own = [f.name for f in dataclasses.fields(ShardRecOptions)]
    params = inspect.signature(ShardRecStrategy).parameters
    assert [p for p in params if p not in DDP_ARGS] == own  # same names, same order
    assert set(params) == DDP_ARGS | set(own)
    assert ShardRecStrategy().options == ShardRecOptions()  # the same defaults, parsed alike


def test_options_hold_the_parsed_values_and_stay_frozen():
    constraints = {"t": ParameterConstraints(sharding_types=["table_wise"])}
    options = ShardRecStrategy(
        embedding_optimizer="adam",
        kernel="TORCH",
        comm_precision="fp16/bf16",
        comm_transport="SHM",
        constraints=constraints,
        embedding_modules=("a.emb",),
        planner_reserve=0,
    ).options
    assert options.embedding_optimizer == FusedOptimConfig(optimizer="adam")
    assert options.kernel is KernelBackend.TORCH
    fwd, bwd = options.comm_precision.forward, options.comm_precision.backward  # type: ignore[union-attr]
    assert (fwd, bwd) == (CommPrecision.FP16, CommPrecision.BF16)
    assert options.comm_transport == "shm"
    assert options.constraints == constraints and options.constraints is not constraints
    assert options.embedding_modules == ["a.emb"]
    assert isinstance(options.planner_reserve, float) and options.sharders == []
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.kernel = KernelBackend.FBGEMM  # type: ignore[misc]


@pytest.mark.parametrize(
    ("given", "error", "match"),
    [
        (
            {"heartbeat_timeout": 1.0},
            ValueError,
            r"heartbeat_timeout must be > 1 second \(or None to disable\), got 1.0",
        ),
        ({"embedding_lr": "0.1"}, ValueError, r"ShardRecStrategy: embedding_lr must be a number >= 0, got '0.1'"),
        ({"planner_batch_size": 2.5}, ValueError, r"ShardRecStrategy: planner_batch_size must be an int > 0, got 2.5"),
        (
            {"comm_precision": "fp8"},
            ValueError,
            r"unknown comm_precision 'fp8'; available: fp32, bf16, fp16, <forward>/<backward>",
        ),
        ({"comm_transport": "tcp"}, ValueError, r"unknown comm_transport 'tcp'; available: auto, shm, pg"),
        ({"checkpoint_format": "zip"}, ValueError, r"checkpoint_format must be 'sharded' or 'full', got 'zip'"),
        ({"embedding_modules": "emb"}, TypeError, r"ShardRecStrategy: embedding_modules must be True, False or a list"),
    ],
)
def test_options_refuse_bad_values_by_name(given, error, match):
    with pytest.raises(error, match=match):
        ShardRecOptions(**given)
    with pytest.raises(error, match=match):  # as the strategy's users reach them
        ShardRecStrategy(**given)


def test_the_fused_rule_comes_from_torchrec_then_the_option_then_the_users_optimizer():
    p = [torch.nn.Parameter(torch.zeros(2))]
    sgd = torch.optim.SGD(p, lr=0.3)
    holder = (sgd, sgd.param_groups[0])
    plain, named, lr = ShardRecOptions(), ShardRecOptions(embedding_optimizer="adam"), ShardRecOptions(embedding_lr=0.5)
    migrated = FusedOptimConfig(optimizer="rowwise_adagrad", lr=0.2)
    assert plain.fused_config(None, None) == FusedOptimConfig()
    assert plain.fused_config(holder, None) == FusedOptimConfig(optimizer="sgd", lr=0.3)
    assert named.fused_config(holder, None) == FusedOptimConfig(optimizer="adam")
    assert named.fused_config(holder, migrated) == migrated
    assert lr.fused_config(holder, migrated) == FusedOptimConfig(optimizer="rowwise_adagrad", lr=0.5)
    assert (plain.sets_fused_rule(), named.sets_fused_rule(), lr.sets_fused_rule()) == (False, True, True)
