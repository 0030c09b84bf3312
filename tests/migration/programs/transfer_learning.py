# ruff: noqa
# TorchRec's examples/transfer_learning/train_from_pretrained_embedding.py, shrunk to CPU/gloo (a 64 x 8 table,
# the sharding type a parameter (TorchRec's CPU sharder offers no row_wise), the process group already up, no elastic launcher, torch >= 2.0's storage class names). Appended: a forward pass of the loaded table, returned.
# Kept with ``torchrec`` imports: tests/migration/test_torchrec_programs.py runs it after s/torchrec/lightning_shardrec/.

import copyreg
import io
import pickle
from typing import cast, List, Optional

import torch
import torch.distributed as dist
import torchrec
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torch.multiprocessing.reductions import (
    reduce_storage,
    reduce_typed_storage,
    reduce_typed_storage_child,
)
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ModuleSharder, ShardingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection


gloo_pg: Optional[dist.ProcessGroup] = None


def share_tensor_via_shm(tensor: Optional[torch.Tensor], src_rank: int = 0) -> torch.Tensor:
    if not dist.is_initialized():
        raise RuntimeError("Global process group is not initialized")

    global gloo_pg
    if gloo_pg is None:
        if dist.get_backend() == "gloo":
            gloo_pg = dist.group.WORLD
        else:
            gloo_pg = dist.new_group(backend="gloo")

    torch.multiprocessing.set_sharing_strategy("file_system")

    if dist.get_rank() == src_rank:
        assert tensor is not None, f"src_rank ({src_rank}) must provide a tensor"

        buf = io.BytesIO()
        shm_pickler = pickle.Pickler(buf)
        shm_pickler.dispatch_table = copyreg.dispatch_table.copy()

        for t in torch._storage_classes:
            if t.__name__ == "UntypedStorage":  # torch >= 2.0 spelling (was "_UntypedStorage")
                shm_pickler.dispatch_table[t] = reduce_storage
            else:
                shm_pickler.dispatch_table[t] = reduce_typed_storage_child
        shm_pickler.dispatch_table[torch.storage.TypedStorage] = reduce_typed_storage  # (was _TypedStorage)

        tensor.share_memory_()
        shm_pickler.dump(tensor)

        obj_list = [buf.getvalue()]
        dist.broadcast_object_list(obj_list, src=src_rank, group=gloo_pg)
        dist.barrier(group=gloo_pg)
        return tensor
    else:
        obj_list = [None]
        dist.broadcast_object_list(obj_list, src=src_rank, group=gloo_pg)
        obj = obj_list[0]
        assert obj is not None
        buf = io.BytesIO(obj)
        dist.barrier(group=gloo_pg)
        return pickle.load(buf)


def main(num_embeddings: int = 64, dim: int = 8, sharding_type: str = ShardingType.ROW_WISE.value):
    device = torch.device("cpu")
    pg = dist.group.WORLD
    assert pg is not None
    dist.barrier()

    if dist.get_rank() == 0:
        # Pretend that we are loading the pretrained embedding weight from a parquet file on rank 0.
        emb = torch.rand(num_embeddings, dim, generator=torch.Generator().manual_seed(0))
        emb = share_tensor_via_shm(tensor=emb)
    else:
        emb = share_tensor_via_shm(tensor=None)

    assert emb.is_shared()

    ebc = EmbeddingBagCollection(
        device=torch.device("meta"),
        tables=[
            torchrec.EmbeddingBagConfig(
                name="emb",
                embedding_dim=dim,
                num_embeddings=num_embeddings,
                feature_names=["f"],
                pooling=torchrec.PoolingType.SUM,
            )
        ],
    )

    sharders = cast(
        List[ModuleSharder[nn.Module]],
        [
            EmbeddingBagCollectionSharder(
                fused_params={
                    "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                    "learning_rate": 0.01,
                    "eps": 0.01,
                }
            )
        ],
    )
    plan = EmbeddingShardingPlanner(
        topology=Topology(world_size=dist.get_world_size(), compute_device=device.type),
        constraints={"emb": ParameterConstraints(sharding_types=[sharding_type])},
    ).collective_plan(ebc, sharders, pg)
    print(plan)

    dmp = DistributedModelParallel(module=ebc, device=device, plan=plan, sharders=sharders)
    print("Finished initializing DistributedModelParallel.")

    for rank in range(dist.get_world_size()):
        if dist.get_rank() == rank:
            for _, t in dmp.state_dict().items():
                for shard in t.local_shards():
                    offsets = shard.metadata.shard_offsets
                    lengths = shard.metadata.shard_sizes
                    src = emb[
                        offsets[0] : offsets[0] + lengths[0],
                        offsets[1] : offsets[1] + lengths[1],
                    ]
                    shard.tensor.copy_(src)
            dist.barrier()
        else:
            dist.barrier()

    # appended: the loaded table's pooled rows, and this rank's shards
    kjt = torchrec.KeyedJaggedTensor(
        keys=["f"], values=torch.arange(num_embeddings), lengths=torch.tensor([1] * num_embeddings)
    )
    pooled = dmp(kjt).wait()
    shards = [
        (list(s.metadata.shard_offsets), s.tensor.clone())
        for t in dmp.state_dict().values()
        for s in t.local_shards()
    ]
    return emb.clone(), pooled.values().detach().clone(), shards
