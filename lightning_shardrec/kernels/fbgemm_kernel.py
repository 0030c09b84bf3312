"""fbgemm kernel: all tables of a group in one ``SplitTableBatchedEmbeddingBagsCodegen``.

The TBE runs lookup, backward and the optimizer in one fused call. It always
pools with SUM (MEAN is applied by the caller; see ``kernels.base``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_shardrec._fbgemm import fbgemm_tbe
from lightning_shardrec.configs import EmbOptimType, FusedOptimConfig
from lightning_shardrec.kernels.base import BatchedEmbeddingKernel, KernelBackend, TableSpec
from lightning_shardrec.sparse import KeyedJaggedTensor

# fbgemm's name for each optimizer, and the state names it keeps (in its order).
_FBGEMM_OPTIM = {
    EmbOptimType.SGD: ("exact_sgd", []),
    EmbOptimType.ADAGRAD: ("exact_adagrad", ["sum"]),
    EmbOptimType.ROWWISE_ADAGRAD: ("exact_row_wise_adagrad", ["sum"]),
    EmbOptimType.ADAM: ("adam", ["exp_avg", "exp_avg_sq"]),
    EmbOptimType.ADAMW: ("adam", ["exp_avg", "exp_avg_sq"]),
}

# What fbgemm 1.8 trains on each device type (its CPU TBE has only the exact_* rules).
SUPPORTED = {
    "cpu": frozenset({EmbOptimType.SGD, EmbOptimType.ADAGRAD, EmbOptimType.ROWWISE_ADAGRAD}),
    "cuda": frozenset(_FBGEMM_OPTIM),
}


def fbgemm_unsupported_reason(device: torch.device, optim: FusedOptimConfig, dims: list[int]) -> str | None:
    """Why fbgemm cannot run this group here, or None when it can."""
    supported = SUPPORTED.get(device.type)
    if supported is None:
        return f"fbgemm has no kernels for device type '{device.type}'"
    if optim.optimizer not in supported:
        names = ", ".join(sorted(o.value for o in supported))
        return f"fbgemm on {device.type} trains only {names}, not '{optim.optimizer.value}'"
    if device.type == "cpu" and optim.weight_decay:
        return "fbgemm's CPU kernels ignore weight_decay"
    odd = sorted({d for d in dims if d % 4})
    if odd:
        return f"fbgemm needs embedding dims divisible by 4, got {odd}"
    return None


class FbgemmBatchedEmbedding(BatchedEmbeddingKernel):
    """fbgemm TBE: one batched lookup with the optimizer fused into backward."""

    backend = KernelBackend.FBGEMM

    def __init__(
        self,
        tables: list[TableSpec],
        feature_table: list[int],
        optim: FusedOptimConfig,
        *,
        pooled: bool,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(tables, feature_table, optim, pooled=pooled, device=device)
        reason = fbgemm_unsupported_reason(self._device, optim, [t.embedding_dim for t in tables])
        if reason:
            raise ValueError(f"kernel='fbgemm' cannot run tables {[t.name for t in tables]}: {reason}")
        tbe = fbgemm_tbe()
        from fbgemm_gpu.split_embedding_configs import EmbOptimType as FbOptim
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, PoolingMode
        from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode

        on_cpu = self._device.type == "cpu"
        location = tbe.EmbeddingLocation.HOST if on_cpu else tbe.EmbeddingLocation.DEVICE
        compute = tbe.ComputeDevice.CPU if on_cpu else tbe.ComputeDevice.CUDA
        name, self._state_names = _FBGEMM_OPTIM[optim.optimizer]
        wd_mode = WeightDecayMode.NONE
        if optim.weight_decay:
            wd_mode = WeightDecayMode.DECOUPLE if optim.optimizer is EmbOptimType.ADAMW else WeightDecayMode.L2
        self.tbe = tbe.SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(t.num_embeddings, t.embedding_dim, location, compute) for t in tables],
            feature_table_map=self.feature_table,
            optimizer=FbOptim(name),
            learning_rate=optim.lr,
            eps=optim.eps,
            beta1=optim.beta1,
            beta2=optim.beta2,
            weight_decay=optim.weight_decay,
            weight_decay_mode=wd_mode,
            pooling_mode=PoolingMode.SUM if pooled else PoolingMode.NONE,
            bounds_check_mode=BoundsCheckMode.NONE,  # ids are checked by the collections
            device=self._device,
        )
        self._lr = optim.lr

    def split_weights(self) -> list[Tensor]:
        return list(self.tbe.split_embedding_weights())

    def split_states(self) -> list[dict[str, Tensor]]:
        if not self._state_names:
            return [{} for _ in self.tables]
        states = self.tbe.split_optimizer_states()
        out = [dict(zip(self._state_names, s, strict=True)) for s in states]
        if self.optimizer in (EmbOptimType.ADAM, EmbOptimType.ADAMW):
            for s in out:
                s["step"] = self.tbe.iter
        return out

    def forward(self, kjt: KeyedJaggedTensor) -> Tensor:
        lr = self.hparams["lr"]
        if lr != self._lr:  # an LR scheduler moved the FusedOptimizer's param group
            self.tbe.set_learning_rate(lr)
            self._lr = lr
        weights = kjt.weights_or_none()
        return self.tbe(
            kjt.values().long(),
            kjt.offsets().long(),
            per_sample_weights=None if weights is None else weights.float(),
        )
