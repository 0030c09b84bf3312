"""TorchRec's module paths resolve under ``lightning_shardrec``; names and paths we lack are refused by name."""

from __future__ import annotations

import importlib
import inspect
import re

import pytest
import torch

from lightning_shardrec.errors import MissingTorchRecFeatureError, UnsupportedFeatureError
from lightning_shardrec.testing import run_ranks

# the import lines of TorchRec's tutorials and examples (intro, sharding notebook, golden_training, prediction,
# retrieval two-tower), after s/torchrec/lightning_shardrec/
IMPORTS = {
    "sparse.jagged_tensor": ["JaggedTensor", "KeyedJaggedTensor", "KeyedTensor"],
    "modules.embedding_configs": ["EmbeddingBagConfig", "EmbeddingConfig", "PoolingType", "DataType"],
    "modules.embedding_modules": ["EmbeddingBagCollection", "EmbeddingCollection"],
    "modules.mlp": ["MLP", "Perceptron"],
    "distributed": ["DistributedModelParallel", "TrainPipelineSparseDist", "ModuleSharder", "ShardingEnv"],
    "distributed.model_parallel": ["DistributedModelParallel", "DataParallelWrapper"],
    "distributed.embeddingbag": ["EmbeddingBagCollectionSharder", "ShardedEmbeddingBagCollection"],
    "distributed.embedding": ["EmbeddingCollectionSharder", "ShardedEmbeddingCollection"],
    "distributed.embedding_types": ["EmbeddingComputeKernel", "BaseEmbeddingSharder"],
    "distributed.types": ["ShardingType", "ShardingPlan", "ParameterSharding", "ShardingEnv", "ModuleSharder"],
    "distributed.planner": ["EmbeddingShardingPlanner", "Topology", "ParameterConstraints", "PlannerError"],
    "distributed.planner.types": ["ParameterConstraints", "Topology", "PlannerError"],
    "distributed.planner.planners": ["EmbeddingShardingPlanner"],
    "distributed.fbgemm_qcomm_codec": ["CommType", "QCommsConfig", "get_qcomm_codecs_registry"],
    "distributed.train_pipeline": ["TrainPipelineSparseDist"],
    "optim": ["KeyedOptimizerWrapper", "CombinedOptimizer", "RowWiseAdagrad", "apply_optimizer_in_backward"],
    "optim.keyed": ["KeyedOptimizer", "KeyedOptimizerWrapper", "CombinedOptimizer"],
    "optim.optimizers": ["in_backward_optimizer_filter"],
    "optim.rowwise_adagrad": ["RowWiseAdagrad"],
    "optim.apply_optimizer_in_backward": ["apply_optimizer_in_backward"],
    "models.dlrm": ["DLRM", "DLRMTrain", "SparseArch"],
    "inference.state_dict_transform": ["state_dict_gather", "state_dict_to_device", "state_dict_all_gather_keys"],
    "datasets.random": ["RandomRecDataset"],
    "datasets.utils": ["Batch"],
    "datasets.criteo": ["DEFAULT_CAT_NAMES", "DEFAULT_INT_NAMES", "DEFAULT_LABEL_NAME", "CAT_FEATURE_COUNT"],
    "datasets.movielens": ["DEFAULT_RATINGS_COLUMN_NAMES", "DEFAULT_MOVIES_COLUMN_NAMES"],
}


@pytest.mark.parametrize("path", sorted(IMPORTS))
def test_torchrec_paths_hold_torchrec_names(path):
    module = importlib.import_module(f"lightning_shardrec.{path}")
    for name in IMPORTS[path]:
        assert getattr(module, name) is not None, f"{path}.{name}"


def test_the_same_class_behind_every_path():
    import lightning_shardrec as lsr
    from lightning_shardrec.distributed.types import ShardingType
    from lightning_shardrec.modules.embedding_configs import EmbeddingBagConfig
    from lightning_shardrec.sparse.jagged_tensor import KeyedJaggedTensor

    assert KeyedJaggedTensor is lsr.KeyedJaggedTensor and EmbeddingBagConfig is lsr.EmbeddingBagConfig
    assert ShardingType is lsr.ShardingType


