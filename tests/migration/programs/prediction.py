# ruff: noqa
# TorchRec's examples/prediction/predict_using_torchrec.py, shrunk (fewer samples and epochs; returns the losses).
# Kept with ``torchrec`` imports: tests/migration/test_torchrec_programs.py runs it after s/torchrec/lightning_shardrec/.
from typing import Dict, List

import torch
import torch.nn as nn
import torch.optim as optim
from torch.utils.data import DataLoader, Dataset
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


class RecommendationDataset(Dataset):
    def __init__(self, num_users: int = 100, num_items: int = 50, num_samples: int = 64) -> None:
        self.num_samples = num_samples
        self.user_ids = torch.randint(0, num_users, (num_samples,))
        self.item_ids = torch.randint(0, num_items, (num_samples,))
        self.ratings = torch.randint(0, 6, (num_samples,)).float()
        self.dense_features = torch.rand(num_samples, 4)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        return {
            "user_id": self.user_ids[idx],
            "item_id": self.item_ids[idx],
            "dense_features": self.dense_features[idx],
            "rating": self.ratings[idx],
        }


class TorchRecDLRM(nn.Module):
    def __init__(self, embedding_bag_collection: EmbeddingBagCollection, dense_in_features: int = 4) -> None:
        super().__init__()
        self.embedding_bag_collection = embedding_bag_collection
        embedding_dim = self.embedding_bag_collection.embedding_bag_configs()[0].embedding_dim
        self.dense_arch = nn.Sequential(nn.Linear(dense_in_features, embedding_dim), nn.ReLU())
        num_sparse = len(self.embedding_bag_collection.embedding_bag_configs())
        num_pairs = (num_sparse + 1) * num_sparse // 2
        self.over_arch = nn.Sequential(nn.Linear(embedding_dim + num_pairs, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        dense_output = self.dense_arch(dense_features)
        sparse_output = self.embedding_bag_collection(sparse_features)
        embeddings = [sparse_output[f] for f in sparse_output.keys()]
        all_features = [dense_output] + embeddings
        interactions = [dense_output]
        for i in range(len(all_features)):
            for j in range(i + 1, len(all_features)):
                interactions.append(torch.sum(all_features[i] * all_features[j], dim=1, keepdim=True))
        return self.over_arch(torch.cat(interactions, dim=1))


def create_kjt_from_batch(batch: Dict[str, torch.Tensor]) -> KeyedJaggedTensor:
    batch_size = batch["user_id"].size(0)
    values = torch.cat([batch["user_id"], batch["item_id"]])
    lengths = torch.ones(2 * batch_size, dtype=torch.int32)
    return KeyedJaggedTensor(keys=["user_id", "item_id"], values=values, lengths=lengths)


def main() -> List[float]:
    torch.manual_seed(42)
    dataset = RecommendationDataset()
    dataloader = DataLoader(dataset, batch_size=16, shuffle=False)
    eb_configs = [
        EmbeddingBagConfig(name="user_id", embedding_dim=8, num_embeddings=100, feature_names=["user_id"]),
        EmbeddingBagConfig(name="item_id", embedding_dim=8, num_embeddings=50, feature_names=["item_id"]),
    ]
    ebc = EmbeddingBagCollection(tables=eb_configs, device=torch.device("cpu"))
    model = TorchRecDLRM(embedding_bag_collection=ebc, dense_in_features=4)
    criterion = nn.MSELoss()
    optimizer = optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for batch in dataloader:
        sparse_features = create_kjt_from_batch(batch)
        optimizer.zero_grad()
        outputs = model(batch["dense_features"], sparse_features).squeeze()
        loss = criterion(outputs, batch["rating"])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
