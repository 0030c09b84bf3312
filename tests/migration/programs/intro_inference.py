# ruff: noqa
"""The "Introduction to TorchRec" tutorial's inference part (pytorch/tutorials,
``intermediate_source/torchrec_intro_tutorial.py``: Inference, Quantization, Shard), shrunk to CPU.

Kept as TorchRec's text: the test replaces ``torchrec`` with ``lightning_shardrec`` and nothing else.
Changes from the tutorial, for CPU and a test: 16-wide tables set to a fixed function, a small KJT, the
cells in one function returning what they print, and one more cell doing the same with TorchRec's
``quant_prep_enable_register_tbes`` + ``trec_infer.modules.quantize_embeddings``. Its "Compilation"
cells (``torchrec.fx.Tracer``, ``torch.jit.script``) are not included.
"""
import torch
import torchrec
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def main():
    ebc = torchrec.EmbeddingBagCollection(device="cpu", tables=[
        torchrec.EmbeddingBagConfig(name="product_table", embedding_dim=16, num_embeddings=4096, feature_names=["product"], pooling=torchrec.PoolingType.SUM),
        torchrec.EmbeddingBagConfig(name="user_table", embedding_dim=16, num_embeddings=4096, feature_names=["user"], pooling=torchrec.PoolingType.SUM)])
    with torch.no_grad():  # fixed tables, so the numbers compare with TorchRec's
        for i, p in enumerate(ebc.parameters()):
            p.copy_(torch.sin(torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) * (i + 1.0)) * 0.1)
    kjt = KeyedJaggedTensor(keys=["product", "user"], values=torch.tensor([1, 2, 1, 5, 4095]), lengths=torch.tensor([3, 0, 1, 1]))

    class InferenceModule(torch.nn.Module):
        def __init__(self, ebc: torchrec.EmbeddingBagCollection):
            super().__init__()
            self.ebc_ = ebc

        def forward(self, kjt: KeyedJaggedTensor):
            return self.ebc_(kjt)

    module = InferenceModule(ebc)
    for name, param in module.named_parameters():
        print(name, param.shape, param.dtype)

    from torch import quantization as quant
    from torchrec.modules.embedding_configs import QuantConfig
    from torchrec.quant.embedding_modules import (
        EmbeddingBagCollection as QuantEmbeddingBagCollection,
    )

    quant_dtype = torch.int8
    qconfig = QuantConfig(
        activation=quant.PlaceholderObserver.with_args(dtype=torch.float),
        weight=quant.PlaceholderObserver.with_args(dtype=quant_dtype),
    )
    qconfig_spec = {torchrec.EmbeddingBagCollection: qconfig}
    mapping = {torchrec.EmbeddingBagCollection: QuantEmbeddingBagCollection}
    module = InferenceModule(ebc)
    qebc = quant.quantize_dynamic(module, qconfig_spec=qconfig_spec, mapping=mapping, inplace=False)
    print(f"Quantized EBC: {qebc}")
    kjt = kjt.to("cpu")
    quantized = qebc(kjt)
    buffers = {}
    for name, buffer in qebc.named_buffers():
        print(name, buffer.shape, buffer.dtype)
        buffers[name] = (tuple(buffer.shape), str(buffer.dtype))

    from torchrec import distributed as trec_dist
    from torchrec.distributed.shard import _shard_modules

    sharded_qebc = _shard_modules(module=qebc, device=torch.device("cpu"), env=trec_dist.ShardingEnv.from_local(1, 0))
    print(f"Sharded Quantized EBC: {sharded_qebc}")
    served = sharded_qebc(kjt)

    # the same with TorchRec's one-call helper and the tutorial's register_tbes preparation
    import copy
    import torchrec.inference as trec_infer
    from torchrec.quant.embedding_modules import quant_prep_enable_register_tbes

    helper = copy.deepcopy(InferenceModule(ebc))
    quant_prep_enable_register_tbes(helper, [torchrec.EmbeddingBagCollection])
    helper = trec_infer.modules.quantize_embeddings(helper, dtype=torch.qint8, inplace=True)
    float_out = ebc(kjt).to_dict()
    return {
        "float": {k: v.detach() for k, v in float_out.items()},
        "quantized": quantized.to_dict(),
        "served": served.to_dict(),
        "helper": helper(kjt).to_dict(),
        "buffers": buffers,
        "params_left": [n for n, _ in qebc.named_parameters()],
    }
