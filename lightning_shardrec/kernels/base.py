"""The kernel interface: many tables looked up (and trained) in one batched call.

A kernel owns the rows of a group of tables (or table shards) and their fused
optimizer state. Its input is a KJT whose keys are the kernel's features in
order (feature ``f`` reads table ``feature_table[f]``); its output is

* pooled:   ``[B, sum(dim of each feature)]`` of SUM-pooled rows (callers divide
  for MEAN, which keeps one kernel for mixed poolings and sidesteps fbgemm's CPU
  mean-with-weights backward, which omits the 1/L);
* sequence: ``[N, D]``, one row per id (all tables of one dim).

Backward never returns a weight gradient: it applies the optimizer to the touched
rows in place. The hyper-parameters live in ``hparams``, a dict the
``FusedOptimizer`` replaces with its param group so schedulers reach the kernel.
While ``deferred`` is set (a :class:`~lightning_shardrec.optim.ScaledTableUpdates`, under
a loss scaler), a lookup with grad enabled keeps its gradient for later instead; while
``row_sink`` is set (a :class:`~lightning_shardrec.optim.DeferredTableUpdates`: accumulation,
norm clipping), the torch kernel's backward hands its summed row gradients to it instead;
while ``lookups`` is set (a :class:`~lightning_shardrec.optim.RepeatedLookups`), each lookup
with grad enabled is counted, so a second one in the same step can be summed with the first.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_shardrec.configs import FusedOptimConfig
from lightning_shardrec.sparse import KeyedJaggedTensor


class KernelBackend(str, enum.Enum):
    """Which implementation runs the lookup: fbgemm TBE or portable torch."""

    AUTO = "auto"
    FBGEMM = "fbgemm"
    TORCH = "torch"


@dataclass(frozen=True, kw_only=True)
class TableSpec:
    """One table (or shard of one) inside a kernel: ``[num_embeddings, embedding_dim]``."""

    name: str
    num_embeddings: int
    embedding_dim: int


def hparams_from(config: FusedOptimConfig) -> dict[str, Any]:
    return {
        "lr": config.lr,
        "eps": config.eps,
        "beta1": config.beta1,
        "beta2": config.beta2,
        "weight_decay": config.weight_decay,
    }


class BatchedEmbeddingKernel(nn.Module, abc.ABC):
    """Base of both backends: tables, feature->table map, optimizer and hyper-parameters."""

    backend: KernelBackend
    #: set by ``ScaledTableUpdates``: lookups with grad enabled go through its ``lookup``
    deferred: Any = None
    #: set by ``DeferredTableUpdates`` (torch kernel): backward hands each group's summed row
    #: gradients to its ``keep`` instead of applying the rule
    row_sink: Any = None
    #: set by ``RepeatedLookups``: counts this kernel's lookups with grad enabled, per training step
    lookups: Any = None

    def __init__(
        self,
        tables: list[TableSpec],
        feature_table: list[int],
        optim: FusedOptimConfig,
        *,
        pooled: bool,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        if not tables:
            raise ValueError("a kernel needs at least one table")
        bad = [t for t in feature_table if not 0 <= t < len(tables)]
        if bad:
            raise ValueError(f"feature_table refers to tables {bad}; there are {len(tables)}")
        if not pooled and len({t.embedding_dim for t in tables}) > 1:
            dims = {t.name: t.embedding_dim for t in tables}
            raise ValueError(f"a sequence kernel needs one embedding_dim for all tables, got {dims}")
        self.tables = list(tables)
        self.feature_table = list(feature_table)
        self.optimizer = optim.optimizer
        self.pooled = pooled
        self.hparams: dict[str, Any] = hparams_from(optim)
        self.feature_dims = [tables[t].embedding_dim for t in feature_table]
        self._device = torch.device(device)
        #: clamp each touched row's summed gradient to ``[-v, v]`` before the rule (what
        #: ``clip_grad_value_`` does to a table's dense gradient); None: no clipping
        self.grad_clip_value: float | None = None

    # --- to implement ---------------------------------------------------------------
    @abc.abstractmethod
    def forward(self, kjt: KeyedJaggedTensor) -> Tensor:
        """Pooled ``[batch, sum of feature dims]`` (sequence kernels: ``[values, dim]``) of ``kjt``."""

    @abc.abstractmethod
    def split_weights(self) -> list[Tensor]:
        """One ``[rows, dim]`` view per table, writable in place."""

    @abc.abstractmethod
    def split_states(self) -> list[dict[str, Tensor]]:
        """Per table, its optimizer state tensors (views, writable in place)."""

    # --- shared ---------------------------------------------------------------------
    def __call__(self, kjt: KeyedJaggedTensor) -> Tensor:
        if self.lookups is not None and torch.is_grad_enabled():
            self.lookups.seen(self)
        if self.deferred is not None and torch.is_grad_enabled():
            return self.deferred.lookup(self, kjt)  # type: ignore[no-any-return]
        return super().__call__(kjt)  # type: ignore[no-any-return]

    def load_weights(self, weights: list[Tensor]) -> None:
        """Copy full table (or shard) weights in, bit for bit."""
        for spec, dst, src in zip(self.tables, self.split_weights(), weights, strict=True):
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(
                    f"table '{spec.name}': weight of shape {tuple(src.shape)} does not fit {tuple(dst.shape)}"
                )
            with torch.no_grad():
                dst.copy_(src)

    def reset_rows(self, table: int, rows: Tensor, values: Tensor) -> None:
        """Write ``values [U, dim]`` into rows ``rows [U]`` (unique) of kernel table ``table`` and
        reset those rows' optimizer state to its initial value (zero for every rule here: Adagrad
        sums, row-wise sums, Adam moments); shared scalars (Adam's ``step``) are kept.

        A dynamic table's newly assigned slots start this way (see ``docs/dynamic-tables.md``).
        """
        if rows.numel() == 0:
            return
        weight = self.split_weights()[table]
        with torch.no_grad():
            weight.index_copy_(0, rows.to(weight.device, torch.long), values.to(weight.device, weight.dtype))
        self.reset_state_rows([(table, rows)])

    def reset_state_rows(self, resets: Sequence[tuple[int, Tensor]]) -> None:
        """Reset the optimizer state of rows ``rows [U]`` of kernel table ``table``, for each ``(table, rows)``,
        to its initial value (zero for every rule here); shared scalars (Adam's ``step``) are kept."""
        resets = [r for r in resets if r[1].numel()]
        if not resets:
            return
        states = self.split_states()
        with torch.no_grad():
            for table, rows in resets:
                for state in states[table].values():
                    if state.dim() > 0:
                        state.index_fill_(0, rows.to(state.device, torch.long), 0)

    def extra_repr(self) -> str:
        names = ", ".join(f"{t.name}[{t.num_embeddings}x{t.embedding_dim}]" for t in self.tables)
        kind = "pooled" if self.pooled else "sequence"
        return f"backend={self.backend.value}, {kind}, optimizer={self.optimizer.value}, tables=[{names}]"