@pytest.mark.parametrize(
    ("path", "name", "match"),
    [
        ("distributed.types", "ShardingEnv2D", "2D parallelism is not supported"),
        ("distributed.planner.types", "Enumerator", "the planner's stages are built in"),
        ("modules.embedding_configs", "VirtualTableConfig", "tables are not supported; size num_embeddings"),
        ("models.dlrm", "DLRM_DCN", "use lightning_shardrec.models.DCNv2"),
        ("distributed.train_pipeline", "PrefetchTrainPipelineSparseDist", "TrainPipelineSparseDist is the pipeline"),
        ("datasets.criteo", "criteo_kaggle", "read Criteo with lightning_shardrec.data"),
        ("datasets.movielens", "movielens_25m", "no MovieLens loader"),
        ("datasets.utils", "rand_split_train_val", "split the data with your DataModule"),
        ("modules.embedding_modules", "EmbeddingBagCollectionInterface", "concrete classes"),
        ("distributed.embedding_types", "KJTList", "not provided"),
    ],
)
def test_missing_torchrec_names_are_refused_by_name(path, name, match):
    module = importlib.import_module(f"lightning_shardrec.{path}")
    torchrec_name = re.escape(f"(TorchRec's torchrec.{path}.{name}) is not provided")
    with pytest.raises(MissingTorchRecFeatureError, match=torchrec_name + ".*" + match + r".*'Not provided'"):
        getattr(module, name)
    with pytest.raises(ImportError):  # ``from x import name`` fails as Python's own would, with the message
        exec(f"from lightning_shardrec.{path} import {name}", {})
    assert not hasattr(module, "no_such_name_anywhere")  # other names: a plain AttributeError


@pytest.mark.parametrize(
    "path", ["distributed.itep_embeddingbag", "modules.itep_modules", "distributed.fused_embeddingbag", "metrics.ne"]
)
def test_torchrec_paths_we_lack_raise_a_named_import_error(path):
    with pytest.raises(MissingTorchRecFeatureError, match=re.escape(f"(TorchRec's torchrec.{path}) is not provided")):
        importlib.import_module(f"lightning_shardrec.{path}")
    with pytest.raises(ModuleNotFoundError):  # a path TorchRec does not have either: Python's own error
        importlib.import_module("lightning_shardrec.no_such_module")


def test_signatures_keep_torchrec_positions():
    from lightning_shardrec.distributed import DistributedModelParallel, TrainPipelineSparseDist
    from lightning_shardrec.models.dlrm import DLRM
    from lightning_shardrec.optim import apply_optimizer_in_backward
    from lightning_shardrec.optim.keyed import KeyedOptimizerWrapper

    def names(f):
        return list(inspect.signature(f).parameters)

    assert names(DistributedModelParallel.__init__)[:9] == [
        "self", "module", "env", "device", "plan", "sharders", "init_data_parallel", "init_parameters",
        "data_parallel_wrapper",
    ]  # fmt: skip
    assert names(DLRM.__init__)[:6] == [
        "self", "embedding_bag_collection", "dense_in_features", "dense_arch_layer_sizes", "over_arch_layer_sizes",
        "dense_device",
    ]  # fmt: skip
    assert names(TrainPipelineSparseDist.__init__)[:4] == ["self", "model", "optimizer", "device"]
    assert names(apply_optimizer_in_backward) == ["optimizer_class", "params", "optimizer_kwargs"]
    assert names(KeyedOptimizerWrapper.__init__) == ["self", "params", "optim_factory"]


