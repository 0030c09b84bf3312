"""TorchRec's per-table kernel settings: ``CacheParams`` and ``KeyValueParams`` (``torchrec.distributed.types``).

Both are plain values with TorchRec's fields and hashes. What they mean here:

* ``CacheParams`` (UVM caching: algorithm, load factor, ...) has no effect: every table lives whole in
  the device's memory (HBM on GPUs, DDR on CPU), so there is no cache to size. It is accepted wherever
  TorchRec takes it (``ParameterConstraints(cache_params=...)``) and ignored.
* ``KeyValueParams`` (SSD / parameter-server tables) cannot be honoured: a constraint that carries one is
  refused (:func:`refuse_key_value`).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import astuple, dataclass
from typing import Any

from lightning_shardrec.configs import DataType
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


class BoundsCheckMode(enum.IntEnum):
    """fbgemm's bounds-check modes (TorchRec re-exports fbgemm's enum; the values are fbgemm's, so either
    compares equal). Here every id is checked whatever the mode: an out-of-range id raises, naming the table."""

    FATAL = 0
    WARNING = 1
    IGNORE = 2
    NONE = 3
    V2_IGNORE = 4
    V2_WARNING = 5
    V2_FATAL = 6


#: TorchRec's ParameterSharding fields after ``sharding_spec``, and what each means here
TORCHREC_SHARDING_FIELDS = {
    "cache_params": "kept, no effect: no UVM caches, every table lives whole in device memory",
    "enforce_hbm": "kept, no effect: tables always live in the compute device's memory",
    "stochastic_rounding": "kept, no effect: tables train in fp32, so updates need no stochastic rounding",
    "bounds_check_mode": "kept, no effect: every id is checked, an out-of-range id raises naming the table",
    "output_dtype": "None or DataType.FP32 only: the collections' outputs are fp32 here",
    "key_value_params": "refused: key-value (SSD / parameter-server) tables are not supported",
}


def check_sharding_fields(
    cache_params: CacheParams | None,
    enforce_hbm: bool | None,
    stochastic_rounding: bool | None,
    bounds_check_mode: Any,
    output_dtype: Any,
    key_value_params: KeyValueParams | None,
) -> dict[str, Any]:
    """TorchRec's per-table kernel settings of a ``ParameterSharding``, checked and normalised (see
    :data:`TORCHREC_SHARDING_FIELDS`); bad values raise naming the field, the value and the choices."""
    refuse_key_value(key_value_params, False, "ParameterSharding")
    if cache_params is not None and not isinstance(cache_params, CacheParams):
        raise TypeError(f"ParameterSharding: cache_params must be a CacheParams or None, got {cache_params!r}")
    for name, flag in (("enforce_hbm", enforce_hbm), ("stochastic_rounding", stochastic_rounding)):
        if flag is not None and not isinstance(flag, bool):
            raise TypeError(f"ParameterSharding: {name} must be True, False or None, got {flag!r}")
    mode = None
    if bounds_check_mode is not None:
        key = getattr(bounds_check_mode, "name", bounds_check_mode)
        if isinstance(key, str):
            mode = BoundsCheckMode.__members__.get(key.upper())
        else:
            mode = next((m for m in BoundsCheckMode if m.value == key and not isinstance(key, bool)), None)
        if mode is None:
            raise ValueError(
                f"ParameterSharding: unknown bounds_check_mode {bounds_check_mode!r}; "
                f"choose one of {', '.join(BoundsCheckMode.__members__)}"
            )
    dtype = None
    if output_dtype is not None:
        dtype = DataType.__members__.get(str(getattr(output_dtype, "name", output_dtype)))
        if dtype is not DataType.FP32:
            raise UnsupportedFeatureError(
                f"ParameterSharding: output_dtype={output_dtype!r} is not supported; the collections' "
                "outputs are fp32 here (None or DataType.FP32)"
            )
    return {
        "cache_params": cache_params,
        "enforce_hbm": enforce_hbm,
        "stochastic_rounding": stochastic_rounding,
        "bounds_check_mode": mode,
        "output_dtype": dtype,
        "key_value_params": None,
    }


def with_constraint_fields(ps: Any, constraint: Any) -> Any:
    """``ps`` with the kernel settings its table's ``ParameterConstraints`` sets (TorchRec's planner copies
    them into the plan); a setting ``ps`` has already is kept."""
    names = ("cache_params", "enforce_hbm", "stochastic_rounding", "bounds_check_mode", "output_dtype")
    given = {n: getattr(constraint, n) for n in names if getattr(constraint, n, None) is not None}
    given = {n: v for n, v in given.items() if getattr(ps, n) is None}
    return dataclasses.replace(ps, **given) if given else ps


def sharding_fields_to_dict(ps: Any) -> dict[str, object]:
    """The JSON form of ``ps``'s set kernel settings (``cache_params``, which has no effect here and holds
    fbgemm objects, is left out; enums by name)."""
    out: dict[str, object] = {}
    for name in ("enforce_hbm", "stochastic_rounding", "bounds_check_mode", "output_dtype"):
        value = getattr(ps, name)
        if value is not None:
            out[name] = value.name if isinstance(value, enum.Enum) else value
    return out


def sharding_fields_from_dict(data: dict[str, object], table: str) -> dict[str, Any]:
    """The kernel settings of a plan entry's JSON form (:func:`sharding_fields_to_dict`)."""
    unknown = sorted(
        set(data) - {"sharding_type", "compute_kernel", "ranks", "shards", *TORCHREC_SHARDING_FIELDS}
    )
    if unknown:
        raise ValueError(
            f"plan entry for table '{table}' has unknown fields {', '.join(unknown)}; valid: sharding_type, "
            f"compute_kernel, ranks, shards, {', '.join(TORCHREC_SHARDING_FIELDS)}"
        )
    kept = ("enforce_hbm", "stochastic_rounding", "bounds_check_mode", "output_dtype")
    return {k: data[k] for k in kept if k in data}


def spec_shards(shards: Any) -> Sequence[Any]:
    """The shards of a ``shards`` argument: a list as is, TorchRec's ``EnumerableShardingSpec`` by its ``shards``."""
    if shards is None:
        return ()
    inner = getattr(shards, "shards", None)
    return inner if inner is not None else shards


def spec_rank(shard: Any) -> int:
    """The rank of torch's ``ShardMetadata`` (TorchRec's shards), read from its ``placement`` (``rank:1/cuda:1``)."""
    placement = getattr(shard, "placement", None)
    rank = placement.rank() if placement is not None and callable(getattr(placement, "rank", None)) else None
    if rank is None:
        raise ValueError(f"ParameterSharding: shard {shard!r} has no placement rank (expected 'rank:<r>/<device>')")
    return int(rank)


__all__ = [
    "BoundsCheckMode",
    "CacheParams",
    "KeyValueParams",
    "TORCHREC_SHARDING_FIELDS",
    "check_sharding_fields",
    "refuse_key_value",
    "sharding_fields_from_dict",
    "sharding_fields_to_dict",
    "spec_rank",
    "spec_shards",
    "with_constraint_fields",
]
