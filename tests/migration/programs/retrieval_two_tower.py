# ruff: noqa
# TorchRec's examples/retrieval (modules/two_tower.py, data/dataloader.py, two_tower_train.py) in one file,
# shrunk to CPU: small tables, few steps, no faiss index; returns the DMP and the gathered CPU state dict.
# Kept with ``torchrec`` imports: tests/migration/test_torchrec_programs.py runs it after s/torchrec/lightning_shardrec/.
from typing import List, Optional, Tuple

import torch
from torch import distributed as dist
from torch import nn
from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
from torch.utils.data import DataLoader
from torchrec.datasets.movielens import DEFAULT_RATINGS_COLUMN_NAMES
from torchrec.datasets.random import RandomRecDataset
from torchrec.datasets.utils import Batch
from torchrec.distributed import TrainPipelineSparseDist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.inference.state_dict_transform import state_dict_gather, state_dict_to_device
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.mlp import MLP
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


class TwoTower(nn.Module):
    def __init__(self, embedding_bag_collection: EmbeddingBagCollection, layer_sizes: List[int], device: Optional[torch.device] = None) -> None:
        super().__init__()
        embedding_dim: int = embedding_bag_collection.embedding_bag_configs()[0].embedding_dim
        self._feature_names_query: List[str] = embedding_bag_collection.embedding_bag_configs()[0].feature_names
        self._candidate_feature_names: List[str] = embedding_bag_collection.embedding_bag_configs()[1].feature_names
        self.ebc = embedding_bag_collection
        self.query_proj = MLP(in_size=embedding_dim, layer_sizes=layer_sizes, device=device)
        self.candidate_proj = MLP(in_size=embedding_dim, layer_sizes=layer_sizes, device=device)

    def forward(self, kjt: KeyedJaggedTensor) -> Tuple[torch.Tensor, torch.Tensor]:
        pooled_embeddings = self.ebc(kjt)
        query_embedding = self.query_proj(torch.cat([pooled_embeddings[f] for f in self._feature_names_query], dim=1))
        candidate_embedding = self.candidate_proj(
            torch.cat([pooled_embeddings[f] for f in self._candidate_feature_names], dim=1)
        )
        return query_embedding, candidate_embedding


class TwoTowerTrainTask(nn.Module):
    def __init__(self, two_tower: TwoTower) -> None:
        super().__init__()
        self.two_tower = two_tower
        self.loss_fn: nn.Module = nn.BCEWithLogitsLoss()

    def forward(self, batch: Batch) -> Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        query_embedding, candidate_embedding = self.two_tower(batch.sparse_features)
        logits = (query_embedding * candidate_embedding).sum(dim=1).squeeze()
        loss = self.loss_fn(logits, batch.labels.float())
        return loss, (loss.detach(), logits.detach(), batch.labels.detach())


def get_dataloader(batch_size: int, num_embeddings: int, pin_memory: bool = False, num_workers: int = 0) -> DataLoader:
    two_tower_column_names = DEFAULT_RATINGS_COLUMN_NAMES[:2]
    return DataLoader(
        RandomRecDataset(keys=two_tower_column_names, batch_size=batch_size, hash_size=num_embeddings,
                         ids_per_feature=1, num_dense=0, manual_seed=3),
        batch_size=None, batch_sampler=None, pin_memory=pin_memory, num_workers=num_workers,
    )


def train(num_embeddings: int = 64, embedding_dim: int = 8, layer_sizes: Optional[List[int]] = None,
          learning_rate: float = 0.01, batch_size: int = 8, num_iterations: int = 4):
    if layer_sizes is None:
        layer_sizes = [16, 8]
    rank = dist.get_rank()
    device: torch.device = torch.device("cpu")
    backend = "gloo"
    two_tower_column_names = DEFAULT_RATINGS_COLUMN_NAMES[:2]
    eb_configs = [
        EmbeddingBagConfig(name=f"t_{feature_name}", embedding_dim=embedding_dim, num_embeddings=num_embeddings,
                           feature_names=[feature_name])
        for feature_name in two_tower_column_names
    ]
    torch.manual_seed(0)
    embedding_bag_collection = EmbeddingBagCollection(tables=eb_configs, device=torch.device("meta"))
    two_tower_model = TwoTower(embedding_bag_collection=embedding_bag_collection, layer_sizes=layer_sizes, device=device)
    two_tower_train_task = TwoTowerTrainTask(two_tower_model)
    apply_optimizer_in_backward(RowWiseAdagrad, two_tower_train_task.two_tower.ebc.parameters(), {"lr": learning_rate})
    model = DistributedModelParallel(module=two_tower_train_task, device=device)
    optimizer = KeyedOptimizerWrapper(dict(model.named_parameters()), lambda params: torch.optim.Adam(params, lr=learning_rate))
    dataloader = get_dataloader(batch_size=batch_size, num_embeddings=num_embeddings, pin_memory=(backend == "nccl"))
    dl_iterator = iter(dataloader)
    train_pipeline = TrainPipelineSparseDist(model, optimizer, device)
    for _ in range(num_iterations):
        try:
            train_pipeline.progress(dl_iterator)
        except StopIteration:
            break

    checkpoint_pg = dist.new_group(backend="gloo")
    cpu_state_dict = state_dict_to_device(model.state_dict(), pg=checkpoint_pg, device=torch.device("cpu"))
    ebc_cpu = EmbeddingBagCollection(tables=eb_configs, device=torch.device("meta"))
    two_tower_cpu = TwoTower(embedding_bag_collection=ebc_cpu, layer_sizes=layer_sizes)
    two_tower_train_cpu = TwoTowerTrainTask(two_tower_cpu)
    if rank == 0:
        two_tower_train_cpu = two_tower_train_cpu.to_empty(device="cpu")
    state_dict_gather(cpu_state_dict, two_tower_train_cpu.state_dict())
    dist.barrier()
    return model, two_tower_train_cpu
