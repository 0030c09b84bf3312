"""Portable kernel: plain PyTorch ops, for CPU and CUDA (without fbgemm); tested on CPU only (never on MPS).

Tables of one dim share one flat ``[sum(rows), D]`` buffer, so a lookup over all
of them is one ``embedding_bag`` (pooled) or ``index_select`` (sequence) call.
Backward turns the output gradient into per-id gradients, sums them per unique
row and hands those rows to the optimizer rule: no dense weight gradient exists.

On CPU (fp32 rows, the package's compiled loops present: :mod:`.native`) a pooled lookup
is one pass writing ``[B, F*D]`` directly, each id checked against its own table, and
backward groups the ids by row once, sums each row's gradients from the ``[B, F*D]``
gradient in place, and applies the rule to the touched rows in place.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_shardrec._compat.torch import assert_async
from lightning_shardrec.configs import FusedOptimConfig
from lightning_shardrec.kernels import native, row_updates
from lightning_shardrec.kernels.base import BatchedEmbeddingKernel, KernelBackend, TableSpec
from lightning_shardrec.sparse import KeyedJaggedTensor, ops


class _DimGroup:
    """Tables of one embedding dim: their flat buffer name, row offsets and features."""

    def __init__(self, dim: int, tables: list[int], specs: list[TableSpec]) -> None:
        self.dim = dim
        self.tables = tables
        self.row_offset: dict[int, int] = {}
        rows = 0
        for t in tables:
            self.row_offset[t] = rows
            rows += specs[t].num_embeddings
        self.rows = rows
        self.buffer = f"weight_d{dim}"


class _FusedLookup(torch.autograd.Function):
    """Lookup whose backward updates rows in place (inputs: placeholder, then data).

    ``feats`` set: the compiled loops' pooled lookup of those features (raw ids; output ``[B, F*D]``);
    None: tensor ops on ids already offset into the flat buffer (output ``[F*B, D]`` or ``[N, D]``)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        placeholder: Tensor,
        kernel: TorchBatchedEmbedding,
        group: _DimGroup,
        ids: Tensor,
        offsets: Tensor | None,
        psw: Tensor | None,
        feats: list[int] | None = None,
    ) -> Tensor:
        weight = kernel.get_buffer(group.buffer)
        ctx.kernel, ctx.group, ctx.native = kernel, group, feats is not None
        if feats is not None and offsets is not None:
            out, flat = kernel.native_forward(group, feats, ids, offsets, psw, rows_out=placeholder.requires_grad)
            ctx.save_for_backward(flat, offsets, psw)
            return out
        ctx.save_for_backward(ids, offsets, psw)
        if offsets is None:
            return weight.index_select(0, ids)
        return F.embedding_bag(ids, weight, offsets, mode="sum", per_sample_weights=psw, include_last_offset=True)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, ...]:  # type: ignore[override]
        ids, offsets, psw = ctx.saved_tensors
        if ctx.native:  # grad [B, F*D]: bag f * B + b reads grad[b, f*D:(f+1)*D]
            ctx.kernel.apply_bag_update(ctx.group, ids, grad, offsets, psw)
            return (None,) * 7
        # pooled: each id reads its bag's gradient row; sequence: its own
        bag = None if offsets is None else ops.segment_ids(offsets[1:] - offsets[:-1], total=ids.numel())
        ctx.kernel.apply_update(ctx.group, ids, grad, bag, psw)
        return (None,) * 7


