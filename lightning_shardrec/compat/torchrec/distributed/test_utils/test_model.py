"""A ``TestSparseNN``-style model and its ``ModelInput`` (``torchrec.distributed.test_utils.test_model``).

The same modules, sizes and parameter names as TorchRec's, so a test written for TorchRec's builds the
same model here::

    dense (float features [B, F]) -> Linear(F, 8)                                 TestDenseArch
    sparse (KJT, weighted KJT)    -> ebc / weighted_ebc -> one KeyedTensor         TestEBCSparseArch
    over  concat(dense, unweighted embeddings, weighted embeddings)
          -> Linear(in, 16) -> Linear(16, 16)                                      TestOverArch (TestDHNArch)
    pred = sigmoid(mean(over, dim=1)) + 1; training: (BCE-with-logits(pred, label), pred), eval: pred

``EmbeddingConfig`` tables make the sparse part an ``EmbeddingCollection`` (TestECSparseArch; each feature's
ids summed per sample, so the over arch gets one row per sample as with bags). TorchRec's
feature processors, managed-collision (``zch_kwargs``) and post-processing variants are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_shardrec.configs import EmbeddingBagConfig, EmbeddingConfig
from lightning_shardrec.errors import UnsupportedFeatureError
from lightning_shardrec.modules import EmbeddingBagCollection, EmbeddingCollection
from lightning_shardrec.sparse import KeyedJaggedTensor, KeyedTensor

DENSE_LAYER_OUT_SIZE = 8
OVER_ARCH_OUT_SIZE = 16


@dataclass
class ModelInput:
    """One batch: float features ``[B, F]``, id features, weighted id features, labels ``[B]``."""

    float_features: Tensor
    idlist_features: KeyedJaggedTensor | None
    idscore_features: KeyedJaggedTensor | None
    label: Tensor

    __test__ = False

    def to(self, device: torch.device | str, non_blocking: bool = False) -> ModelInput:
        def move(x: Any) -> Any:
            return None if x is None else x.to(device, non_blocking=non_blocking)

        return ModelInput(
            move(self.float_features), move(self.idlist_features), move(self.idscore_features), move(self.label)
        )

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        for t in (self.float_features, self.label):
            t.record_stream(stream)

    @staticmethod
    def generate(
        batch_size: int,
        world_size: int,
        num_float_features: int,
        tables: list[EmbeddingBagConfig] | list[EmbeddingConfig],
        weighted_tables: list[EmbeddingBagConfig] | None = None,
        pooling_avg: int = 10,
        device: torch.device | None = None,
        **unsupported: Any,
    ) -> tuple[ModelInput, list[ModelInput]]:
        """A global batch of ``world_size * batch_size`` samples and each rank's slice of it (rank ``r``: samples
        ``[r*B, (r+1)*B)``); ids uniform in each table's rows, 0 to ``2*pooling_avg`` ids per sample."""
        given = {k: v for k, v in unsupported.items() if v not in (None, False)}
        if given:
            raise UnsupportedFeatureError(f"ModelInput.generate: {sorted(given)} are not supported here")
        locals_ = [
            _local_input(batch_size, num_float_features, tables, weighted_tables or [], pooling_avg)
            for _ in range(world_size)
        ]
        glob = ModelInput(
            float_features=torch.cat([m.float_features for m in locals_]),
            idlist_features=_concat_kjts([m.idlist_features for m in locals_]),
            idscore_features=_concat_kjts([m.idscore_features for m in locals_]),
            label=torch.cat([m.label for m in locals_]),
        )
        if device is not None:
            return glob.to(device), [m.to(device) for m in locals_]
        return glob, locals_


def _features(tables: list[Any]) -> list[tuple[str, int]]:
    return [(f, t.num_embeddings) for t in tables for f in t.feature_names]


def _kjt(features: list[tuple[str, int]], batch: int, pooling_avg: int, weighted: bool) -> KeyedJaggedTensor | None:
    if not features:
        return None
    lengths = [torch.randint(0, 2 * pooling_avg + 1, (batch,)) for _ in features]
    values = [torch.randint(0, rows, (int(n.sum()),)) for (_, rows), n in zip(features, lengths, strict=True)]
    flat = torch.cat(values)
    return KeyedJaggedTensor(
        keys=[f for f, _ in features],
        values=flat,
        lengths=torch.cat(lengths),
        weights=torch.rand(flat.numel()) if weighted else None,
    )


def _local_input(batch: int, num_float: int, tables: list[Any], weighted: list[Any], pooling_avg: int) -> ModelInput:
    return ModelInput(
        float_features=torch.rand(batch, num_float),
        idlist_features=_kjt(_features(tables), batch, pooling_avg, weighted=False),
        idscore_features=_kjt(_features(weighted), batch, pooling_avg, weighted=True),
        label=torch.rand(batch),
    )


