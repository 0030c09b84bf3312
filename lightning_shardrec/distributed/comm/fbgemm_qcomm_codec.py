"""Quantized comms at TorchRec's path (``torchrec.distributed.fbgemm_qcomm_codec``).

``get_qcomm_codecs_registry(QCommsConfig(forward_precision=CommType.FP16, backward_precision=CommType.FP16))``
given to a sharder sets the pooled embeddings' wire precision (``comm_precision``, see
:mod:`~lightning_shardrec.distributed.comm.qcomm`), one per direction: ``forward_precision`` for the
pooled outputs, ``backward_precision`` for their gradients (the intro tutorial's FP16/BF16).
Loss scales and FP8/INT8 are refused by name.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from lightning_shardrec.distributed.comm.qcomm import CommPrecision, WirePrecision, parse_wire
from lightning_shardrec.errors import UnsupportedFeatureError

_SECTION = "see docs/migrating.md, 'Sharders'"


class CommType(enum.Enum):
    """Wire precisions TorchRec names (``FP32``, ``FP16``, ``BF16`` run here)."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8 = "fp8"
    INT8 = "int8"

    def __str__(self) -> str:
        return self.value


@dataclass
class QCommsConfig:
    """TorchRec's fields and defaults; those with no counterpart here must keep their default."""

    forward_precision: CommType = CommType.FP32
    backward_precision: CommType = CommType.FP32
    forward_loss_scale: float | None = None
    backward_loss_scale: float | None = None
    fp8_quantize_dim: int | None = None
    fp8_quantize_dim_bwd: int | None = None
    fp8_bwd_uses_143: bool | None = False
    mx4_quantize_dim: int | None = None
    mx4_quantize_dim_bwd: int | None = None


class QCommsRegistry(dict):  # type: ignore[type-arg]
    """What ``get_qcomm_codecs_registry`` returns: TorchRec's comm-op keys, and the config behind them."""

    def __init__(self, config: QCommsConfig, comm_ops: list[Any]) -> None:
        super().__init__({str(getattr(op, "name", op)): config for op in comm_ops})
        self.config = config

    def precision(self, where: str) -> CommPrecision | WirePrecision:
        """The wire precision of this config (a pair when the directions differ), or raise naming what is not."""
        c = self.config
        extra = {
            k: v
            for k, v in vars(c).items()
            if k not in ("forward_precision", "backward_precision") and v not in (None, False)
        }
        if extra:
            raise UnsupportedFeatureError(f"{where}: QCommsConfig fields {extra} are not supported ({_SECTION})")
        fwd, bwd = CommType(c.forward_precision), CommType(c.backward_precision)
        for t in (fwd, bwd):
            if t.value not in {p.value for p in CommPrecision}:
                raise UnsupportedFeatureError(
                    f"{where}: comm precision {t.name} is not supported; use one of "
                    f"{', '.join(p.name for p in CommPrecision)} ({_SECTION})"
                )
        return parse_wire(WirePrecision(CommPrecision(fwd.value), CommPrecision(bwd.value)))


def get_qcomm_codecs_registry(
    qcomms_config: QCommsConfig, comm_ops: list[Any] | None = None, device: Any = None
) -> QCommsRegistry | None:
    """The registry a sharder takes (``qcomm_codecs_registry=``); None for a None config, as TorchRec."""
    if qcomms_config is None:
        return None
    ops = comm_ops if comm_ops is not None else ["pooled_embeddings_all_to_all", "pooled_embeddings_reduce_scatter"]
    return QCommsRegistry(qcomms_config, list(ops))


__all__ = ["CommType", "QCommsConfig", "QCommsRegistry", "get_qcomm_codecs_registry"]
