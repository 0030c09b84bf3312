# ruff: noqa
# TorchRec's examples/golden_training/train_dlrm.py, shrunk to CPU (small tables, few steps, returns the losses).
# Kept with ``torchrec`` imports: tests/migration/test_torchrec_programs.py runs it after s/torchrec/lightning_shardrec/.

import torch
from torch import distributed as dist
from torch.utils.data import IterableDataset
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES
from torchrec.datasets.random import RandomRecDataset
from torchrec.distributed import TrainPipelineSparseDist
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fbgemm_qcomm_codec import (
    CommType,
    QCommsConfig,
    get_qcomm_codecs_registry,
)
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad


def _get_random_dataset(num_embeddings: int, batch_size: int = 32) -> IterableDataset:
    return RandomRecDataset(
        keys=DEFAULT_CAT_NAMES,
        batch_size=batch_size,
        hash_size=num_embeddings,
        ids_per_feature=1,
        num_dense=len(DEFAULT_INT_NAMES),
        manual_seed=7,
    )


def train(
    num_embeddings: int = 64,
    embedding_dim: int = 8,
    dense_arch_layer_sizes: list[int] | None = None,
    over_arch_layer_sizes: list[int] | None = None,
    learning_rate: float = 0.1,
    num_iterations: int = 4,
    qcomm_forward_precision: CommType | None = CommType.FP16,
    qcomm_backward_precision: CommType | None = CommType.BF16,
) -> list[float]:
    if dense_arch_layer_sizes is None:
        dense_arch_layer_sizes = [16, embedding_dim]
    if over_arch_layer_sizes is None:
        over_arch_layer_sizes = [16, 1]

    device: torch.device = torch.device("cpu")
    backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)

    eb_configs = [
        EmbeddingBagConfig(
            name=f"t_{feature_name}",
            embedding_dim=embedding_dim,
            num_embeddings=num_embeddings,
            feature_names=[feature_name],
        )
        for feature_idx, feature_name in enumerate(DEFAULT_CAT_NAMES)
    ]
    torch.manual_seed(0)
    dlrm_model = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=eb_configs, device=torch.device("meta")),
        dense_in_features=len(DEFAULT_INT_NAMES),
        dense_arch_layer_sizes=dense_arch_layer_sizes,
        over_arch_layer_sizes=over_arch_layer_sizes,
        dense_device=device,
    )
    train_model = DLRMTrain(dlrm_model)

    apply_optimizer_in_backward(
        RowWiseAdagrad,
        train_model.model.sparse_arch.parameters(),
        {"lr": learning_rate},
    )
    qcomm_codecs_registry = (
        get_qcomm_codecs_registry(
            qcomms_config=QCommsConfig(
                forward_precision=qcomm_forward_precision,
                backward_precision=qcomm_backward_precision,
            )
        )
        if backend == "nccl"
        else None
    )
    sharder = EmbeddingBagCollectionSharder(qcomm_codecs_registry=qcomm_codecs_registry)

    model = DistributedModelParallel(
        module=train_model,
        device=device,
        sharders=[sharder],
    )

    non_fused_optimizer = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=learning_rate),
    )
    train_pipeline = TrainPipelineSparseDist(
        model,
        non_fused_optimizer,
        device,
    )

    train_iterator = iter(_get_random_dataset(num_embeddings=num_embeddings))
    losses = []
    for _ in range(int(num_iterations)):
        loss, _logits, _labels = train_pipeline.progress(train_iterator)
        losses.append(float(loss))
    return losses
