"""What the planner plans: one ``TableSpec`` per table, found in a module or given as a dict."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import nn

from lightning_shardrec.configs import BaseEmbeddingConfig, EmbeddingConfig
from lightning_shardrec.errors import PlannerError
from lightning_shardrec.planner.plans.types import EmbeddingComputeKernel, ParameterConstraints, ShardingType

DEFAULT_MIN_PARTITION = 32  # columns: the narrowest piece a column cut makes unless the world needs narrower
NARROW_MIN_PARTITION = 8  # from NARROW_FROM_RANKS ranks on
NARROW_FROM_RANKS = 32
COLUMN_ALIGN = 4  # column shards are multiples of 4 wide (fbgemm's row alignment)
#: bytes per element of a table's rows as the training kernels allocate them: both the torch
#: kernel and fbgemm's TBE keep fp32 rows whatever ``data_type`` says (``data_type`` does not
#: change training storage); tests/planner/test_memory.py checks this against both kernels.
TRAIN_WEIGHT_BYTES = 4

ID_MAP_BYTES = 8  # a dynamic table's id map: int64 buffers
WINDOW_BYTES_PER_SLOT = 4  # its window's id bitmap (bool): the mapper's WINDOW_BITS_PER_SLOT
TablesInput = nn.Module | Mapping[str, Sequence[BaseEmbeddingConfig]]


@dataclass(frozen=True, kw_only=True)
class TableSpec:
    """One table with its constraints resolved (every default filled in)."""

    path: str
    name: str
    rows: int
    dim: int
    elem_bytes: float
    sequence: bool
    ids_per_sample: float
    bags_per_sample: float
    sharding_types: tuple[ShardingType, ...]
    compute_kernels: tuple[EmbeddingComputeKernel, ...]
    min_partition: int
    ranks: tuple[int, ...] | None
    #: dynamic tables: buckets and slots per bucket (row blocks are whole buckets); 0 for static tables
    num_buckets: int = 0
    slots_per_bucket: int = 0
    #: dynamic tables: admission candidates per bucket (0: ids are admitted at first sight)
    cands_per_bucket: int = 0

    @property
    def id_map_row_bytes(self) -> float:
        """A dynamic table's id-map bytes per row: 4 int64 per slot (id, last step, count,
        generation), 3 per candidate (id, last step, count) and 5 counters per bucket, plus the window's
        id bitmap (``WINDOW_BYTES_PER_SLOT``); 0 if static."""
        if not self.num_buckets:
            return 0.0
        return ID_MAP_BYTES * (4 + (3 * self.cands_per_bucket + 5) / self.slots_per_bucket) + WINDOW_BYTES_PER_SLOT

    @property
    def key(self) -> tuple[str, str]:
        return (self.path, self.name)

    @property
    def label(self) -> str:
        return f"'{self.name}'" if not self.path else f"'{self.name}' (module '{self.path}')"


def find_tables(tables: TablesInput) -> dict[str, list[BaseEmbeddingConfig]]:
    """Module path -> table configs; a module is searched for collections by duck typing.

    A submodule counts as a collection when it has ``embedding_bag_configs()`` (pooled)
    or ``embedding_configs()`` (sequence); the root module itself has path ``""``.
    """
    if isinstance(tables, nn.Module):
        found: dict[str, list[BaseEmbeddingConfig]] = {}
        for path, module in tables.named_modules():
            if any(path.startswith(f"{p}.") or (p == "" and path) for p in found):
                continue  # inside a collection already found
            for method in ("embedding_bag_configs", "embedding_configs"):
                getter = getattr(module, method, None)
                if callable(getter):
                    found[path] = list(getter())
                    break
        if not found:
            raise PlannerError(
                f"{type(tables).__name__} has no embedding collection: no submodule has "
                "embedding_bag_configs() or embedding_configs()"
            )
        return found
    if not isinstance(tables, Mapping):
        raise TypeError(
            f"plan() takes an nn.Module or a dict of module path -> list of table configs, got {type(tables).__name__}"
        )
    out: dict[str, list[BaseEmbeddingConfig]] = {}
    for path, configs in tables.items():
        bad = [c for c in configs if not isinstance(c, BaseEmbeddingConfig)]
        if bad:
            raise TypeError(
                f"module '{path}': tables must be EmbeddingBagConfig / EmbeddingConfig, got {type(bad[0]).__name__}"
            )
        out[str(path)] = list(configs)
    return out


def default_min_partition(world_size: int) -> int:
    """The narrowest column piece where a table's constraints name none: 32 columns below
    :data:`NARROW_FROM_RANKS` ranks, 8 from there (at 64-128 ranks 32-column pieces are too few to
    level every rank without row-blocking, which pays an in-host exchange per extra holder)."""
    return NARROW_MIN_PARTITION if world_size >= NARROW_FROM_RANKS else DEFAULT_MIN_PARTITION


def table_specs(
    tables: Mapping[str, list[BaseEmbeddingConfig]],
    constraints: Mapping[str, ParameterConstraints],
    world_size: int,
) -> list[TableSpec]:
    """Resolve every table's constraints; raise once listing every bad table."""
    problems: list[str] = []
    specs: list[TableSpec] = []
    all_names = {c.name for configs in tables.values() for c in configs}
    unknown = sorted(set(constraints) - all_names)
    if unknown:
        problems.append(f"constraints name unknown tables {unknown}; available: {', '.join(sorted(all_names))}")
    min_partition = default_min_partition(world_size)
    for path in sorted(tables):
        seen: set[str] = set()
        for config in tables[path]:
            label = f"'{config.name}'" if not path else f"'{config.name}' (module '{path}')"
            if config.name in seen:
                problems.append(f"table {label} appears twice in the same module")
                continue
            seen.add(config.name)
            pc = constraints.get(config.name, ParameterConstraints())
            factors = pc.pooling_factors
            n_feat = config.num_features
            if len(factors) == 1:
                factors = factors * n_feat
            if len(factors) != n_feat:
                problems.append(
                    f"table {label}: pooling_factors has {len(pc.pooling_factors)} values but the "
                    f"table has {n_feat} features {config.feature_names}"
                )
                continue
            counts = pc.num_poolings or [1.0] * len(pc.pooling_factors)
            if len(counts) == 1:
                counts = counts * n_feat
            if pc.ranks is not None and pc.ranks[-1] >= world_size:
                problems.append(f"table {label}: pinned ranks {pc.ranks} are outside [0, {world_size})")
                continue
            types = tuple(pc.sharding_types or list(ShardingType))
            buckets = slots = 0
            if config.dynamic is not None:
                buckets, slots = config.dynamic.layout(config.num_embeddings, config.name)
                problem = _dynamic_problem(label, pc, buckets)
                if problem:
                    problems.append(problem)
                    continue
                types = tuple(pc.sharding_types or DYNAMIC_TYPES)
                if pc.ranks is not None and len(pc.ranks) > buckets:  # row_wise would need a block per rank
                    types = tuple(t for t in types if t is not ShardingType.ROW_WISE)
            kernels = tuple(pc.compute_kernels or list(EmbeddingComputeKernel))
            specs.append(
                TableSpec(
                    path=path,
                    name=config.name,
                    rows=config.num_embeddings,
                    dim=config.embedding_dim,
                    elem_bytes=TRAIN_WEIGHT_BYTES,
                    sequence=isinstance(config, EmbeddingConfig),
                    ids_per_sample=sum(p * n for p, n in zip(factors, counts, strict=True)),
                    bags_per_sample=float(sum(counts)),
                    sharding_types=types,
                    compute_kernels=kernels,
                    min_partition=min(pc.min_partition or min_partition, config.embedding_dim),
                    ranks=tuple(pc.ranks) if pc.ranks is not None else None,
                    num_buckets=buckets,
                    slots_per_bucket=slots,
                    cands_per_bucket=config.dynamic.candidate_slots(slots) if config.dynamic is not None else 0,
                )
            )
    if problems:
        raise PlannerError("invalid tables or constraints:\n  " + "\n  ".join(problems))
    return specs