def test_sharder_and_qcomm_settings():
    from lightning_shardrec.distributed.dmp.sharders import (
        EmbeddingBagCollectionSharder,
        EmbeddingCollectionSharder,
        check_sharders,
        sharder_comm_precision,
    )
    from lightning_shardrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry
    from lightning_shardrec.modules import EmbeddingBagCollection

    assert get_qcomm_codecs_registry(None) is None
    same = EmbeddingBagCollectionSharder(
        qcomm_codecs_registry=get_qcomm_codecs_registry(QCommsConfig(CommType.BF16, CommType.BF16))
    )
    assert sharder_comm_precision([same], "x").value == "bf16"
    assert EmbeddingBagCollectionSharder().module_type is EmbeddingBagCollection
    mixed = get_qcomm_codecs_registry(QCommsConfig(forward_precision=CommType.FP16, backward_precision=CommType.BF16))
    got = sharder_comm_precision([EmbeddingBagCollectionSharder(qcomm_codecs_registry=mixed)], "x")
    assert (got.forward.value, got.backward.value, got.value) == ("fp16", "bf16", "fp16/bf16")
    from lightning_shardrec.lightning import ShardRecStrategy

    strategy = ShardRecStrategy(sharders=[EmbeddingBagCollectionSharder(qcomm_codecs_registry=mixed)])
    assert strategy.options.comm_precision == got  # forward fp16, backward bf16, as DistributedModelParallel takes it
    with pytest.raises(ValueError, match=r"comm_precision=bf16 but the sharders' QCommsConfig asks for fp16/bf16"):
        ShardRecStrategy(comm_precision="bf16", sharders=[EmbeddingBagCollectionSharder(qcomm_codecs_registry=mixed)])
    fp8_bwd = get_qcomm_codecs_registry(QCommsConfig(CommType.FP16, CommType.FP8))
    with pytest.raises(UnsupportedFeatureError, match="comm precision FP8 is not supported; use one of FP32, BF16"):
        sharder_comm_precision([EmbeddingBagCollectionSharder(qcomm_codecs_registry=fp8_bwd)], "x")
    with pytest.raises(
        UnsupportedFeatureError, match=r"x: sharders ask for different comm precisions \['bf16', 'fp16/bf16'\]"
    ):
        sharder_comm_precision(
            [
                EmbeddingBagCollectionSharder(qcomm_codecs_registry=mixed),
                EmbeddingCollectionSharder(
                    qcomm_codecs_registry=get_qcomm_codecs_registry(QCommsConfig(CommType.BF16, CommType.BF16))
                ),
            ],
            "x",
        )
    fp8 = get_qcomm_codecs_registry(QCommsConfig(CommType.FP8, CommType.FP8))
    with pytest.raises(UnsupportedFeatureError, match="comm precision FP8 is not supported; use one of FP32, BF16"):
        sharder_comm_precision([EmbeddingBagCollectionSharder(qcomm_codecs_registry=fp8)], "x")
    scaled = get_qcomm_codecs_registry(QCommsConfig(forward_loss_scale=2.0))
    with pytest.raises(UnsupportedFeatureError, match=r"QCommsConfig fields \{'forward_loss_scale': 2.0\}"):
        sharder_comm_precision([EmbeddingBagCollectionSharder(qcomm_codecs_registry=scaled)], "x")
    with pytest.raises(UnsupportedFeatureError, match=r"qcomm_codecs_registry=dict\) is not supported"):
        sharder_comm_precision([EmbeddingBagCollectionSharder(qcomm_codecs_registry={})], "x")
    with pytest.raises(UnsupportedFeatureError, match=r"x: sharders\[0\] is str; use EmbeddingBagCollectionSharder"):
        check_sharders(["ebc"], "x")
    with pytest.raises(ValueError, match="x: two sharders for EmbeddingBagCollection"):
        check_sharders([EmbeddingBagCollectionSharder(), EmbeddingBagCollectionSharder()], "x")


def test_random_dataset_draws_as_torchrec():
    from lightning_shardrec.datasets.random import RandomRecDataset

    ds = RandomRecDataset(keys=["a", "b"], batch_size=3, hash_size=10, ids_per_feature=2, num_dense=4, manual_seed=1,
                          num_generated_batches=2, num_batches=5)  # fmt: skip
    batches = list(ds)
    assert len(batches) == 5 and batches[2] is batches[0]  # two drawn, cycled
    g = torch.Generator().manual_seed(1)  # TorchRec's draw order: per key lengths then ids, dense, labels
    la = torch.randint(0, 3, (3,), dtype=torch.int32, generator=g)
    va = torch.randint(0, 10, (int(la.sum()),), generator=g)
    b = batches[0]
    assert b.sparse_features["a"].lengths().tolist() == la.tolist()
    assert b.sparse_features["a"].values().tolist() == va.tolist()
    assert b.dense_features.shape == (3, 4) and set(b.labels.tolist()) <= {0, 1}
    assert len(RandomRecDataset(keys=["a"], batch_size=3, hash_size=4, num_batches=5)) == 5  # TorchRec's len
    with pytest.raises(TypeError, match=r"RandomRecDataset\(num_batches=None\) is endless: it has no len\(\)"):
        len(RandomRecDataset(keys=["a"], batch_size=3, hash_size=4))
    with pytest.raises(ValueError, match=r"RandomRecDataset: hash_sizes has 1 entries for 2 keys \['a', 'b'\]"):
        RandomRecDataset(keys=["a", "b"], batch_size=3, hash_sizes=[4])
    with pytest.raises(ValueError, match="feature 'a': ids per sample must satisfy 0 <= 3 <= 2"):
        RandomRecDataset(keys=["a"], batch_size=3, ids_per_feature=2, min_ids_per_feature=3)


def test_mlp_applies_the_activation_after_every_layer():
    from lightning_shardrec.modules.mlp import MLP

    torch.manual_seed(0)
    mlp = MLP(4, [8, 2])
    assert (mlp(torch.randn(5, 4)) >= 0).all()  # relu after the last layer too, as TorchRec
    assert [p.shape for p in mlp.parameters()] == [(8, 4), (8,), (2, 8), (2,)]
    with pytest.raises(ValueError, match="MLP: activation must be 'relu', 'sigmoid', 'swish_layernorm' or a callable"):
        MLP(4, [2], activation="tanhh")
    with pytest.raises(ValueError, match="an activation factory taking no input must return a torch.nn.Module, got"):
        MLP(4, [2], activation=lambda: 3)
    with pytest.raises(TypeError, match="MLP: activation must be a string, a module or a callable, got int"):
        MLP(4, [2], activation=3)  # type: ignore[arg-type]


