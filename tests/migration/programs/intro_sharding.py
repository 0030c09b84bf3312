# ruff: noqa
"""The "Introduction to TorchRec" tutorial's sharding part (pytorch/tutorials,
``intermediate_source/torchrec_intro_tutorial.py``), shrunk to CPU.

Kept as TorchRec's text: the test replaces ``torchrec`` with ``lightning_shardrec`` and nothing else.
Changes from the tutorial, for CPU and a test: "cpu" for "cuda", 16-wide tables, a small KJT, the tables
set to a fixed function (TorchRec's ``sharder.shard`` starts from fresh random rows, this library's from
the module's rows, so only a fixed start compares), the cells in one function returning what they print.
"""
import os, copy
import torch
import torch.distributed as dist
import torchrec
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

def main():
    if not dist.is_initialized():
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="localhost", MASTER_PORT="29531")
        dist.init_process_group(backend="gloo")
    ebc = torchrec.EmbeddingBagCollection(device="cpu", tables=[
        torchrec.EmbeddingBagConfig(name="product_table", embedding_dim=16, num_embeddings=4096, feature_names=["product"], pooling=torchrec.PoolingType.SUM),
        torchrec.EmbeddingBagConfig(name="user_table", embedding_dim=16, num_embeddings=4096, feature_names=["user"], pooling=torchrec.PoolingType.SUM)])
    with torch.no_grad():  # fixed tables, so the numbers compare with TorchRec's
        for i, p in enumerate(ebc.parameters()):
            p.copy_(torch.sin(torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) * (i + 1.0)) * 0.1)
    kjt = KeyedJaggedTensor(keys=["product", "user"], values=torch.tensor([1, 2, 1, 5]), lengths=torch.tensor([3, 0, 1, 0]))
    eager = ebc(kjt).to_dict()
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.types import ShardingEnv
    sharder = EmbeddingBagCollectionSharder()
    pg = dist.GroupMember.WORLD
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"))
    plan = planner.collective_plan(ebc, [sharder], pg)
    print(f"Sharding Plan generated: {plan}")
    env = ShardingEnv.from_process_group(pg)
    sharded_ebc = sharder.shard(ebc, plan.plan[""], env, torch.device("cpu"))
    print(f"Sharded EBC Module: {sharded_ebc}")
    from typing import List
    from torchrec.distributed.types import LazyAwaitable
    class ExampleAwaitable(LazyAwaitable[torch.Tensor]):
        def __init__(self, size: List[int]) -> None:
            super().__init__()
            self._size = size
        def _wait_impl(self) -> torch.Tensor:
            return torch.ones(self._size)
    awaitable = ExampleAwaitable([3, 2])
    print(awaitable.wait())
    output = sharded_ebc(kjt)
    kt = output.wait()
    print(type(kt), kt.keys(), kt.values().shape)
    for key, embedding in kt.to_dict().items():
        print(key, embedding.shape)
    sharded_ebc._input_dists
    sharded_ebc._output_dists
    sharded_ebc._lookups
    model = torchrec.distributed.DistributedModelParallel(ebc, device=torch.device("cpu"))
    out = model(kjt)
    out.wait()
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    fused_params = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.02, "eps": 0.002}
    sharder_with_fused_params = EmbeddingBagCollectionSharder(fused_params=fused_params)
    sharded_ebc_fused_params = sharder_with_fused_params.shard(ebc, plan.plan[""], env, torch.device("cpu"))
    print(f"Original Sharded EBC fused optimizer: {sharded_ebc.fused_optimizer}")
    print(f"Sharded EBC with fused parameters fused optimizer: {sharded_ebc_fused_params.fused_optimizer}")
    print(f"Type of optimizer: {type(sharded_ebc_fused_params.fused_optimizer)}")
    from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
    ebc_apply_opt = copy.deepcopy(ebc)
    for name, param in ebc_apply_opt.named_parameters():
        apply_optimizer_in_backward(torch.optim.SGD, [param], {"lr": 0.5})
    sharded_ebc_apply_opt = sharder.shard(ebc_apply_opt, plan.plan[""], env, torch.device("cpu"))
    print(sharded_ebc_apply_opt.fused_optimizer)
    print(dict(in_backward_optimizer_filter(sharded_ebc_fused_params.named_parameters())).keys())
    losses = []
    for _ in range(2):
        ebc_output = sharded_ebc_fused_params(kjt).wait().values()
        loss = torch.sum(torch.ones_like(ebc_output) - ebc_output)
        losses.append(float(loss))
        loss.backward()
    print("losses", losses)
    fused = sharded_ebc_fused_params.fused_optimizer.param_groups[0]
    sgd = sharded_ebc_apply_opt.fused_optimizer.param_groups[0]
    return {"losses": losses, "eager": eager, "sharded": kt.to_dict(), "keys": kt.keys(),
            "fused": (fused["lr"], fused["eps"]), "sgd_lr": sgd["lr"], "awaited": awaitable.wait()}

