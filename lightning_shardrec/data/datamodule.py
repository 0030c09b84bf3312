"""LightningDataModules of :class:`RecBatch` es: synthetic (the default data) and Criteo.

Both yield whole batches from an ``IterableDataset`` (no ``DistributedSampler``):
rank ``r`` of ``W`` gets rows ``[r*B, (r+1)*B)`` of global batch ``i``, so
``devices=W, batch_size=B`` and ``devices=1, batch_size=B*W`` train on the same
global batches. Rank and world size come from the attached Trainer in ``setup()``
(0 and 1 without one). Train loaders resume mid-epoch from checkpoints.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

import lightning as L

from lightning_shardrec.configs import DynamicConfig, EmbeddingBagConfig
from lightning_shardrec.data.criteo import (
    OnBadLine,
    check_on_bad_line,
    criteo_tables,
    find_criteo_files,
    table_sizes,
)
from lightning_shardrec.data.criteo_binary import (
    CriteoBinary,
    CriteoBinaryDataset,
    preprocess_criteo,
    split_ranges,
)
from lightning_shardrec.data.loader import IndexedBatchDataset, RecBatchLoader
from lightning_shardrec.data.synthetic import (
    FeatureSpec,
    SyntheticRecDataset,
    SyntheticRecGenerator,
    SyntheticSpec,
    TableLike,
    benchmark_features,
    to_features,
)

# Lightning warns about every IterableDataset with __len__; ours is exact by construction
# (worker k takes batches k, k+n, ...), so that one message is noise here.
warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined")


def _count(owner: str, name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{owner}: {name} must be an int >= {minimum}, got {value!r}")


class _RecDataModule(L.LightningDataModule):
    """Shared plumbing: rank discovery and loaders over per-split datasets."""

    def __init__(self, *, batch_size: int, num_workers: int, pin_memory: bool) -> None:
        super().__init__()
        name = type(self).__name__
        _count(name, "batch_size", batch_size, 1)
        _count(name, "num_workers", num_workers, 0)
        self.batch_size, self.num_workers, self.pin_memory = batch_size, num_workers, pin_memory
        self.datasets: dict[str, IndexedBatchDataset] = {}

    def rank_and_world_size(self) -> tuple[int, int]:
        """``(global_rank, world_size)`` of the attached Trainer, else ``(0, 1)``."""
        trainer = self.trainer
        return (0, 1) if trainer is None else (trainer.global_rank, trainer.world_size)

    def _loader(self, split: str) -> RecBatchLoader | list:
        if split not in self.datasets:
            raise ValueError(
                f"{type(self).__name__}: call setup() before asking for the {split} dataloader"
            )
        dataset = self.datasets[split]
        if split != "train" and len(dataset) == 0:
            return []
        return RecBatchLoader(dataset, num_workers=self.num_workers, pin_memory=self.pin_memory)

    def train_dataloader(self) -> RecBatchLoader:
        return self._loader("train")  # type: ignore[return-value]

    def val_dataloader(self) -> RecBatchLoader | list:
        return self._loader("val")

    def test_dataloader(self) -> RecBatchLoader | list:
        return self._loader("test")

    def predict_dataloader(self) -> RecBatchLoader | list:
        """The test split, or the validation split when there is no test split."""
        test = self.datasets.get("test")
        return self._loader("test" if test is not None and len(test) > 0 else "val")


class SyntheticRecDataModule(_RecDataModule):
    """Synthetic click logs (see :mod:`lightning_shardrec.data.synthetic`); the default data.

    ``tables``: ``FeatureSpec``s, dicts ``{name, num_embeddings[, pooling_factor]}``
    (YAML-friendly) or ``EmbeddingBagConfig``s; default the benchmark's 8 features.
    Each epoch replays the same ``num_batches`` global batches; val/test are other streams.
    """

    def __init__(
        self,
        num_dense: int = 13,
        tables: Sequence[TableLike] | None = None,
        batch_size: int = 1024,
        num_batches: int = 100,
        val_batches: int = 10,
        test_batches: int = 0,
        pooling_factor: float = 8.9,
        empty_fraction: float = 0.1,
        zipf_alpha: float = 1.05,
        weighted: bool = False,
        seed: int = 0,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers, pin_memory=pin_memory)
        for name, value in (
            ("num_batches", num_batches),
            ("val_batches", val_batches),
            ("test_batches", test_batches),
        ):
            _count("SyntheticRecDataModule", name, value, 0)
        self.save_hyperparameters()
        self.spec = SyntheticSpec(
            features=benchmark_features() if tables is None else to_features(tables),
            num_dense=num_dense,
            pooling_factor=pooling_factor,
            empty_fraction=empty_fraction,
            zipf_alpha=zipf_alpha,
            weighted=weighted,
            seed=seed,
        )
        self.num_batches = {"train": num_batches, "val": val_batches, "test": test_batches}
        self._tables = list(tables) if tables is not None else None

    def embedding_tables(self, embedding_dim: int) -> list[EmbeddingBagConfig]:
        """Tables for a model: the given ``EmbeddingBagConfig``s, else ``t_<feature>`` per feature."""
        if self._tables and all(isinstance(t, EmbeddingBagConfig) for t in self._tables):
            return list(self._tables)  # type: ignore[arg-type]
        return [
            EmbeddingBagConfig(
                num_embeddings=f.num_embeddings,
                embedding_dim=embedding_dim,
                name=f"t_{f.name}",
                feature_names=[f.name],
            )
            for f in self.spec.features
        ]

    @property
    def features(self) -> tuple[FeatureSpec, ...]:
        return self.spec.features

    def setup(self, stage: str) -> None:
        rank, world_size = self.rank_and_world_size()
        generator = SyntheticRecGenerator(self.spec)
        self.datasets = {
            split: SyntheticRecDataset(
                self.spec,
                batch_size=self.batch_size,
                num_batches=n,
                rank=rank,
                world_size=world_size,
                stream=split,
                generator=generator,
            )
            for split, n in self.num_batches.items()
        }


class CriteoDataModule(_RecDataModule):
    """Criteo Terabyte/Kaggle logs in ``data_dir``, preprocessed once into ``processed_dir``.

    ``prepare_data()`` (rank 0) streams the raw files into memory-mapped ``.npy``
    (default ``<data_dir>/processed``); ``setup()`` maps them and splits rows
    contiguously into train | val | test. Malformed lines raise, or are skipped and
    counted with ``on_bad_line="skip"`` (:attr:`bad_lines`).

    ``raw_ids=True`` keeps each categorical id's raw 64-bit value (no hashing) and makes
    the tables dynamic (``dynamic``, default ``DynamicConfig()``: capacity
    ``num_embeddings`` each); ``dynamic`` alone makes dynamic tables of the hashed ids.
    """

    def __init__(
        self,
        data_dir: str | Path,
        processed_dir: str | Path | None = None,
        num_embeddings: int | list[int] = 100_000,
        batch_size: int = 1024,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        on_bad_line: OnBadLine = "error",
        num_workers: int = 0,
        pin_memory: bool = False,
        raw_ids: bool = False,
        dynamic: DynamicConfig | None = None,
    ) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers, pin_memory=pin_memory)
        self.save_hyperparameters()
        self.raw_ids = bool(raw_ids)
        self.dynamic = DynamicConfig() if raw_ids and dynamic is None else dynamic
        self.data_dir = Path(data_dir)
        self.processed_dir = (
            Path(processed_dir) if processed_dir is not None else self.data_dir / "processed"
        )
        self.num_embeddings = table_sizes(num_embeddings).tolist()
        self.on_bad_line = check_on_bad_line(on_bad_line)
        split_ranges(0, val_fraction, test_fraction)  # validates the fractions now
        self.val_fraction, self.test_fraction = val_fraction, test_fraction
        self.data: CriteoBinary | None = None

    def embedding_tables(self, embedding_dim: int) -> list[EmbeddingBagConfig]:
        return criteo_tables(embedding_dim, self.num_embeddings, self.dynamic)

    def prepare_data(self) -> None:
        preprocess_criteo(
            find_criteo_files(self.data_dir),
            self.processed_dir,
            num_embeddings=self.num_embeddings,
            on_bad_line=self.on_bad_line,
            raw_ids=self.raw_ids,
        )

    @property
    def bad_lines(self) -> int:
        """Malformed lines skipped while preprocessing (0 unless ``on_bad_line="skip"``)."""
        if self.data is None:
            raise ValueError("CriteoDataModule.bad_lines is known after setup()")
        return self.data.meta.bad_lines

    def setup(self, stage: str) -> None:
        data = CriteoBinary(self.processed_dir)
        if list(data.meta.num_embeddings) != self.num_embeddings:
            raise ValueError(
                f"CriteoDataModule: processed_dir {str(self.processed_dir)!r} was hashed with num_embeddings "
                f"{list(data.meta.num_embeddings)}, not {self.num_embeddings}; delete it or use another processed_dir"
            )
        if data.meta.raw_ids != self.raw_ids:
            raise ValueError(
                f"CriteoDataModule: processed_dir {str(self.processed_dir)!r} holds "
                f"{'raw' if data.meta.raw_ids else 'hashed'} ids, not raw_ids={self.raw_ids}; "
                "delete it or use another processed_dir"
            )
        rank, world_size = self.rank_and_world_size()
        ranges = split_ranges(len(data), self.val_fraction, self.test_fraction)
        self.data = data
        self.datasets = {
            split: CriteoBinaryDataset(
                data, rows, batch_size=self.batch_size, rank=rank, world_size=world_size
            )
            for split, rows in ranges.items()
        }
