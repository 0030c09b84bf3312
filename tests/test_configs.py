"""Table and optimizer configs, and the error helpers they use."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from lightning_shardrec.configs import (
    DataType,
    EmbeddingBagConfig,
    EmbeddingConfig,
    EmbOptimType,
    FusedOptimConfig,
    PoolingType,
    UniformInit,
)
from lightning_shardrec.errors import (
    CheckpointError,
    PlannerError,
    ShardingError,
    ShardRecError,
    unknown_name,
)


def bag(**overrides: object) -> EmbeddingBagConfig:
    kwargs: dict[str, object] = {
        "num_embeddings": 100,
        "embedding_dim": 8,
        "name": "t_user",
        "feature_names": ["user"],
    }
    kwargs.update(overrides)
    return EmbeddingBagConfig(**kwargs)  # type: ignore[arg-type]


# --- table configs -------------------------------------------------------------------------
def test_defaults() -> None:
    cfg = bag()
    assert cfg.pooling is PoolingType.SUM
    assert cfg.data_type is DataType.FP32
    assert cfg.weight_init_min is None and cfg.weight_init_max is None
    assert cfg.init_fn == UniformInit(-0.1, 0.1) and cfg.need_pos is False
    assert cfg.num_features == 1


def test_positional_order_matches_torchrec() -> None:
    # TorchRec: (num_embeddings, embedding_dim, name, data_type, feature_names,
    #            weight_init_max, weight_init_min, num_embeddings_post_pruning, init_fn, need_pos)
    cfg = EmbeddingBagConfig(1000, 16, "t", DataType.FP16, ["a", "b"], 0.5, -0.25, 900, None, True)
    assert (cfg.num_embeddings, cfg.embedding_dim, cfg.name) == (1000, 16, "t")
    assert cfg.data_type is DataType.FP16
    assert cfg.feature_names == ["a", "b"]
    assert (cfg.weight_init_max, cfg.weight_init_min) == (0.5, -0.25)
    assert cfg.num_embeddings_post_pruning == 900
    assert cfg.need_pos is True
    assert cfg.init_range() == (-0.25, 0.5)


def test_frozen() -> None:
    cfg = bag()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.embedding_dim = 4  # type: ignore[misc]


def test_embedding_config_is_unpooled() -> None:
    cfg = EmbeddingConfig(10, 4, "seq", feature_names=["history"])
    assert not hasattr(cfg, "pooling")
    assert cfg.num_features == 1


def test_default_init_range_is_sqrt_one_over_rows() -> None:
    lo, hi = bag(num_embeddings=400).init_range()
    assert hi == pytest.approx(math.sqrt(1 / 400)) and lo == pytest.approx(-math.sqrt(1 / 400))


def test_init_weight_uniform_within_range() -> None:
    cfg = bag(weight_init_min=0.25, weight_init_max=0.5)
    weight = torch.zeros(100, 8)
    cfg.init_weight(weight)
    assert float(weight.min()) >= 0.25 and float(weight.max()) <= 0.5
    assert float(weight.std()) > 0  # actually filled


def test_init_weight_uses_init_fn() -> None:
    cfg = bag(init_fn=lambda w: w.fill_(3.0))
    weight = torch.zeros(4, 8, requires_grad=True)  # init runs under no_grad
    cfg.init_weight(weight)
    assert bool((weight == 3.0).all())


def test_data_type_bits() -> None:
    assert [d.bits for d in DataType] == [32, 16, 16, 8, 4, 2]


# --- table config errors ---------------------------------------------------------------------
def test_empty_name() -> None:
    with pytest.raises(
        ValueError, match=re.escape("EmbeddingBagConfig needs a table name (got name='')")
    ):
        bag(name="")


def test_empty_name_on_embedding_config_names_the_class() -> None:
    with pytest.raises(ValueError, match=re.escape("EmbeddingConfig needs a table name")):
        EmbeddingConfig(10, 4, feature_names=["f"])


@pytest.mark.parametrize("rows", [0, -5, 2.5])
def test_non_positive_rows(rows: object) -> None:
    msg = re.escape(
        f"EmbeddingBagConfig(name='t_user'): num_embeddings must be a positive int, got {rows!r}"
    )
    with pytest.raises(ValueError, match=msg):
        bag(num_embeddings=rows)


@pytest.mark.parametrize("dim", [0, -1])
def test_non_positive_dim(dim: int) -> None:
    msg = re.escape(
        f"EmbeddingBagConfig(name='t_user'): embedding_dim must be a positive int, got {dim}"
    )
    with pytest.raises(ValueError, match=msg):
        bag(embedding_dim=dim)


@pytest.mark.parametrize("names", [(), "user"])
def test_empty_or_string_feature_names(names: object) -> None:
    msg = re.escape(
        "EmbeddingBagConfig(name='t_user'): feature_names must be a non-empty list of "
        f"feature names, got {names!r}"
    )
    with pytest.raises(ValueError, match=msg):
        bag(feature_names=names)


def test_repeated_feature_names() -> None:
    msg = re.escape(
        "EmbeddingBagConfig(name='t_user'): feature_names repeat a name: ['a', 'b', 'a']"
    )
    with pytest.raises(ValueError, match=msg):
        bag(feature_names=["a", "b", "a"])


def test_pooling_none_on_bag_config() -> None:
    msg = re.escape(
        "EmbeddingBagConfig(name='t_user'): pooling NONE is not a pooled table; use EmbeddingConfig"
    )
    with pytest.raises(ValueError, match=msg):
        bag(pooling=PoolingType.NONE)


def test_init_min_above_max() -> None:
    msg = re.escape(
        "EmbeddingBagConfig(name='t_user'): weight_init_min 0.5 is above weight_init_max 0.1"
    )
    with pytest.raises(ValueError, match=msg):
        bag(weight_init_min=0.5, weight_init_max=0.1)


def test_init_min_above_default_max() -> None:
    # only the min is given: it is checked against the default max sqrt(1/100) = 0.1
    with pytest.raises(ValueError, match="weight_init_min 0.5 is above weight_init_max 0.1"):
        bag(weight_init_min=0.5)


# --- optimizer configs --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "expected"),
    [("sgd", EmbOptimType.SGD), ("ROWWISE_ADAGRAD", EmbOptimType.ROWWISE_ADAGRAD)],
)
def test_optimizer_parse(name: str, expected: EmbOptimType) -> None:
    assert EmbOptimType.parse(name) is expected
    assert EmbOptimType.parse(expected) is expected


def test_unknown_optimizer_lists_available() -> None:
    msg = re.escape(
        "unknown embedding optimizer 'lamb'; available: sgd, adagrad, rowwise_adagrad, adam, adamw"
    )
    with pytest.raises(ValueError, match=msg):
        EmbOptimType.parse("lamb")


def test_state_per_row() -> None:
    states = {o: o.state_per_row(16) for o in EmbOptimType}
    assert states == {
        EmbOptimType.SGD: 0,
        EmbOptimType.ADAGRAD: 16,
        EmbOptimType.ROWWISE_ADAGRAD: 1,
        EmbOptimType.ADAM: 32,
        EmbOptimType.ADAMW: 32,
    }


def test_fused_optim_defaults_and_parsing() -> None:
    cfg = FusedOptimConfig()
    assert cfg.optimizer is EmbOptimType.ADAGRAD and cfg.lr == 0.01 and cfg.weight_decay == 0.0
    assert FusedOptimConfig(optimizer="Adam", lr=0.1).optimizer is EmbOptimType.ADAM  # type: ignore[arg-type]


def test_fused_optim_is_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError):
        FusedOptimConfig(EmbOptimType.SGD)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        FusedOptimConfig().lr = 1.0  # type: ignore[misc]


def test_fused_optim_unknown_optimizer() -> None:
    with pytest.raises(
        ValueError, match=re.escape("unknown embedding optimizer 'rmsprop'; available: sgd,")
    ):
        FusedOptimConfig(optimizer="rmsprop")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["lr", "eps", "weight_decay"])
def test_fused_optim_negative(name: str) -> None:
    with pytest.raises(ValueError, match=f"FusedOptimConfig: {name} must be >= 0, got -0.5"):
        FusedOptimConfig(**{name: -0.5})


@pytest.mark.parametrize(("name", "value"), [("beta1", 1.0), ("beta2", -0.1)])
def test_fused_optim_beta_range(name: str, value: float) -> None:
    with pytest.raises(
        ValueError, match=re.escape(f"FusedOptimConfig: {name} must be in [0, 1), got {value}")
    ):
        FusedOptimConfig(**{name: value})


# --- error types ----------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [PlannerError, ShardingError, CheckpointError])
def test_stage_errors_are_value_errors_and_library_errors(cls: type[Exception]) -> None:
    assert issubclass(cls, ShardRecError) and issubclass(cls, ValueError)


def test_unknown_name_message() -> None:
    err = unknown_name("sharding type", "diagonal", ["table_wise", "row_wise"])
    assert isinstance(err, ValueError)
    assert str(err) == "unknown sharding type 'diagonal'; available: table_wise, row_wise"


def test_empty_feature_names_default_to_the_table_name() -> None:
    assert bag(feature_names=[]).feature_names == ["t_user"]
    assert EmbeddingBagConfig(10, 4, "t").feature_names == ["t"]


def test_torchrec_accessors() -> None:
    cfg = bag(feature_names=["a", "b"], weight_init_min=-0.5)
    assert cfg.num_features() == 2 and cfg.num_features == 2
    assert cfg.get_weight_init_min() == -0.5
    assert cfg.get_weight_init_max() == math.sqrt(1 / 100)


def test_torchrec_field_positions() -> None:
    # TorchRec: ..., init_fn, need_pos, input_dim, total_num_buckets, use_virtual_table,
    #           virtual_table_eviction_policy, enable_embedding_update, stash_weights, then pooling (17th)
    cfg = EmbeddingBagConfig(10, 4, "t", DataType.FP32, ["a"], None, None, None, None, False,
                             None, None, False, None, False, False, PoolingType.MEAN)
    assert cfg.pooling is PoolingType.MEAN
    assert [f.name for f in dataclasses.fields(cfg) if not f.kw_only][8:] == [  # kw_only: not positional
        "init_fn", "need_pos", "input_dim", "total_num_buckets", "use_virtual_table",
        "virtual_table_eviction_policy", "enable_embedding_update", "stash_weights", "pooling",
    ]


@pytest.mark.parametrize(
    ("field", "value"),
    [("input_dim", 8), ("total_num_buckets", 4), ("use_virtual_table", True),
     ("virtual_table_eviction_policy", object()), ("enable_embedding_update", True), ("stash_weights", True)],
)
def test_unimplemented_torchrec_fields_are_refused(field: str, value: object) -> None:
    from lightning_shardrec.errors import UnsupportedFeatureError

    msg = rf"EmbeddingBagConfig\(name='t_user'\): {field}=.* is not supported"
    with pytest.raises(UnsupportedFeatureError, match=msg):
        bag(**{field: value})
    with pytest.raises(NotImplementedError):  # what TorchRec-era callers may catch
        EmbeddingConfig(10, 4, "t", feature_names=["f"], **{field: value})


def test_init_fn_must_be_callable() -> None:
    with pytest.raises(ValueError, match=r"EmbeddingBagConfig\(name='t_user'\): init_fn must be callable"):
        bag(init_fn=3)


def test_default_init_fn_follows_the_range() -> None:
    cfg = bag(weight_init_max=0.5)
    assert cfg.init_fn == UniformInit(-0.1, 0.5) and cfg == bag(weight_init_max=0.5)
    assert dataclasses.replace(cfg, weight_init_min=0.0).init_fn == UniformInit(0.0, 0.5)
    w = torch.empty(1000)
    cfg.init_fn(w)
    assert float(w.min()) >= -0.1 and float(w.max()) <= 0.5
