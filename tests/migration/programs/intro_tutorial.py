# ruff: noqa
"""TorchRec's introduction tutorial (``Torchrec_Introduction.ipynb``), shrunk to CPU.

Kept as TorchRec's text: the test replaces ``torchrec`` with ``lightning_shardrec`` and nothing
else. Changes from the notebook, for CPU and a test: "gloo" and ``cpu`` in place of "nccl" and
``cuda``, no ``.cuda()``, the process group left as the test runner made it, and the cells in
one function that returns what the notebook prints.
"""

import os

import torch
import torch.distributed as dist
import torchrec


def main():
    if not dist.is_initialized():
        os.environ["RANK"] = "0"
        os.environ["WORLD_SIZE"] = "1"
        os.environ["MASTER_ADDR"] = "localhost"
        os.environ["MASTER_PORT"] = "29500"
        dist.init_process_group(backend="gloo")

    ebc = torchrec.EmbeddingBagCollection(
        device="meta",
        tables=[
            torchrec.EmbeddingBagConfig(
                name="product_table",
                embedding_dim=64,
                num_embeddings=4096,
                feature_names=["product"],
                pooling=torchrec.PoolingType.SUM,
            ),
            torchrec.EmbeddingBagConfig(
                name="user_table",
                embedding_dim=64,
                num_embeddings=4096,
                feature_names=["user"],
                pooling=torchrec.PoolingType.SUM,
            ),
        ],
    )

    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    apply_optimizer_in_backward(
        optimizer_class=torch.optim.SGD,
        params=ebc.parameters(),
        optimizer_kwargs={"lr": 0.02},
    )

    model = torchrec.distributed.DistributedModelParallel(ebc, device=torch.device("cpu"))
    printed = [str(model), str(model.plan)]

    from torchrec.distributed.fbgemm_qcomm_codec import get_qcomm_codecs_registry, QCommsConfig, CommType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    sharder = EmbeddingBagCollectionSharder(
        qcomm_codecs_registry=get_qcomm_codecs_registry(
            qcomms_config=QCommsConfig(
                forward_precision=CommType.FP16,
                backward_precision=CommType.BF16,
            )
        )
    )
    model = torchrec.distributed.DistributedModelParallel(ebc, sharders=[sharder], device=torch.device("cpu"))

    product_eb = torch.nn.EmbeddingBag(4096, 64)
    product_eb(input=torch.tensor([101, 202, 303]), offsets=torch.tensor([0, 2, 2]))

    mb = torchrec.KeyedJaggedTensor(
        keys=["product", "user"],
        values=torch.tensor([101, 202, 303, 404, 505, 606]),
        lengths=torch.tensor([2, 0, 1, 1, 1, 1], dtype=torch.int64),
    )
    printed.append(str(mb.to(torch.device("cpu"))))

    pooled_embeddings = model(mb).to_dict()
    printed.append(f"product embeddings {pooled_embeddings['product']}")
    printed.append(f"user embeddings {pooled_embeddings['user']}")
    return model, mb, pooled_embeddings, printed
