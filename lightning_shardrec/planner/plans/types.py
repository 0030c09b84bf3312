"""Plan vocabulary: sharding types, kernels, shard metadata, per-table shardings, constraints.

A table of ``rows x dim`` is cut into shards; each shard is a rectangle
``[row_offset : row_offset + rows, col_offset : col_offset + cols]`` on one rank::

    table_wise      column_wise (2)      row_wise (3)                        grid_shard (2 x 2)
    +--------+      +----+----+          +--------+ rank 0  rows [0, 4)       +----+----+
    | rank 0 |      | r0 | r5 |          +--------+ rank 1  rows [4, 7)       | r0 | r2 |
    |        |      |    |    |          +--------+ rank 2  rows [7, 10)      +----+----+
    +--------+      +----+----+                                               | r1 | r3 |
                                                                              +----+----+

table_row_wise is row_wise with every block on one host; grid_shard cuts the columns
first and each column piece table-row-wise (its row blocks on one host; shards listed
piece by piece, each piece's blocks in row order).

``ShardMetadata``, ``ParameterSharding`` and ``ShardingPlan`` keep TorchRec's field
names and positional order (they are the contract the sharded modules consume).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from lightning_shardrec.errors import UnsupportedFeatureError, unknown_name
from lightning_shardrec.planner.plans.table_params import (
    BoundsCheckMode,
    CacheParams,
    KeyValueParams,
    check_sharding_fields,
    refuse_key_value,
    sharding_fields_from_dict,
    sharding_fields_to_dict,
    spec_rank,
    spec_shards,
)

_E = TypeVar("_E", bound=enum.Enum)


class TorchRecString(str, enum.Enum):
    """An enum whose members stand for TorchRec's plain strings: ``==``, ``hash``, ``str``,
    ``format``, ``repr`` and JSON all act as the string value (TorchRec's plans hold ``"column_wise"``)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    def __repr__(self) -> str:
        return repr(str(self.value))


class ShardingType(TorchRecString):
    """How a table is cut across ranks (TorchRec's values)."""

    TABLE_WISE = "table_wise"
    ROW_WISE = "row_wise"
    COLUMN_WISE = "column_wise"
    TABLE_ROW_WISE = "table_row_wise"
    GRID_SHARD = "grid_shard"
    DATA_PARALLEL = "data_parallel"


class EmbeddingComputeKernel(TorchRecString):
    """How a shard is trained.

    ``FUSED``: the fused optimizer updates rows inside backward. ``DENSE``: a plain
    parameter (data_parallel), gradient all-reduced, trained by the user's optimizer.
    """

    FUSED = "fused"
    DENSE = "dense"


def parse_enum(kind: type[_E], value: _E | str, what: str) -> _E:
    """``value`` as a member of ``kind`` (members or their string values), else list the choices."""
    if isinstance(value, kind):
        return value
    try:
        return kind(str(value).lower())
    except ValueError:
        raise unknown_name(what, value, [m.value for m in kind]) from None


@dataclass(frozen=True)
class ShardMetadata:
    """One shard: ``shard_sizes`` ``(rows, cols)`` at ``shard_offsets`` ``(row, col)`` on ``rank``."""

    shard_offsets: Sequence[int]  # (row, col), stored as a tuple
    shard_sizes: Sequence[int]  # (rows, cols), stored as a tuple
    rank: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "shard_offsets", tuple(int(x) for x in self.shard_offsets))
        object.__setattr__(self, "shard_sizes", tuple(int(x) for x in self.shard_sizes))
        object.__setattr__(self, "rank", int(self.rank))
        if len(self.shard_offsets) != 2 or len(self.shard_sizes) != 2:
            raise ValueError(
                "ShardMetadata: shard_offsets and shard_sizes are (row, col) pairs, got "
                f"{self.shard_offsets} and {self.shard_sizes}"
            )

    @property
    def numel(self) -> int:
        return self.shard_sizes[0] * self.shard_sizes[1]

    def to_dict(self) -> dict[str, object]:
        return {
            "shard_offsets": list(self.shard_offsets),
            "shard_sizes": list(self.shard_sizes),
            "rank": self.rank,
        }


