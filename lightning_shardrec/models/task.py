"""``DLRMTask``: a LightningModule that trains a DLRM or DCNv2 on ``RecBatch`` es.

BCE-with-logits loss; logs ``{train,val,test}_loss``, ``_auroc`` (torchmetrics),
``_ne`` (normalized entropy) and ``_calibration``. Every argument is a plain value,
so LightningCLI builds it from YAML::

    model:
      class_path: lightning_shardrec.models.DLRMTask
      init_args: {embedding_dim: 16, dense_arch_layer_sizes: [64, 16], over_arch_layer_sizes: [64, 1]}

Tables: ``embedding_tables`` (dicts, see :func:`table_configs`), else the attached datamodule's
``embedding_tables(embedding_dim)``, read in ``configure_model`` and then kept in
``hparams`` so ``DLRMTask.load_from_checkpoint`` rebuilds the same model. The
weights are drawn from ``seed`` alone, so every rank builds the same model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MetricCollection
from torchmetrics.classification import BinaryAUROC

from lightning_shardrec.configs import DynamicConfig, EmbeddingBagConfig, PoolingType
from lightning_shardrec.data import RecBatch
from lightning_shardrec.errors import unknown_name
from lightning_shardrec.metrics import Calibration, NormalizedEntropy
from lightning_shardrec.models.dcn import DCNv2
from lightning_shardrec.models.dlrm import DLRM
from lightning_shardrec.modules import EmbeddingBagCollection, optimizer_reset_hook
from lightning_shardrec.modules.dynamic.tables import HasDynamicTables

ARCHS = ("dlrm", "dcn")
# Each has a fused counterpart the strategy derives for the tables (sgd, adagrad, adam, adamw).
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adagrad": torch.optim.Adagrad,
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}
STAGES = ("train", "val", "test")
TABLE_KEYS = ("name", "num_embeddings", "embedding_dim", "feature_names", "pooling", "dynamic")


def table_configs(tables: Sequence[Mapping[str, Any]], embedding_dim: int) -> list[EmbeddingBagConfig]:
    """``EmbeddingBagConfig`` s from dicts ``{name, num_embeddings[, embedding_dim, feature_names, pooling,
    dynamic]}``.

    ``embedding_dim`` defaults to the argument, ``feature_names`` to ``[name]``, ``pooling`` to ``SUM``;
    ``dynamic`` (a dict of ``DynamicConfig`` fields, or one) makes a dynamic table.
    """
    out = []
    for t in tables:
        extra = sorted(set(t) - set(TABLE_KEYS))
        if extra or "name" not in t or "num_embeddings" not in t:
            raise ValueError(
                f"DLRMTask table {dict(t)!r}: needs name and num_embeddings; optional keys: "
                f"embedding_dim, feature_names, pooling, dynamic (unknown: {extra})"
            )
        dynamic = t.get("dynamic")
        if isinstance(dynamic, Mapping):
            dynamic = DynamicConfig(**dynamic)
        pooling = str(t.get("pooling", "SUM")).upper()
        if pooling not in ("SUM", "MEAN"):
            raise unknown_name(f"pooling of table {t['name']!r}", t.get("pooling"), ["SUM", "MEAN"])
        out.append(
            EmbeddingBagConfig(
                name=t["name"],
                num_embeddings=t["num_embeddings"],
                embedding_dim=t.get("embedding_dim", embedding_dim),
                feature_names=list(t.get("feature_names", [t["name"]])),
                pooling=PoolingType(pooling),
                dynamic=dynamic,
            )
        )
    return out


def table_specs(configs: Sequence[EmbeddingBagConfig]) -> list[dict[str, Any]]:
    """The inverse of :func:`table_configs` (plain values, for ``hparams`` and YAML)."""
    return [
        {
            "name": c.name,
            "num_embeddings": c.num_embeddings,
            "embedding_dim": c.embedding_dim,
            "feature_names": list(c.feature_names),
            "pooling": c.pooling.value,
            **({} if c.dynamic is None else {"dynamic": dynamic_spec(c.dynamic)}),
        }
        for c in configs
    ]


def dynamic_spec(config: DynamicConfig) -> dict[str, Any]:
    """A ``DynamicConfig`` as plain values (``DynamicConfig(**spec)`` rebuilds it)."""
    return {
        "eviction": config.eviction.value,
        "ttl_steps": config.ttl_steps,
        "min_count": config.min_count,
        "num_buckets": config.num_buckets,
        "candidates_per_bucket": config.candidates_per_bucket,
        "seed": config.seed,
    }


class DLRMTask(L.LightningModule):
    """Click-through prediction with a DLRM (``arch="dlrm"``) or DCNv2 (``arch="dcn"``).

    Args:
        embedding_tables: table dicts (see :func:`table_configs`); default: the
            datamodule's ``embedding_tables(embedding_dim)``.
        embedding_dim: default width of every table.
        num_dense: dense features per sample (``RecBatch.dense`` is ``[B, num_dense]``).
        arch: ``"dlrm"`` or ``"dcn"``.
        dense_arch_layer_sizes: the bottom MLP.
        over_arch_layer_sizes: the top MLP (ends in 1).
        interaction: DLRM's ``"dot"`` or ``"concat"`` (ignored by ``"dcn"``).
        dcn_num_layers: DCNv2's cross layers.
        dcn_low_rank_dim: the rank of DCNv2's cross weights.
        optimizer: one of :data:`OPTIMIZERS` for every parameter; the strategy
            trains the tables with its fused counterpart.
        lr: its learning rate.
        auroc_thresholds: bins of the AUROC (constant memory; ``None``: exact, keeps every prediction).
        seed: seed of the weight init.
        model: a ready ``nn.Module`` ``(dense, sparse) -> logits [B, 1]`` instead of building one.
    """

    def __init__(
        self,
        embedding_tables: list[dict[str, Any]] | None = None,
        embedding_dim: int = 16,
        num_dense: int = 13,
        arch: str = "dlrm",
        dense_arch_layer_sizes: list[int] | None = None,
        over_arch_layer_sizes: list[int] | None = None,
        interaction: str = "dot",
        dcn_num_layers: int = 3,
        dcn_low_rank_dim: int | None = None,
        optimizer: str = "adagrad",
        lr: float = 0.05,
        auroc_thresholds: int | None = 1000,
        seed: int = 0,
        model: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if arch not in ARCHS:
            raise unknown_name("DLRMTask arch", arch, list(ARCHS))
        if optimizer not in OPTIMIZERS:
            raise unknown_name("DLRMTask optimizer", optimizer, list(OPTIMIZERS))
        self.save_hyperparameters(ignore=["model"])
        self.model = model
        self.train_metrics, self.val_metrics, self.test_metrics = (
            MetricCollection(
                {
                    "auroc": BinaryAUROC(thresholds=auroc_thresholds),
                    "ne": NormalizedEntropy(),
                    "calibration": Calibration(),
                },
                prefix=f"{stage}_",
                compute_groups=False,
            )
            for stage in STAGES
        )
        if model is None and embedding_tables is not None:
            self.model = self.build(table_configs(embedding_tables, embedding_dim))

    def build(self, tables: list[EmbeddingBagConfig]) -> nn.Module:
        """The ``arch`` model over ``tables``, weights drawn from ``seed`` (same on every rank)."""
        h: Any = self.hparams
        dense_sizes = h.dense_arch_layer_sizes or [64, embedding_dim_of(tables, h.embedding_dim)]
        over_sizes = h.over_arch_layer_sizes or [64, 1]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(h.seed)
            ebc = EmbeddingBagCollection(tables=tables)
            if h.arch == "dcn":
                return DCNv2(ebc, h.num_dense, dense_sizes, over_sizes, h.dcn_num_layers, h.dcn_low_rank_dim)
            return DLRM(ebc, h.num_dense, dense_sizes, over_sizes, interaction=h.interaction)

    def configure_model(self) -> None:
        """Build the model from the datamodule's tables when ``embedding_tables`` was not given."""
        if self.model is not None:
            return
        dm = getattr(self._trainer, "datamodule", None)
        if dm is None or not hasattr(dm, "embedding_tables"):
            raise ValueError(
                "DLRMTask: no tables: pass embedding_tables=[{name, num_embeddings}, ...] or fit with a datamodule "
                f"that has embedding_tables(dim) (SyntheticRecDataModule, CriteoDataModule); got {type(dm).__name__}"
            )
        h: Any = self.hparams
        data_dense = getattr(dm, "hparams", {}).get("num_dense", h.num_dense)
        if data_dense != h.num_dense:
            raise ValueError(
                f"DLRMTask(num_dense={h.num_dense}) does not match the datamodule's "
                f"num_dense={data_dense}; set both to the same value"
            )
        tables = dm.embedding_tables(h.embedding_dim)
        self.hparams["embedding_tables"] = table_specs(tables)  # checkpoints rebuild the model from hparams
        self.model = self.build(tables)

    def forward(self, batch: RecBatch) -> Tensor:
        """Logits ``[B]``."""
        if self.model is None:
            raise ValueError("DLRMTask: the model is built in configure_model(); call it (or use a Trainer) first")
        return self.model(batch.dense, batch.sparse).squeeze(1)

    def _step(self, batch: RecBatch, stage: str) -> Tensor:
        logits = self(batch)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        train = stage == "train"
        b = batch.batch_size
        self.log(f"{stage}_loss", loss, prog_bar=True, on_step=train, on_epoch=True, sync_dist=True, batch_size=b)
        metrics: MetricCollection = getattr(self, f"{stage}_metrics")
        probs, labels = logits.detach().sigmoid(), batch.labels.long()
        if train:
            metrics(probs, labels)  # batch values for the step curves, accumulated for the epoch
        else:
            metrics.update(probs, labels)
        self.log_dict(metrics, on_step=train, on_epoch=True, prog_bar=not train, batch_size=b)
        return loss

    def training_step(self, batch: RecBatch, batch_idx: int) -> Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: RecBatch, batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch: RecBatch, batch_idx: int) -> None:
        self._step(batch, "test")

    def predict_step(self, batch: RecBatch, batch_idx: int) -> Tensor:
        """Click probabilities ``[B]``."""
        return self(batch).sigmoid()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        h: Any = self.hparams
        optimizer = OPTIMIZERS[h.optimizer](self.parameters(), lr=h.lr)
        for handle in getattr(self, "_reset_handles", []):  # a new optimizer replaces the last one
            handle.remove()
        self._reset_handles = [
            m.dynamic_tables.register_reset_hook(optimizer_reset_hook(optimizer))
            for m in (self.model.modules() if self.model is not None else [])
            if isinstance(m, HasDynamicTables) and m.dynamic_tables is not None
        ]  # unsharded dynamic tables: admitted rows restart their optimizer state
        return optimizer


def embedding_dim_of(tables: Sequence[EmbeddingBagConfig], default: int) -> int:
    """The tables' common width (the dense arch's default output), else ``default``."""
    dims = {t.embedding_dim for t in tables}
    return dims.pop() if len(dims) == 1 else default
