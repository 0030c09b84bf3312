"""fbgemm kernel: all tables of a group in one ``SplitTableBatchedEmbeddingBagsCodegen``.

The TBE runs lookup, backward and the optimizer in one fused call. It always
pools with SUM (MEAN is applied by the caller; see ``kernels.base``).

Adam's step: fbgemm counts it in ``tbe.iter`` (a ``[1]`` int64 on the device) and a CPU
mirror ``tbe.iter_cpu`` that its update reads, and advances both on *every* forward,
evaluation included. This kernel keeps the step itself, as the torch kernel does (a
0-d float32 ``step`` in :meth:`split_states`, on the CPU), advances it only on forwards
that will train (grad enabled and the module in training mode), and writes it into
both fbgemm counters before each such forward, so validation never moves bias
correction and a loaded ``step`` takes effect at once.
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


def fbgemm_weight_decay_reason(device_type: str, optim: FusedOptimConfig) -> str | None:
    """Why fbgemm 1.8 would not apply ``optim.weight_decay`` as :class:`FusedOptimConfig` defines it
    (L2 for sgd/adagrad/rowwise_adagrad/adam, decoupled for adamw), or None when it would.

    Its CPU kernels ignore weight decay; on CUDA the ``exact_*`` rules (sgd, adagrad) ignore it
    and its adam always decays decoupled, whatever the mode. ``kernel="auto"`` routes these
    configs to the torch kernel; ``kernel="fbgemm"`` refuses them.
    """
    if not optim.weight_decay:
        return None
    if device_type == "cpu":
        return f"fbgemm's CPU kernels ignore weight_decay (got {optim.weight_decay})"
    if optim.optimizer in (EmbOptimType.SGD, EmbOptimType.ADAGRAD):
        return f"fbgemm's CUDA {optim.optimizer.value} ignores weight_decay (got {optim.weight_decay})"
    if optim.optimizer is EmbOptimType.ADAM:
        return (
            f"fbgemm's CUDA adam decays decoupled (as adamw), not L2 as adam does (weight_decay={optim.weight_decay})"
        )
    return None


def fbgemm_unsupported_reason(device: torch.device, optim: FusedOptimConfig, dims: list[int]) -> str | None:
    """Why fbgemm cannot run this group here, or None when it can."""
    supported = SUPPORTED.get(device.type)
    if supported is None:
        return f"fbgemm has no kernels for device type '{device.type}'"
    if optim.optimizer not in supported:
        names = ", ".join(sorted(o.value for o in supported))
        return f"fbgemm on {device.type} trains only {names}, not '{optim.optimizer.value}'"
    decay = fbgemm_weight_decay_reason(device.type, optim)
    if decay is not None:
        return decay
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
            # TorchRec's default: on the device, an id outside its table becomes row 0 and is logged, never
            # read or written past the table (the collections name bad ids first unless validate_ids=False)
            bounds_check_mode=BoundsCheckMode.WARNING,
            device=self._device,
        )
        self._lr = optim.lr
        #: Adam/AdamW: the number of training forwards so far (see the module docstring)
        self._step: Tensor | None = None
        if optim.optimizer in (EmbOptimType.ADAM, EmbOptimType.ADAMW):
            self._step = torch.zeros((), dtype=torch.float32)

    def split_weights(self) -> list[Tensor]:
        return list(self.tbe.split_embedding_weights())

    def split_states(self) -> list[dict[str, Tensor]]:
        if not self._state_names:
            return [{} for _ in self.tables]
        states = self.tbe.split_optimizer_states()
        out = [dict(zip(self._state_names, s, strict=True)) for s in states]
        if self._step is not None:  # one 0-d counter shared by the tables, as the torch kernel's
            for s in out:
                s["step"] = self._step
        return out

    def _sync_step(self) -> None:
        """Before a training forward: advance our step and set fbgemm's counters one below it
        (its forward adds 1 to both and its update reads ``iter_cpu``)."""
        assert self._step is not None
        self._step.add_(1)
        before = int(self._step.item()) - 1  # a CPU tensor: no device sync
        self.tbe.iter_cpu.fill_(before)
        self.tbe.iter.fill_(before)

    def forward(self, kjt: KeyedJaggedTensor) -> Tensor:
        lr = self.hparams["lr"]
        if lr != self._lr:  # an LR scheduler moved the FusedOptimizer's param group
            self.tbe.set_learning_rate(lr)
            self._lr = lr
        if self._step is not None and self.training and torch.is_grad_enabled():
            self._sync_step()
        weights = kjt.weights_or_none()
        return self.tbe(
            kjt.values().long(),
            kjt.offsets().long(),
            per_sample_weights=None if weights is None else weights.float(),
        )