@dataclass(frozen=True, init=False)
class ParameterSharding:
    """How one table is sharded: its type, kernel, the ranks (in shard order) and the shards.

    The constructor takes TorchRec's arguments in TorchRec's order: the fourth (``shards``, or
    ``sharding_spec=`` by keyword) is a list of :class:`ShardMetadata` or TorchRec's
    ``EnumerableShardingSpec`` (each shard's rank read from its placement); ``ranks`` defaults to the
    shards' ranks. TorchRec's per-table kernel settings after it are kept (printed, compared, written to
    plan JSON but ``cache_params``); what each means here is :data:`TORCHREC_SHARDING_FIELDS`.
    """

    sharding_type: ShardingType
    compute_kernel: EmbeddingComputeKernel
    ranks: Sequence[int]  # stored as a tuple
    shards: Sequence[ShardMetadata]  # stored as a tuple
    cache_params: CacheParams | None = None
    enforce_hbm: bool | None = None
    stochastic_rounding: bool | None = None
    bounds_check_mode: BoundsCheckMode | None = None
    output_dtype: Any = None  # None or DataType.FP32
    key_value_params: KeyValueParams | None = None

    def __init__(
        self,
        sharding_type: ShardingType | str,
        compute_kernel: EmbeddingComputeKernel | str,
        ranks: Sequence[int] | None = None,
        shards: Sequence[ShardMetadata | dict[str, Any]] | Any = None,
        cache_params: CacheParams | None = None,
        enforce_hbm: bool | None = None,
        stochastic_rounding: bool | None = None,
        bounds_check_mode: BoundsCheckMode | int | str | None = None,
        output_dtype: Any = None,
        key_value_params: KeyValueParams | None = None,
        *,
        sharding_spec: Any = None,
    ) -> None:
        if sharding_spec is not None and shards is not None:
            raise ValueError("ParameterSharding: give the shards once, as shards or as sharding_spec, not both")
        extras = check_sharding_fields(
            cache_params, enforce_hbm, stochastic_rounding, bounds_check_mode, output_dtype, key_value_params
        )
        parts = tuple(
            s if isinstance(s, ShardMetadata) else ShardMetadata(**s) if isinstance(s, dict) else ShardMetadata(
                s.shard_offsets, s.shard_sizes, spec_rank(s)
            )
            for s in spec_shards(shards if sharding_spec is None else sharding_spec)
        )
        values = {
            "sharding_type": parse_enum(ShardingType, sharding_type, "sharding type"),
            "compute_kernel": parse_enum(EmbeddingComputeKernel, compute_kernel, "compute kernel"),
            "ranks": tuple(int(r) for r in (ranks if ranks is not None else [s.rank for s in parts])),
            "shards": parts,
            **extras,
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        return torchrec_repr(self)

    def to_dict(self) -> dict[str, object]:
        return {
            "sharding_type": self.sharding_type.value,
            "compute_kernel": self.compute_kernel.value,
            "ranks": list(self.ranks),
            "shards": [s.to_dict() for s in self.shards],
            **sharding_fields_to_dict(self),
        }

    @classmethod
    def from_dict(cls, data: dict[str, object], table: str = "?") -> ParameterSharding:
        """From :meth:`to_dict`'s JSON form; ``table`` names the entry in errors."""
        fields = ("sharding_type", "compute_kernel", "ranks", "shards")
        missing = [f for f in fields if not isinstance(data, dict) or f not in data]
        if missing:
            raise ValueError(f"plan entry for table '{table}' lacks {', '.join(missing)}; it needs {', '.join(fields)}")
        try:
            shards = [ShardMetadata(**s) for s in data["shards"]]  # type: ignore[attr-defined,union-attr]
        except TypeError as e:
            raise ValueError(f"plan entry for table '{table}': bad shards {data['shards']!r} ({e})") from None
        return cls(
            sharding_type=data["sharding_type"],  # type: ignore[arg-type]
            compute_kernel=data["compute_kernel"],  # type: ignore[arg-type]
            ranks=data["ranks"],  # type: ignore[arg-type]
            shards=shards,
            **sharding_fields_from_dict(data, table),
        )

    # --- h43b: TorchRec's ParameterSharding.sharding_spec (issue 43, item 6) ---
    @property
    def sharding_spec(self) -> object | None:
        """TorchRec's field: None for ``data_parallel``, else torch's ``EnumerableShardingSpec`` of the shards,
        placed ``"rank:<r>/cuda:<r mod GPUs>"`` when CUDA is available, else ``"rank:<r>/cpu"``."""
        if self.sharding_type is ShardingType.DATA_PARALLEL:
            return None
        import torch  # here: the planner's types import no torch

        from lightning_shardrec._compat import torch as compat

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return compat.enumerable_sharding_spec(
            [
                (
                    list(s.shard_offsets),
                    list(s.shard_sizes),
                    f"rank:{s.rank}/cuda:{s.rank % gpus}" if gpus else f"rank:{s.rank}/cpu",
                )
                for s in self.shards
            ]
        )

@dataclass(frozen=True, kw_only=True)
class ParameterConstraints:
    """What the planner may do with one table (TorchRec's field names).

    ``sharding_types`` / ``compute_kernels``: allowed choices (members or string values),
    ``None`` = all. ``pooling_factors``: mean ids per bag, one per feature.
    ``num_poolings``: bags per sample per feature (default 1 each). ``min_partition``:
    the narrowest column shard (default 32, never wider than the table). ``ranks``: pin
    the table's shards to these ranks.
    """

    sharding_types: list[ShardingType] | None = None
    compute_kernels: list[EmbeddingComputeKernel] | None = None
    pooling_factors: list[float] = field(default_factory=lambda: [1.0])
    num_poolings: list[float] | None = None
    min_partition: int | None = None
    ranks: list[int] | None = None
    # TorchRec's other fields (issue 43): accepted; what each means here is in TORCHREC_CONSTRAINT_FIELDS
    batch_sizes: list[int] | None = None
    is_weighted: bool = False
    cache_params: CacheParams | None = None
    enforce_hbm: bool | None = None
    stochastic_rounding: bool | None = None
    bounds_check_mode: Any = None
    feature_names: list[str] | None = None
    output_dtype: Any = None
    device_group: str | None = None
    key_value_params: KeyValueParams | None = None
    use_virtual_table: bool = False

    def __post_init__(self) -> None:
        refuse_key_value(self.key_value_params, self.use_virtual_table, "ParameterConstraints")
        if self.output_dtype is not None and getattr(self.output_dtype, "name", self.output_dtype) != "FP32":
            raise UnsupportedFeatureError(
                f"ParameterConstraints: output_dtype={self.output_dtype!r} is not supported; the collections' "
                "outputs are fp32 here (None or DataType.FP32)"
            )
        if self.sharding_types is not None:
            types = [parse_enum(ShardingType, t, "sharding type") for t in self.sharding_types]
            if not types:
                raise ValueError(
                    "ParameterConstraints: sharding_types is empty; use None to allow all"
                )
            object.__setattr__(self, "sharding_types", types)
        if self.compute_kernels is not None:
            kernels = [
                parse_enum(EmbeddingComputeKernel, k, "compute kernel")
                for k in self.compute_kernels
            ]
            if not kernels:
                raise ValueError(
                    "ParameterConstraints: compute_kernels is empty; use None to allow all"
                )
            object.__setattr__(self, "compute_kernels", kernels)
        try:
            factors = [float(p) for p in self.pooling_factors]
        except (TypeError, ValueError):
            factors = []
        if not factors or not all(math.isfinite(p) and p > 0 for p in factors):
            raise ValueError(
                f"ParameterConstraints: pooling_factors must be a non-empty list of positive numbers, "
                f"got {self.pooling_factors!r}"
            )
        object.__setattr__(self, "pooling_factors", factors)
        if self.num_poolings is not None:
            if len(self.num_poolings) != len(factors) or any(n <= 0 for n in self.num_poolings):
                raise ValueError(
                    "ParameterConstraints: num_poolings needs one positive number per pooling factor "
                    f"({len(factors)}), got {self.num_poolings!r}"
                )
            object.__setattr__(self, "num_poolings", [float(n) for n in self.num_poolings])
        if self.min_partition is not None and (
            not isinstance(self.min_partition, int) or self.min_partition <= 0
        ):
            raise ValueError(
                f"ParameterConstraints: min_partition must be a positive int, got {self.min_partition!r}"
            )
        if self.ranks is not None:
            ranks = sorted(set(self.ranks))
            if not ranks or any(not isinstance(r, int) or r < 0 for r in ranks):
                raise ValueError(
                    f"ParameterConstraints: ranks must be a non-empty list of ints >= 0, got {self.ranks!r}"
                )
            object.__setattr__(self, "ranks", ranks)


#: TorchRec's ParameterConstraints fields with no counterpart in the planner here, and why each is safe to accept
TORCHREC_CONSTRAINT_FIELDS = {
    "batch_sizes": "the planner costs one batch size per plan (EmbeddingShardingPlanner(batch_size=...))",
    "is_weighted": "weighted features are read from the collection itself",
    "cache_params": "no UVM caches: every table lives whole in device memory",
    "enforce_hbm": "tables always live in the compute device's memory",
    "stochastic_rounding": "tables are fp32, so updates need no stochastic rounding",
    "bounds_check_mode": "ids are always checked, raising on an out-of-range id",
    "feature_names": "pooling factors apply to the table's features in order",
    "device_group": "one compute device per plan (Topology(compute_device=...))",
}


# --- TorchRec's printed form of a plan entry (issue 43) ---------------------------------------
#: the fields TorchRec's ParameterSharding prints after the shards (a plan made here leaves them None unless
#: a ParameterConstraints of the table sets them, as TorchRec's planner copies them)
TORCHREC_UNSET_FIELDS = (
    "cache_params",
    "enforce_hbm",
    "stochastic_rounding",
    "bounds_check_mode",
    "output_dtype",
    "key_value_params",
)


def placement(compute_device: str, rank: int, local_world_size: int) -> str:
    """TorchRec's shard placement text: ``rank:1/cuda:1`` on GPUs (the rank's local device), ``rank:1/cpu``."""
    device = str(compute_device)
    if device in ("cuda", "mtia"):
        device = f"{device}:{rank % max(local_world_size, 1)}"
    return f"rank:{rank}/{device}"


def torchrec_repr(ps: ParameterSharding, compute_device: str = "cpu", local_world_size: int = 1) -> str:
    """``repr`` of ``ps`` as TorchRec prints the same entry (its ``EnumerableShardingSpec`` of shards;
    none for ``data_parallel``)."""
    if ps.sharding_type is ShardingType.DATA_PARALLEL:
        spec = "None"
    else:
        shards = ", ".join(
            f"ShardMetadata(shard_offsets={list(s.shard_offsets)}, shard_sizes={list(s.shard_sizes)}, "
            f"placement={placement(compute_device, s.rank, local_world_size)})"
            for s in ps.shards
        )
        spec = f"EnumerableShardingSpec(shards=[{shards}])"
    unset = ", ".join(f"{name}={getattr(ps, name)!r}" for name in TORCHREC_UNSET_FIELDS)
    return (
        f"ParameterSharding(sharding_type={ps.sharding_type!r}, compute_kernel={ps.compute_kernel!r}, "
        f"ranks={list(ps.ranks)}, sharding_spec={spec}, {unset})"
    )
