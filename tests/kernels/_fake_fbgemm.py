"""A stand-in for fbgemm's training TBE with Adam, which fbgemm's CPU build lacks.

``FakeTBE`` keeps fbgemm 1.8's state layout and counter behaviour (what the library
reads and writes): ``iter`` ([1] int64) and its CPU mirror ``iter_cpu``, both advanced on
every forward (evaluation included), the update reading ``iter_cpu``, which is re-read
from ``iter`` only while it is 0; ``split_embedding_weights()`` and
``split_optimizer_states()`` (per table ``[momentum1, momentum2]``). The arithmetic is the
library's own row-sparse Adam, so only the counter plumbing differs from the torch kernel.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_shardrec.configs import EmbOptimType
from lightning_shardrec.kernels import fbgemm_kernel, row_updates


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, placeholder: Tensor, tbe: FakeTBE, ids: Tensor, offsets: Tensor, step: int) -> Tensor:  # type: ignore[override]
        ctx.tbe, ctx.step = tbe, step
        ctx.save_for_backward(ids, offsets)
        return tbe.pool(ids, offsets)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, ...]:  # type: ignore[override]
        ids, offsets = ctx.saved_tensors
        ctx.tbe.update(ids, offsets, grad, ctx.step)
        return (None,) * 5


class FakeTBE(nn.Module):
    def __init__(self, *, embedding_specs: list, feature_table_map: list[int], optimizer: Any, **kw: Any) -> None:
        super().__init__()
        self.rows = [s[0] for s in embedding_specs]
        self.dims = [s[1] for s in embedding_specs]
        self.feature_table_map = feature_table_map
        self.decoupled = str(kw["weight_decay_mode"]).endswith("DECOUPLE")
        self.hp = {
            "lr": kw["learning_rate"],
            "eps": kw["eps"],
            "beta1": kw["beta1"],
            "beta2": kw["beta2"],
            "weight_decay": kw["weight_decay"],
        }
        for t, (r, d) in enumerate(zip(self.rows, self.dims, strict=True)):
            self.register_buffer(f"w{t}", torch.zeros(r, d))
            self.register_buffer(f"m{t}", torch.zeros(r, d))
            self.register_buffer(f"v{t}", torch.zeros(r, d))
        self.register_buffer("iter", torch.zeros(1, dtype=torch.int64))
        self.iter_cpu = torch.zeros(1, dtype=torch.int64)

    def set_learning_rate(self, lr: float) -> None:
        self.hp["lr"] = lr

    def split_embedding_weights(self) -> list[Tensor]:
        return [self.get_buffer(f"w{t}") for t in range(len(self.rows))]

    def split_optimizer_states(self) -> list[list[Tensor]]:
        return [[self.get_buffer(f"m{t}"), self.get_buffer(f"v{t}")] for t in range(len(self.rows))]

    def forward(self, indices: Tensor, offsets: Tensor, per_sample_weights: Tensor | None = None) -> Tensor:
        if int(self.iter_cpu.item()) == 0:  # fbgemm: "sync with loaded state"
            self.iter_cpu.fill_(int(self.iter.item()))
        step = int(self.iter_cpu.add_(1).item())
        self.iter.add_(1)
        placeholder = torch.empty(0, requires_grad=torch.is_grad_enabled())
        return _Lookup.apply(placeholder, self, indices, offsets, step)

    def _bags(self, offsets: Tensor) -> tuple[int, list[Tensor]]:
        f = len(self.feature_table_map)
        b = (offsets.numel() - 1) // f
        return b, [offsets[i * b : (i + 1) * b + 1] for i in range(f)]

    def pool(self, ids: Tensor, offsets: Tensor) -> Tensor:
        b, per_feature = self._bags(offsets)
        outs = []
        for f, offs in enumerate(per_feature):
            t = self.feature_table_map[f]
            local = ids[int(offs[0]) : int(offs[-1])]
            outs.append(
                F.embedding_bag(local, self.get_buffer(f"w{t}"), offs - offs[0], mode="sum", include_last_offset=True)
            )
        return torch.cat(outs, dim=1)

    @torch.no_grad()
    def update(self, ids: Tensor, offsets: Tensor, grad: Tensor, step: int) -> None:
        b, per_feature = self._bags(offsets)
        cols = 0
        grads: dict[int, list[tuple[Tensor, Tensor]]] = {}
        for f, offs in enumerate(per_feature):
            t = self.feature_table_map[f]
            local = ids[int(offs[0]) : int(offs[-1])]
            bag = torch.repeat_interleave(torch.arange(b), (offs[1:] - offs[:-1]).long())
            grads.setdefault(t, []).append((local, grad[:, cols : cols + self.dims[t]].index_select(0, bag)))
            cols += self.dims[t]
        rule = row_updates.RULES[EmbOptimType.ADAMW if self.decoupled else EmbOptimType.ADAM]
        for t, pieces in grads.items():
            rows, row_grad = row_updates.accumulate_rows(
                torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])
            )
            state = {
                "exp_avg": self.get_buffer(f"m{t}"),
                "exp_avg_sq": self.get_buffer(f"v{t}"),
                "step": torch.tensor(float(step)),
            }
            rule(self.get_buffer(f"w{t}"), rows, row_grad, state, self.hp)


@contextmanager
def installed() -> Iterator[None]:
    """While open, ``kernel="fbgemm"`` builds a :class:`FakeTBE` and accepts Adam/AdamW on the CPU
    (process-local; restored on exit, so reused rank processes stay clean)."""
    real = fbgemm_kernel.fbgemm_tbe()
    fake = SimpleNamespace(
        EmbeddingLocation=real.EmbeddingLocation,
        ComputeDevice=real.ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen=FakeTBE,
    )
    saved_tbe, saved_cpu = fbgemm_kernel.fbgemm_tbe, fbgemm_kernel.SUPPORTED["cpu"]
    fbgemm_kernel.fbgemm_tbe = lambda: fake  # type: ignore[assignment]
    fbgemm_kernel.SUPPORTED["cpu"] = frozenset(EmbOptimType)
    try:
        yield
    finally:
        fbgemm_kernel.fbgemm_tbe = saved_tbe  # type: ignore[assignment]
        fbgemm_kernel.SUPPORTED["cpu"] = saved_cpu
