"""Enums, constraints and shard metadata: parsing and the errors that list choices."""

import pytest

from lightning_shardrec.planner import (
    EmbeddingComputeKernel,
    ParameterConstraints,
    ParameterSharding,
    ShardingType,
    ShardMetadata,
)


def test_enum_values_are_torchrec_strings() -> None:
    assert [s.value for s in ShardingType] == [
        "table_wise",
        "row_wise",
        "column_wise",
        "table_row_wise",
        "grid_shard",
        "data_parallel",
    ]
    assert EmbeddingComputeKernel.FUSED.value == "fused"
    assert ShardingType.ROW_WISE == "row_wise"


def test_constraints_accept_strings_and_normalise() -> None:
    pc = ParameterConstraints(
        sharding_types=["row_wise", ShardingType.TABLE_WISE],
        compute_kernels=["FUSED"],
        ranks=[3, 1, 3],
    )
    assert pc.sharding_types == [ShardingType.ROW_WISE, ShardingType.TABLE_WISE]
    assert pc.compute_kernels == [EmbeddingComputeKernel.FUSED]
    assert pc.ranks == [1, 3]
    assert pc.pooling_factors == [1.0]


def test_unknown_sharding_type_lists_choices() -> None:
    with pytest.raises(
        ValueError, match=r"unknown sharding type 'diagonal'; available: table_wise, row_wise"
    ):
        ParameterConstraints(sharding_types=["diagonal"])


def test_unknown_kernel_lists_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown compute kernel 'uvm'; available: fused, dense"):
        ParameterConstraints(compute_kernels=["uvm"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sharding_types": []}, "sharding_types is empty"),
        ({"compute_kernels": []}, "compute_kernels is empty"),
        (
            {"pooling_factors": [0.0]},
            "pooling_factors must be a non-empty list of positive numbers",
        ),
        (
            {"num_poolings": [1.0, 2.0]},
            r"num_poolings needs one positive number per pooling factor \(1\)",
        ),
        ({"min_partition": 0}, "min_partition must be a positive int, got 0"),
        ({"ranks": [-1]}, r"ranks must be a non-empty list of ints >= 0, got \[-1\]"),
    ],
)
def test_bad_constraints(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ParameterConstraints(**kwargs)


def test_parameter_sharding_normalises_lists_and_strings() -> None:
    ps = ParameterSharding("table_wise", "fused", [2], [ShardMetadata([0, 0], [10, 4], 2)])
    assert ps.sharding_type is ShardingType.TABLE_WISE
    assert ps.ranks == (2,)
    assert ps.shards[0].shard_offsets == (0, 0)
    assert ParameterSharding.from_dict(ps.to_dict()) == ps


def test_shard_metadata_needs_pairs() -> None:
    with pytest.raises(ValueError, match=r"shard_offsets and shard_sizes are \(row, col\) pairs"):
        ShardMetadata((0,), (1, 2), 0)