class TorchBatchedEmbedding(BatchedEmbeddingKernel):
    """Batched lookup + fused row-sparse optimizer in pure PyTorch."""

    backend = KernelBackend.TORCH

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
        by_dim: dict[int, list[int]] = {}
        for i, t in enumerate(tables):
            by_dim.setdefault(t.embedding_dim, []).append(i)
        self._groups = [_DimGroup(d, ts, self.tables) for d, ts in by_dim.items()]
        self._group_of = {t: g for g in self._groups for t in g.tables}
        self._state_names: list[str] = []
        for g in self._groups:
            self.register_buffer(g.buffer, torch.empty(g.rows, g.dim, device=device))
            for name, tensor in row_updates.init_state(self.optimizer, g.rows, g.dim, device).items():
                self.register_buffer(f"{name}_d{g.dim}", tensor)
                if name not in self._state_names:
                    self._state_names.append(name)
            self.register_buffer(f"step_d{g.dim}", torch.zeros((), dtype=torch.float32, device=device))
        # Per feature: its group and the row offset of its table inside that group.
        self._feature_group = [self._group_of[t] for t in self.feature_table]
        self._feature_row_offset = [self._group_of[t].row_offset[t] for t in self.feature_table]
        self._single = len(self._groups) == 1
        self._offset_cache: dict[tuple[tuple[int, ...], torch.device], Tensor] = {}  # [2, F]: offsets, rows

    # --- state views ----------------------------------------------------------------
    def _state(self, g: _DimGroup) -> dict[str, Tensor]:
        state = {n: self.get_buffer(f"{n}_d{g.dim}") for n in self._state_names}
        if self.optimizer in row_updates.USES_STEP:
            state["step"] = self.get_buffer(f"step_d{g.dim}")
        return state

    def split_weights(self) -> list[Tensor]:
        out = []
        for i, spec in enumerate(self.tables):
            g = self._group_of[i]
            out.append(self.get_buffer(g.buffer).narrow(0, g.row_offset[i], spec.num_embeddings))
        return out

    def split_states(self) -> list[dict[str, Tensor]]:
        out = []
        for i, spec in enumerate(self.tables):
            g = self._group_of[i]
            state = self._state(g)
            out.append(
                {
                    n: (t if t.dim() == 0 else t.narrow(0, g.row_offset[i], spec.num_embeddings))
                    for n, t in state.items()
                }
            )
        return out

    # --- update ---------------------------------------------------------------------
    @torch.no_grad()
    def apply_update(
        self, g: _DimGroup, ids: Tensor, grad: Tensor, source: Tensor | None = None, weights: Tensor | None = None
    ) -> None:
        """Apply the rule to the rows of ``ids``; id ``i``'s gradient is ``grad[source[i]] * weights[i]``."""
        self._apply_summed(g, *row_updates.accumulate_rows(ids, grad, source, weights, num_rows=g.rows))

    @torch.no_grad()
    def apply_bag_update(
        self, g: _DimGroup, flat: Tensor, grad: Tensor, offsets: Tensor, weights: Tensor | None
    ) -> None:
        """The compiled loops' backward: ``flat`` rows of the ids of bags ``offsets`` (key-major), their bag
        gradients in ``grad [B, F*D]`` (bag ``f * B + b`` reads ``grad[b, f*D:(f+1)*D]``), ``weights`` per id."""
        loops = native.row_loops()
        assert loops is not None  # the forward ran them
        if grad.dtype != torch.float32 or grad.stride(-1) != 1:
            grad = grad.float().contiguous()
        groups = native.group_rows(loops, flat, g.rows, offsets, grad.shape[0], grad.stride(0), g.dim)
        weight, state = self.get_buffer(g.buffer), self._state(g)
        if (
            self.row_sink is None
            and self.grad_clip_value is None
            and row_updates.native_rule(self.optimizer, weight, state)
        ):
            if "step" in state:
                state["step"].add_(1)
            native.update_rows(loops, self.optimizer.value, weight, groups, grad, weights, state, self.hparams)
            return
        self._apply_summed(g, groups.rows, native.sum_rows(loops, groups, grad, weights, g.dim))

    def _apply_summed(self, g: _DimGroup, rows: Tensor, row_grad: Tensor) -> None:
        if self.row_sink is not None:  # deferred to the optimizer step (optim.DeferredTableUpdates)
            self.row_sink.keep(self, g, rows, row_grad)
            return
        if self.grad_clip_value is not None:  # a dense table gradient is these per-row sums: clamp them
            row_grad.clamp_(-self.grad_clip_value, self.grad_clip_value)
        self.apply_rows(g, rows, row_grad)

    @torch.no_grad()
    def apply_rows(self, g: _DimGroup, rows: Tensor, row_grad: Tensor) -> None:
        """One step of the rule on unique ``rows [U]`` of group ``g`` with their summed gradient ``row_grad [U, D]``."""
        state = self._state(g)
        if "step" in state:
            state["step"].add_(1)
        row_updates.apply_rule(self.optimizer, self.get_buffer(g.buffer), rows, row_grad, state, self.hparams)

    # --- lookup ---------------------------------------------------------------------
    def _lookup(self, g: _DimGroup, kjt: KeyedJaggedTensor, feats: list[int]) -> Tensor:
        """Features ``feats`` (all of group ``g``'s dim) looked up: pooled ``[B, F*D]``, sequence ``[N, D]``."""
        placeholder = torch.empty(0, device=kjt.values().device, requires_grad=torch.is_grad_enabled())
        psw = kjt.weights_or_none()
        if self._native_takes(g, kjt, psw):
            ids, offsets = kjt.values().long().contiguous(), kjt.offsets().long().contiguous()
            psw = None if psw is None else psw.contiguous()
            return _FusedLookup.apply(placeholder, self, g, ids, offsets, psw, feats)  # type: ignore[no-any-return]
        ids = kjt.values().long()
        if kjt.stride() and ids.numel():  # each feature's ids, [F] counts from its first and last bag's offsets
            per_key = kjt.offsets()[:: kjt.stride()].diff().long()
            offsets_t, rows_t = self._feature_tensors(feats, ids.device)
            self._check_rows(ids, rows_t.repeat_interleave(per_key, output_size=ids.numel()), feats)
            if any(self._feature_row_offset[f] for f in feats):
                ids = ids + offsets_t.repeat_interleave(per_key, output_size=ids.numel())
        bags = kjt.offsets().long() if self.pooled else None
        out = _FusedLookup.apply(placeholder, self, g, ids, bags, psw)
        return self._finish(out, kjt, len(feats))

    def _native_takes(self, g: _DimGroup, kjt: KeyedJaggedTensor, psw: Tensor | None) -> bool:
        """The compiled loops run this pooled lookup: fp32 rows on CPU, at most ``native.MAX_DIM`` wide."""
        if not self.pooled or kjt.values().device.type != "cpu" or not kjt.stride():
            return False
        weight = self.get_buffer(g.buffer)
        return (
            weight.dtype == torch.float32
            and (psw is None or psw.dtype == torch.float32)
            and native.takes(weight)
            and native.row_loops() is not None
        )

    def native_forward(
        self, g: _DimGroup, feats: list[int], ids: Tensor, offsets: Tensor, psw: Tensor | None, *, rows_out: bool
    ) -> tuple[Tensor, Tensor]:
        """The compiled pooled lookup of ``feats``: ``[B, F*D]``, and (``rows_out``) each id's row in the flat
        buffer, for backward (else an empty tensor)."""
        loops = native.row_loops()
        assert loops is not None  # _native_takes
        base, rows = self._feature_tensors(feats, ids.device)
        batch, weight = (offsets.numel() - 1) // len(feats), self.get_buffer(g.buffer)
        out = torch.empty(batch, len(feats) * g.dim, dtype=weight.dtype)
        flat = torch.empty_like(ids) if rows_out else ids.new_empty(0)
        bad = loops.bag_forward(
            len(feats), batch, native.ptr(offsets), ids.numel(), native.ptr(ids), native.ptr(base), native.ptr(rows),
            native.ptr(weight), weight.stride(0), g.dim, native.ptr(psw), native.ptr(out), out.stride(0),
            native.ptr(flat) if rows_out else None,
        )  # fmt: skip
        if bad == native.BAD_BAG_OFFSETS:
            raise ValueError(
                f"kernel='torch': the offsets of {len(feats)} features x {batch} bags must rise from 0 to at most "
                f"the {ids.numel()} ids, got {native.offsets_text(offsets)}"
            )
        if bad >= 0:
            raise RuntimeError(self._range_message(feats))
        return out, flat

    def _feature_tensors(self, feats: list[int], device: torch.device) -> tuple[Tensor, Tensor]:
        """Per feature of ``feats``: its table's first row in the flat buffer, and its table's rows."""
        key = (tuple(feats), device)
        if key not in self._offset_cache:  # built once per feature set, not per batch
            offsets = [self._feature_row_offset[f] for f in feats]
            rows = [self.tables[self.feature_table[f]].num_embeddings for f in feats]
            self._offset_cache[key] = torch.tensor([offsets, rows], device=device)
        both = self._offset_cache[key]
        return both[0], both[1]

    def _check_rows(self, ids: Tensor, rows: Tensor, feats: list[int]) -> None:
        """Every id inside its own table (else it would read another table's row in the flat buffer):
        on the device, no host sync (a device-side assert on CUDA; raises at once on CPU). The
        collections name the bad id before this (``validate_ids``); this holds without it too."""
        assert_async(((ids >= 0) & (ids < rows)).all(), self._range_message(feats))

    def _range_message(self, feats: list[int]) -> str:
        tables = sorted({self.feature_table[f] for f in feats})
        ranges = ", ".join(f"'{self.tables[t].name}' [0, {self.tables[t].num_embeddings})" for t in tables)
        return (
            f"kernel='torch': an id is outside its table's rows (tables {ranges}); "
            "pass validate_ids=True to the collection to have the id, feature and table named"
        )

    def forward(self, kjt: KeyedJaggedTensor) -> Tensor:
        if self._single:
            return self._lookup(self._groups[0], kjt, list(range(len(self.feature_table))))
        # Several dims: look each group's features up separately, then restore feature order.
        pieces: dict[int, Tensor] = {}
        for g in self._groups:
            feats = [f for f, fg in enumerate(self._feature_group) if fg is g]
            if not feats:
                continue
            sub = kjt.permute(feats)
            out = self._lookup(g, sub, feats)
            if self.pooled:
                pieces.update(zip(feats, out.split(g.dim, dim=1), strict=True))
            else:
                pieces.update(zip(feats, out.split(sub.length_per_key()), strict=True))
        order = [pieces[f] for f in range(len(self.feature_table))]
        return torch.cat(order, dim=1 if self.pooled else 0)

    def _finish(self, out: Tensor, kjt: KeyedJaggedTensor, num_features: int) -> Tensor:
        """Pooled ``[F*B, D]`` (key-major bags) -> ``[B, F*D]``; sequence output unchanged."""
        if not self.pooled:
            return out
        b, d = kjt.stride(), out.shape[1]
        return out.view(num_features, b, d).transpose(0, 1).reshape(b, num_features * d)
