"""Plain ``nn.Embedding`` / ``nn.EmbeddingBag`` modules on row-wise quantized rows.

A model written with torch's own embedding modules (no collection) is quantized module by
module: each becomes a :class:`QuantEmbedding` / :class:`QuantEmbeddingBag` with the same
call and result shape, storing its rows as a quantized table (``weight`` uint8 [rows,
dim*bits/8], ``weight_qscale``/``weight_qbias`` fp16 [rows, 1]; fp16 ``weight`` [rows, dim]).
A lookup gathers the ids' stored rows and dequantizes only those; bags pool them with
``embedding_bag`` (modes sum / mean / max, ``per_sample_weights``, ``padding_idx`` left out
of its bag as torch does). All of it is plain aten, so ``torch.export`` keeps it as it is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_shardrec.configs import EmbeddingBagConfig
from lightning_shardrec.inference.quant_embedding_bag_collection import QuantTable, _check_dims
from lightning_shardrec.inference.rowwise import QuantDType, dequantize_rows, quantize_rows
from lightning_shardrec.inference.serving_ebc import check_rows
from lightning_shardrec.modules.plain_embeddings import find_embedding_modules, table_name


class _QuantRows(QuantTable):
    """The quantized rows of one plain module and the gather + dequantize of some of them."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: QuantDType, path: str) -> None:
        config = EmbeddingBagConfig(num_embeddings=num_embeddings, embedding_dim=embedding_dim, name=table_name(path))
        _check_dims([config], dtype)
        super().__init__(config, dtype, "cpu")
        self.num_embeddings, self.embedding_dim, self.path = num_embeddings, embedding_dim, path

    def set_weight(self, weight: Tensor) -> None:
        self.set_rows(quantize_rows(weight, self.dtype), copy=True)

    def gather(self, ids: Tensor) -> Tensor:
        """Float32 rows ``[N, dim]`` of ids ``[N]``."""
        rows = self.rows()
        ids = ids.long()
        check_rows(ids, self.num_embeddings, f"{type(self).__name__} '{self.path}'")
        return dequantize_rows(
            rows.dtype,
            rows.data[ids],
            None if rows.scale is None else rows.scale[ids],
            None if rows.bias is None else rows.bias[ids],
        )


class QuantEmbedding(_QuantRows):
    """``forward(input [*]) -> [*, dim]``: ``nn.Embedding`` on quantized rows."""

    def __init__(self, module: nn.Embedding, dtype: QuantDType, path: str) -> None:
        super().__init__(module.num_embeddings, module.embedding_dim, dtype, path)

    def forward(self, input: Tensor) -> Tensor:
        return self.gather(input.reshape(-1)).view(*input.shape, self.embedding_dim)


class QuantEmbeddingBag(_QuantRows):
    """``forward(input, offsets=None, per_sample_weights=None) -> [B, dim]``: ``nn.EmbeddingBag`` on quantized rows."""

    def __init__(self, module: nn.EmbeddingBag, dtype: QuantDType, path: str) -> None:
        super().__init__(module.num_embeddings, module.embedding_dim, dtype, path)
        self.mode, self.padding_idx, self.include_last_offset = (
            module.mode,
            module.padding_idx,
            module.include_last_offset,
        )

    def forward(self, input: Tensor, offsets: Tensor | None = None, per_sample_weights: Tensor | None = None) -> Tensor:
        flat = input.reshape(-1)
        rows = self.gather(flat)
        index = torch.arange(flat.numel(), device=flat.device)
        padding = None
        if self.padding_idx is not None:  # padding ids read a leading zero row that embedding_bag leaves out
            padding = 0
            index = torch.where(flat == self.padding_idx, 0, index + 1)
            rows = torch.cat([rows.new_zeros(1, self.embedding_dim), rows])
        return F.embedding_bag(
            index.view(input.shape),
            rows,
            offsets,
            mode=self.mode,
            per_sample_weights=per_sample_weights,
            include_last_offset=self.include_last_offset,
            padding_idx=padding,
        )


def quantize_plain(
    module: nn.Module, dtype: QuantDType, *, copy_weights: bool = True, paths: Sequence[str] | None = None
) -> list[str]:
    """Swap every plain ``nn.Embedding``/``nn.EmbeddingBag`` of ``module`` (not inside a collection;
    only those at ``paths`` when given) for its quantized module, in place; ``copy_weights=False``
    leaves the rows empty (to load a state dict). Returns the swapped paths."""
    found = find_embedding_modules(module)
    if paths is not None:
        found = {p: m for p, m in found.items() if p in set(paths)}
    for path, plain in found.items():
        kind = QuantEmbeddingBag if isinstance(plain, nn.EmbeddingBag) else QuantEmbedding
        quant = kind(plain, dtype, path)  # type: ignore[arg-type]
        if copy_weights:
            if plain.weight.device.type == "meta":
                raise ValueError(f"quantize: {type(plain).__name__} '{path}' is on the meta device (no weights)")
            quant.set_weight(plain.weight.detach())
        parent_name, _, child = path.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child, quant)
    return list(found)