#: the sharding types that can hold a dynamic table (row blocks of whole buckets, or all of it)
DYNAMIC_TYPES = (ShardingType.TABLE_WISE, ShardingType.ROW_WISE)


def _dynamic_problem(label: str, pc: ParameterConstraints, buckets: int) -> str | None:
    """Why ``pc`` cannot hold a dynamic table of ``buckets`` buckets, or None."""
    valid = ", ".join(t.value for t in DYNAMIC_TYPES)
    asked = pc.sharding_types or []
    bad = [t.value for t in asked if t not in DYNAMIC_TYPES]
    if bad:
        return f"dynamic table {label}: sharding_types {bad} cannot hold a dynamic table; valid: {valid}"
    if asked == [ShardingType.ROW_WISE] and pc.ranks is not None and len(pc.ranks) > buckets:
        return (
            f"dynamic table {label}: row_wise over ranks {list(pc.ranks)} needs a block of whole buckets on "
            f"each of {len(pc.ranks)} ranks, but the table has {buckets} buckets; pin at most {buckets} ranks "
            "or allow table_wise"
        )
    return None


def in_backward_constraints(
    module: object, constraints: dict[str, ParameterConstraints]
) -> dict[str, ParameterConstraints]:
    """``constraints`` with the fused kernel required for tables whose weights carry an in-backward optimizer
    (``apply_optimizer_in_backward``): as plain ``data_parallel`` weights it would never run. A table the user
    constrained keeps its constraint (a conflicting one is refused when sharding)."""
    if not isinstance(module, nn.Module):
        return constraints
    out = dict(constraints)
    for coll in module.modules():
        getter = getattr(coll, "embedding_bag_configs", None) or getattr(coll, "embedding_configs", None)
        if not callable(getter) or not any(getattr(p, "_optimizer_classes", None) for p in coll.parameters()):
            continue
        for cfg in getter():
            if cfg.name not in out:
                out[cfg.name] = ParameterConstraints(compute_kernels=[EmbeddingComputeKernel.FUSED])
    return out
