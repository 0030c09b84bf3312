"""TorchRec's per-table kernel settings: ``CacheParams`` and ``KeyValueParams`` (``torchrec.distributed.types``).

Both are plain values with TorchRec's fields and hashes. What they mean here:

* ``CacheParams`` (UVM caching: algorithm, load factor, ...) has no effect: every table lives whole in
  the device's memory (HBM on GPUs, DDR on CPU), so there is no cache to size. It is accepted wherever
  TorchRec takes it (``ParameterConstraints(cache_params=...)``) and ignored.
* ``KeyValueParams`` (SSD / parameter-server tables) cannot be honoured: a constraint that carries one is
  refused (:func:`refuse_key_value`).
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import Any

from lightning_shardrec.errors import UnsupportedFeatureError


@dataclass
class CacheParams:
    """UVM-cache settings of one table (accepted, no effect here: see the module docstring)."""

    algorithm: Any = None  # fbgemm's CacheAlgorithm (LRU / LFU)
    load_factor: float | None = None
    reserved_memory: float | None = None
    precision: Any = None  # DataType
    prefetch_pipeline: bool | None = None
    stats: Any = None  # CacheStatistics; not part of the hash, as in TorchRec
    multipass_prefetch_config: Any = None

    def __hash__(self) -> int:
        return hash(
            (
                self.algorithm,
                self.load_factor,
                self.reserved_memory,
                self.precision,
                self.prefetch_pipeline,
                self.multipass_prefetch_config,
            )
        )


@dataclass
class KeyValueParams:
    """SSD / parameter-server settings of one table (not supported here: see the module docstring)."""

    ssd_storage_directory: str | None = None
    ssd_rocksdb_write_buffer_size: int | None = None
    ssd_rocksdb_shards: int | None = None
    gather_ssd_cache_stats: bool | None = None
    stats_reporter_config: Any = None
    use_passed_in_path: bool = True
    l2_cache_size: int | None = None
    max_l1_cache_size: int | None = None
    enable_async_update: bool | None = None
    bulk_init_chunk_size: int | None = None
    lazy_bulk_init_enabled: bool | None = None
    enable_raw_embedding_streaming: bool | None = None
    res_store_shards: int | None = None
    kvzch_tbe_config: Any = None
    load_ckpt_without_opt: bool = False
    ps_hosts: tuple[tuple[str, int], ...] | None = None
    ps_client_thread_num: int | None = None
    ps_max_key_per_request: int | None = None
    ps_max_local_index_length: int | None = None

    def __hash__(self) -> int:
        return hash(astuple(self))


def refuse_key_value(params: KeyValueParams | None, use_virtual_table: bool, where: str) -> None:
    """Key-value (SSD, parameter-server, virtual) tables are not supported: raise naming ``where``."""
    if params is not None or use_virtual_table:
        what = f"key_value_params={params!r}" if params is not None else "use_virtual_table=True"
        raise UnsupportedFeatureError(
            f"{where}: {what} asks for a key-value (SSD / parameter-server) table, which is not supported: "
            "tables live whole in device memory here; size num_embeddings to fit (see docs/migrating.md)"
        )


__all__ = ["CacheParams", "KeyValueParams", "refuse_key_value"]