def test_mlp_takes_torchrec_18s_activations():
    # TorchRec 1.8's MLP (checked side by side: same parameter names and bit-identical outputs at the same seed):
    # "sigmoid", "swish_layernorm" (a SwishLayerNorm per layer), activation_on_last, factories called per layer
    from lightning_shardrec.modules.activation import SwishLayerNorm
    from lightning_shardrec.modules.mlp import MLP

    x = torch.randn(3, 6)
    swish = MLP(6, [5, 4], activation="swish_layernorm", activation_on_last=False)
    assert sorted(swish.state_dict()) == [
        "_mlp.0._activation_fn.norm.0.bias", "_mlp.0._activation_fn.norm.0.weight",
        "_mlp.0._linear.bias", "_mlp.0._linear.weight", "_mlp.1._linear.bias", "_mlp.1._linear.weight",
    ]  # fmt: skip
    hidden = swish._mlp[0]._linear(x)
    expected = swish._mlp[1]._linear(hidden * torch.sigmoid(torch.nn.functional.layer_norm(hidden, (5,))))
    torch.testing.assert_close(swish(x), expected)  # no activation after the last layer
    assert isinstance(swish._mlp[0]._activation_fn, SwishLayerNorm)
    sig = MLP(6, [4], activation="sigmoid")
    torch.testing.assert_close(sig(x), torch.sigmoid(sig._mlp[0]._linear(x)))
    made = MLP(6, [5, 4], activation=lambda: torch.nn.PReLU())  # a factory: one module per layer
    assert made._mlp[0]._activation_fn is not made._mlp[1]._activation_fn
    shared = torch.nn.PReLU()
    both = MLP(6, [5, 4], activation=shared)  # a module instance: shared by every layer
    assert both._mlp[0]._activation_fn is shared and both._mlp[1]._activation_fn is shared


def test_a_traced_mlp_scripts_as_torchrecs():
    # TorchRec's test_fx_script: fx then TorchScript of the dense modules (before: "Unknown type name '_Tensor_'")
    from lightning_shardrec.modules.mlp import MLP, Perceptron

    for module in (MLP(6, [5, 4]), Perceptron(6, 4)):
        scripted = torch.jit.script(torch.fx.symbolic_trace(module))
        x = torch.randn(2, 6)
        torch.testing.assert_close(scripted(x), module(x))


def _transform_errors(rank, world):
    from lightning_shardrec.inference.state_dict_transform import state_dict_gather, state_dict_to_device

    out = []
    try:
        state_dict_gather({"a": 3}, {"a": torch.zeros(1)})
    except ValueError as e:
        out.append(str(e))
    try:
        state_dict_to_device({"a": 3}, None, torch.device("cpu"))
    except ValueError as e:
        out.append(str(e))
    moved = state_dict_to_device({"b": torch.ones(2)}, None, torch.device("cpu"))
    return out, moved["b"].tolist()


def test_state_dict_transform_refuses_what_is_not_a_tensor():
    (gather, to_device), moved = run_ranks(_transform_errors, 1)[0]
    assert gather == "state_dict_gather: 'a' is a int, not a tensor or ShardedTensor"
    assert to_device == "state_dict_to_device: 'a' is a int, not a tensor"
    assert moved == [1.0, 1.0]


def test_subpackages_are_attributes_of_the_package_as_in_torchrec() -> None:
    """``import torchrec; torchrec.distributed.X`` works in TorchRec: the same after the rename, in a fresh process."""
    import subprocess
    import sys

    # a Lightning-free submodule first (as the intro tutorial does): the package root then loads nothing else
    code = (
        "from lightning_shardrec.sparse.jagged_tensor import KeyedJaggedTensor\n"
        "import lightning_shardrec as t\n"
        "print(t.distributed.DistributedModelParallel.__name__, t.sparse.jagged_tensor.KeyedJaggedTensor.__name__,"
        " t.optim.keyed.CombinedOptimizer.__name__)\n"
        "try:\n    t.no_such_package\nexcept AttributeError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == [
        "DistributedModelParallel KeyedJaggedTensor CombinedOptimizer",
        "module 'lightning_shardrec' has no attribute 'no_such_package'",
    ]