def _concat_kjts(kjts: list[KeyedJaggedTensor | None]) -> KeyedJaggedTensor | None:
    """The samples of ``kjts`` one after another, per feature (the global batch of every rank's local one)."""
    if kjts[0] is None:
        return None
    keys = kjts[0].keys()
    per_rank = [k.to_dict() for k in kjts]  # type: ignore[union-attr]
    values, lengths, weights = [], [], []
    for key in keys:
        for d in per_rank:
            values.append(d[key].values())
            lengths.append(d[key].lengths())
            if d[key].weights_or_none() is not None:
                weights.append(d[key].weights())
    return KeyedJaggedTensor(
        keys=keys, values=torch.cat(values), lengths=torch.cat(lengths), weights=torch.cat(weights) if weights else None
    )


class TestDenseArch(nn.Module):
    """Float features ``[B, F]`` -> ``[B, dense_arch_out_size]`` (optional hidden layers first)."""

    __test__ = False

    def __init__(
        self,
        num_float_features: int,
        device: torch.device | None = None,
        dense_arch_out_size: int | None = None,
        dense_arch_hidden_sizes: list[int] | None = None,
        **_kwargs: Any,
    ) -> None:
        super().__init__()
        device = device or torch.device("cpu")
        sizes, width = list(dense_arch_hidden_sizes or []), num_float_features
        hidden = []
        for size in sizes:
            if size <= 0:
                raise ValueError(f"TestDenseArch: hidden layer sizes must be positive, got {sizes}")
            hidden.append(nn.Linear(width, size, device=device))
            width = size
        self.hidden_layers = nn.ModuleList(hidden) if hidden else None
        self.linear = nn.Linear(width, dense_arch_out_size or DENSE_LAYER_OUT_SIZE, device=device)
        self.dummy_param = nn.Parameter(torch.zeros(2, device=device))
        self.register_buffer("dummy_buffer", torch.zeros(1, device=device))

    def forward(self, dense_input: Tensor) -> Tensor:
        out = dense_input
        for layer in self.hidden_layers or []:
            out = layer(out)
        return self.linear(out)


class TestDHNArch(nn.Module):
    """Two linear layers: ``in_features -> over_arch_out_size -> over_arch_out_size``."""

    __test__ = False

    def __init__(self, in_features: int, device: torch.device | None = None, over_arch_out_size: int | None = None):
        super().__init__()
        out = over_arch_out_size or OVER_ARCH_OUT_SIZE
        self.linear0 = nn.Linear(in_features, out, device=device or torch.device("cpu"))
        self.linear1 = nn.Linear(out, out, device=device or torch.device("cpu"))

    def forward(self, input: Tensor) -> Tensor:
        return self.linear1(self.linear0(input))


def _dim_sum(tables: list[Any]) -> int:
    return sum(t.embedding_dim * len(t.feature_names) for t in tables)


class TestOverArch(nn.Module):
    """Concatenates the dense output with the unweighted then the weighted embeddings, then a DHN."""

    __test__ = False

    def __init__(
        self,
        tables: list[Any],
        weighted_tables: list[Any],
        embedding_names: list[str] | None = None,
        device: torch.device | None = None,
        dense_arch_out_size: int | None = None,
        over_arch_out_size: int | None = None,
        **_kwargs: Any,
    ) -> None:
        super().__init__()
        self._embedding_names = embedding_names or [f for t in tables for f in t.feature_names]
        self._weighted_features = [f for t in weighted_tables for f in t.feature_names]
        in_features = (dense_arch_out_size or DENSE_LAYER_OUT_SIZE) + _dim_sum(list(tables) + list(weighted_tables))
        self.dhn_arch = TestDHNArch(in_features, device, over_arch_out_size)

    def forward(self, dense: Tensor, sparse: KeyedTensor) -> Tensor:
        groups = [g for g in (self._embedding_names, self._weighted_features) if g]
        return self.dhn_arch(torch.cat([dense, *KeyedTensor.regroup([sparse], groups)], dim=1))


