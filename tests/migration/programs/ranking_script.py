# ruff: noqa
# A TorchRec user's own ranking training script (written against TorchRec 1.8's public API, CPU/gloo):
# a data_parallel table with no in-backward optimizer (the dense optimizer steps it), fused Adagrad on the
# others given only {"lr": 0.1}, the dense layers built after a meta EBC, every weight overwritten after
# sharding by a fixed function (so the numbers compare with TorchRec's exactly), the pipeline over two
# epochs, then an eval pass through EvalPipelineSparseDist.
# Kept with ``torchrec`` imports: tests/migration/test_torchrec_training_script.py runs it after
# s/torchrec/lightning_shardrec/; the expected values there are this program's output under TorchRec 1.8.

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed import DistributedModelParallel, TrainPipelineSparseDist
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.train_pipeline import EvalPipelineSparseDist
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.streamable import Pipelineable

FEATURES = ["f_small", "f_a", "f_b"]
ROWS, DIM, DENSE_IN, BATCH = 16, 8, 4, 4


class Batch(Pipelineable):
    def __init__(self, dense: torch.Tensor, sparse: KeyedJaggedTensor, labels: torch.Tensor) -> None:
        self.dense, self.sparse, self.labels = dense, sparse, labels

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        return Batch(self.dense.to(device), self.sparse.to(device), self.labels.to(device))

    def record_stream(self, stream: torch.Stream) -> None:
        pass


class Ranker(nn.Module):
    def __init__(self, ebc: EmbeddingBagCollection) -> None:
        super().__init__()
        self.ebc = ebc
        self.dense = nn.Sequential(nn.Linear(DENSE_IN, DIM), nn.ReLU())
        self.over = nn.Linear(DIM * (1 + len(FEATURES)), 1)

    def forward(self, batch: Batch):
        pooled = self.ebc(batch.sparse).to_dict()
        x = torch.cat([self.dense(batch.dense)] + [pooled[f] for f in FEATURES], dim=1)
        logits = self.over(x).squeeze(-1)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach())


def make_batch(step: int, rank: int) -> Batch:
    g = torch.Generator().manual_seed(1000 * step + rank)
    lengths = torch.randint(0, 3, (len(FEATURES) * BATCH,), generator=g)
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
    return Batch(
        torch.rand(BATCH, DENSE_IN, generator=g),
        KeyedJaggedTensor.from_lengths_sync(keys=FEATURES, values=values, lengths=lengths),
        torch.randint(0, 2, (BATCH,), generator=g).float(),
    )


def fixed(name: str, offsets, shape) -> torch.Tensor:
    rows = torch.arange(offsets[0], offsets[0] + shape[0]).unsqueeze(1).float()
    cols = torch.arange(offsets[1], offsets[1] + shape[1]).unsqueeze(0).float() if len(shape) > 1 else 0.0
    return 0.3 * torch.sin(0.7 * rows + 1.3 * cols + 0.1 * len(name))


def overwrite(dmp: nn.Module) -> None:
    with torch.no_grad():
        for name, t in dmp.state_dict().items():
            if hasattr(t, "local_shards"):
                for shard in t.local_shards():
                    shard.tensor.copy_(fixed(name, shard.metadata.shard_offsets, shard.tensor.shape))
            elif t.dim() == 2:
                t.copy_(fixed(name, [0, 0], t.shape))
            else:
                t.copy_(fixed(name, [0], t.shape).reshape(t.shape))


def main(epochs: int = 2, steps: int = 3):
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=f"t_{f[2:]}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f])
            for f in FEATURES
        ],
        device=torch.device("meta"),
    )
    model = Ranker(ebc)
    dense_init = model.dense[0].weight.detach().clone()  # built after the meta tables
    apply_optimizer_in_backward(
        torch.optim.Adagrad, [ebc.embedding_bags["t_a"].weight, ebc.embedding_bags["t_b"].weight], {"lr": 0.1}
    )
    sharders = [EmbeddingBagCollectionSharder()]
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device="cpu"),
        constraints={
            "t_small": ParameterConstraints(sharding_types=["data_parallel"]),
            "t_a": ParameterConstraints(sharding_types=["table_wise"]),
            "t_b": ParameterConstraints(sharding_types=["table_wise"]),
        },
    )
    plan = planner.collective_plan(model, sharders, dist.group.WORLD)
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=sharders)
    overwrite(dmp)
    dense_params = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    dense_opt = KeyedOptimizerWrapper(dense_params, lambda params: torch.optim.Adagrad(params, lr=0.1))
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense_opt])

    pipeline = TrainPipelineSparseDist(dmp, optimizer, device)
    losses = []
    for epoch in range(epochs):
        it = iter([make_batch(epoch * steps + s, rank) for s in range(steps)])
        while True:
            try:
                loss, _ = pipeline.progress(it)
            except StopIteration:
                break
            losses.append(float(loss))

    dmp.eval()
    evaluator = EvalPipelineSparseDist(dmp, optimizer, device)
    eval_losses = []
    it = iter([make_batch(100 + s, rank) for s in range(steps)])
    while True:
        try:
            loss, _ = evaluator.progress(it)
        except StopIteration:
            break
        eval_losses.append(float(loss))
    names = sorted(dense_params)
    small = [t for k, t in dmp.state_dict().items() if k.endswith("t_small.weight")][0]
    return losses, eval_losses, names, dense_init, small.detach().clone()