class TestEBCSparseArch(nn.Module):
    """``ebc`` (and ``weighted_ebc``) over the id features; one KeyedTensor of both, unweighted keys first."""

    __test__ = False

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        weighted_tables: list[EmbeddingBagConfig],
        device: torch.device | None = None,
        max_feature_lengths: dict[str, int] | None = None,
        **_kwargs: Any,
    ) -> None:
        super().__init__()
        if max_feature_lengths is not None:
            raise UnsupportedFeatureError(
                "TestEBCSparseArch(max_feature_lengths=...): feature processors are not supported"
            )
        self.ebc = EmbeddingBagCollection(tables=tables, device=device)
        self.weighted_ebc = (
            EmbeddingBagCollection(tables=weighted_tables, is_weighted=True, device=device) if weighted_tables else None
        )

    def forward(
        self,
        features: KeyedJaggedTensor,
        weighted_features: KeyedJaggedTensor | None = None,
        batch_size: int | None = None,
    ) -> KeyedTensor:
        out = self.ebc(features)
        if self.weighted_ebc is None or weighted_features is None:
            return out
        w = self.weighted_ebc(weighted_features)
        return KeyedTensor(
            keys=[*out.keys(), *w.keys()],
            length_per_key=[*out.length_per_key(), *w.length_per_key()],
            values=torch.cat([out.values(), w.values()], dim=1),
        )


class TestECSparseArch(nn.Module):
    """``ec`` over the id features; each feature's embeddings summed per sample, as one KeyedTensor."""

    __test__ = False

    def __init__(self, tables: list[EmbeddingConfig], device: torch.device | None = None, **_kwargs: Any) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(tables=tables, device=device)

    def forward(
        self,
        features: KeyedJaggedTensor,
        weighted_features: KeyedJaggedTensor | None = None,
        batch_size: int | None = None,
    ) -> KeyedTensor:
        jts = self.ec(features)
        keys = list(jts)
        pooled = [torch.ops.aten.segment_reduce(jts[k].values(), "sum", lengths=jts[k].lengths(), axis=0) for k in keys]
        return KeyedTensor(keys=keys, length_per_key=[p.shape[1] for p in pooled], values=torch.cat(pooled, dim=1))


class TestSparseNN(nn.Module):
    """TorchRec's test model: ``forward(ModelInput)`` -> ``(loss, pred)`` in training, ``pred`` in eval."""

    __test__ = False

    def __init__(
        self,
        tables: list[EmbeddingBagConfig] | list[EmbeddingConfig],
        num_float_features: int = 10,
        weighted_tables: list[EmbeddingBagConfig] | None = None,
        embedding_groups: dict[str, list[str]] | None = None,
        dense_device: torch.device | None = None,
        sparse_device: torch.device | None = None,
        max_feature_lengths: dict[str, int] | None = None,
        feature_processor_modules: dict[str, nn.Module] | None = None,
        over_arch_clazz: type[nn.Module] | None = None,
        postproc_module: nn.Module | None = None,
        zch_kwargs: dict[str, Any] | None = None,
        submodule_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        refused = {"feature_processor_modules": feature_processor_modules, "zch_kwargs": zch_kwargs}
        for name, value in refused.items():
            if value is not None:
                raise UnsupportedFeatureError(f"TestSparseNN({name}=...) is not supported here")
        weighted_tables = weighted_tables or []
        extra = submodule_kwargs or {}
        self.dense = TestDenseArch(num_float_features, device=dense_device, **extra)
        if tables and isinstance(tables[0], EmbeddingConfig) and not isinstance(tables[0], EmbeddingBagConfig):
            self.sparse: nn.Module = TestECSparseArch(tables, sparse_device, **extra)  # type: ignore[arg-type]
        else:
            self.sparse = TestEBCSparseArch(tables, weighted_tables, sparse_device, max_feature_lengths, **extra)  # type: ignore[arg-type]
        names = list(embedding_groups.values())[0] if embedding_groups else None
        self.over = (over_arch_clazz or TestOverArch)(tables, weighted_tables, names, dense_device, **extra)
        self.register_buffer("dummy_ones", torch.ones(1, device=dense_device))
        self.postproc_module = postproc_module

    def sparse_forward(self, input: ModelInput) -> KeyedTensor:
        return self.sparse(
            features=input.idlist_features,
            weighted_features=input.idscore_features,
            batch_size=input.float_features.size(0),
        )

    def dense_forward(self, input: ModelInput, sparse_output: KeyedTensor) -> Tensor | tuple[Tensor, Tensor]:
        over = self.over(self.dense(input.float_features), sparse_output)
        ones = self.get_buffer("dummy_ones")
        pred = torch.sigmoid(torch.mean(over, dim=1)) + ones
        if self.training:
            return nn.functional.binary_cross_entropy_with_logits(pred, input.label), pred
        return pred

    def forward(self, input: ModelInput) -> Tensor | tuple[Tensor, Tensor]:
        if self.postproc_module is not None:
            input = self.postproc_module(input)
        return self.dense_forward(input, self.sparse_forward(input))


__all__ = [
    "ModelInput",
    "TestDHNArch",
    "TestDenseArch",
    "TestEBCSparseArch",
    "TestECSparseArch",
    "TestOverArch",
    "TestSparseNN",
]
