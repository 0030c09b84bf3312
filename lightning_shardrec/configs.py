"""Table and optimizer configs: frozen dataclasses, every default in one place.

Table configs keep TorchRec's field names *and positional order*, so TorchRec code
that builds them positionally means the same thing here.
"""

import enum
import math
import numbers
from dataclasses import dataclass, field
from typing import Callable, List, Optional, TypeVar

import torch

from lightning_shardrec.errors import UnsupportedFeatureError, unknown_name


class PoolingType(enum.Enum):
    """How a bag of rows becomes one vector."""

    SUM = "SUM"
    MEAN = "MEAN"
    NONE = "NONE"


class DataType(enum.Enum):
    """Storage type of a table's rows."""

    FP32 = "FP32"
    FP16 = "FP16"
    BF16 = "BF16"
    INT8 = "INT8"
    INT4 = "INT4"
    INT2 = "INT2"

    @property
    def bits(self) -> int:
        return {"FP32": 32, "FP16": 16, "BF16": 16, "INT8": 8, "INT4": 4, "INT2": 2}[self.value]


_M = TypeVar("_M", bound=enum.Enum)


def _parse_member(kind: type[_M], value: object, what: str) -> _M:
    """``value`` as a member of ``kind`` (a member, or its value/name in any case), else list the choices."""
    if isinstance(value, kind):
        return value
    if isinstance(value, str):
        for member in kind:
            if value.upper() in (str(member.value).upper(), member.name):
                return member
    raise ValueError(f"{what} must be one of {', '.join(str(m.value) for m in kind)}; got {value!r}")


def _finite_real(value: object) -> bool:
    """A real number (not a bool, not a string) that is neither nan nor inf."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class VirtualTableEvictionPolicy:
    """TorchRec's base of virtual-table eviction policies (its fields), for imports and annotations:
    virtual tables are not supported here, and a config given one is refused by name."""

    meta_header_len: int = 0
    embedding_dim: int = 0
    initialized: bool = False


@dataclass(frozen=True)
class BaseEmbeddingConfig:
    """One embedding table: ``num_embeddings`` rows of ``embedding_dim`` floats.

    Several features may share a table (``feature_names``; empty: ``[name]``, as TorchRec).
    Rows start uniform in ``[weight_init_min, weight_init_max]``, by default
    ``±sqrt(1 / num_embeddings)`` (``init_fn`` is then a :class:`UniformInit`, never None,
    as TorchRec); the collections draw them from a per-table seed, block by block
    (:mod:`lightning_shardrec.modules.table_init`). An ``init_fn`` of yours (called on the
    ``[rows, dim]`` weight, or on each shard of a table built on ``meta``) replaces that.
    ``need_pos`` is accepted (it marks position-weighted tables in TorchRec; every
    sharding type here takes weights).
    TorchRec's virtual-table fields (``input_dim``, ``total_num_buckets``,
    ``use_virtual_table``, ``virtual_table_eviction_policy``, ``enable_embedding_update``, ``stash_weights``)
    keep their positions; any value but the default raises :class:`UnsupportedFeatureError`.
    """

    num_embeddings: int
    embedding_dim: int
    name: str = ""
    data_type: DataType = DataType.FP32
    feature_names: List[str] = field(default_factory=list)
    weight_init_max: float | None = None
    weight_init_min: float | None = None
    num_embeddings_post_pruning: int | None = None
    init_fn: Optional[Callable[[torch.Tensor], Optional[torch.Tensor]]] = None
    need_pos: bool = False
    input_dim: int | None = None
    total_num_buckets: int | None = None
    use_virtual_table: bool = False
    virtual_table_eviction_policy: Optional[VirtualTableEvictionPolicy] = None
    enable_embedding_update: bool = False
    stash_weights: bool = False
    dynamic: Optional["DynamicConfig"] = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        kind = type(self).__name__
        label = f"{kind}(name={self.name!r})"
        if not self.name:
            raise ValueError(f"{kind} needs a table name (got name={self.name!r})")
        if not isinstance(self.name, str):
            raise ValueError(f"{kind}: name must be a str, got {self.name!r}")
        _refuse_virtual_table_fields(self, label)
        if isinstance(self.feature_names, list) and not self.feature_names:
            object.__setattr__(self, "feature_names", [self.name])  # TorchRec: a table reads its own name
        if self.init_fn is not None and not callable(self.init_fn):
            raise ValueError(f"{label}: init_fn must be callable on the weight tensor, got {self.init_fn!r}")
        if "." in self.name:  # any other name works, ``items`` and ``keys`` included (modules.table_dict)
            raise ValueError(
                f"{label}: a table name cannot contain '.' (it separates the parts of state-dict keys "
                f"such as 'embedding_bags.<table>.weight')"
            )
        object.__setattr__(self, "data_type", _parse_member(DataType, self.data_type, f"{label}: data_type"))
        for name in ("num_embeddings", "embedding_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
                raise ValueError(f"{label}: {name} must be a positive int, got {value!r}")
            object.__setattr__(self, name, int(value))  # numpy ints (e.g. from df.nunique()) become int
        if isinstance(self.feature_names, str) or not self.feature_names:
            raise ValueError(
                f"{label}: feature_names must be a non-empty list of feature names, got {self.feature_names!r}"
            )
        bad = [f for f in self.feature_names if not isinstance(f, str) or not f]
        if bad:
            raise ValueError(f"{label}: feature_names must be non-empty strings, got {bad} in {self.feature_names}")
        if len(set(self.feature_names)) != len(self.feature_names):
            raise ValueError(f"{label}: feature_names repeat a name: {self.feature_names}")
        for name in ("weight_init_min", "weight_init_max"):
            value = getattr(self, name)
            if value is not None and not _finite_real(value):
                raise ValueError(f"{label}: {name} must be a finite number or None, got {value!r}")
        pruned = self.num_embeddings_post_pruning
        if pruned is not None and (
            isinstance(pruned, bool)
            or not isinstance(pruned, numbers.Integral)
            or not 0 < pruned <= self.num_embeddings
        ):
            raise ValueError(
                f"{label}: num_embeddings_post_pruning must be an int in [1, {self.num_embeddings}] or None, "
                f"got {pruned!r}"
            )
        lo, hi = self.init_range()
        if lo > hi:
            raise ValueError(f"{label}: weight_init_min {lo} is above weight_init_max {hi}")
        if self.init_fn is None or isinstance(self.init_fn, UniformInit):  # TorchRec: init_fn is never None
            object.__setattr__(self, "init_fn", UniformInit(lo, hi))
        if self.dynamic is not None:
            if not isinstance(self.dynamic, DynamicConfig):
                raise ValueError(f"{label}: dynamic must be a DynamicConfig or None, got {self.dynamic!r}")
            self.dynamic.layout(self.num_embeddings, self.name)  # raises if the buckets do not fit

    @property
    def num_features(self) -> "_CallableInt":
        """Features reading this table: ``cfg.num_features`` here, ``cfg.num_features()`` in TorchRec."""
        return _CallableInt(len(self.feature_names))

    def get_weight_init_max(self) -> float:
        return self.init_range()[1]

    def get_weight_init_min(self) -> float:
        return self.init_range()[0]

    def init_range(self) -> tuple[float, float]:
        """``(low, high)`` of the uniform init; ``±sqrt(1/num_embeddings)`` by default (as TorchRec)."""
        bound = math.sqrt(1.0 / self.num_embeddings)
        lo = -bound if self.weight_init_min is None else self.weight_init_min
        hi = bound if self.weight_init_max is None else self.weight_init_max
        return lo, hi

    def init_weight(self, weight: torch.Tensor) -> None:
        """Fill ``weight`` (the whole table, or a shard of it) with this table's init."""
        with torch.no_grad():
            self.init_fn(weight)  # type: ignore[misc]  # set in __post_init__


@dataclass(frozen=True)
class UniformInit:
    """The default ``init_fn``: uniform in ``[low, high]`` (compares by value, unlike a partial)."""

    low: float
    high: float

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.uniform_(weight, self.low, self.high)


class _CallableInt(int):
    """An int that returns itself when called (a property TorchRec spells as a method)."""

    def __call__(self) -> int:
        return int(self)


#: TorchRec fields this library does not implement: (name, default, why / what to use instead)
_VIRTUAL_TABLE_FIELDS: tuple[tuple[str, object, str], ...] = (
    ("input_dim", None, "feature-processor input widths are not supported"),
    ("total_num_buckets", None, "bucketized (ZCH / virtual) tables are not supported; size num_embeddings"),
    ("use_virtual_table", False, "virtual (SSD / key-value) tables are not supported; size num_embeddings"),
    ("virtual_table_eviction_policy", None, "virtual tables (and their eviction) are not supported"),
    ("enable_embedding_update", False, "write-back embedding updates are not supported"),
    ("stash_weights", False, "stashing table weights is not supported"),
)


def _refuse_virtual_table_fields(config: BaseEmbeddingConfig, label: str) -> None:
    for name, default, why in _VIRTUAL_TABLE_FIELDS:
        value = getattr(config, name)
        if value is not default and value != default:
            raise UnsupportedFeatureError(
                f"{label}: {name}={value!r} is not supported ({why}); leave it at {default!r}. See docs/migrating.md"
            )


@dataclass(frozen=True)
class EmbeddingBagConfig(BaseEmbeddingConfig):
    """A pooled table: each bag of ids becomes one ``[embedding_dim]`` vector."""

    pooling: PoolingType = PoolingType.SUM

    def __post_init__(self) -> None:
        super().__post_init__()
        pooling = _parse_member(PoolingType, self.pooling, f"EmbeddingBagConfig(name={self.name!r}): pooling")
        object.__setattr__(self, "pooling", pooling)
        if self.pooling is PoolingType.NONE:
            raise ValueError(
                f"EmbeddingBagConfig(name={self.name!r}): pooling NONE is not a pooled table; "
                "use EmbeddingConfig with EmbeddingCollection for sequence (unpooled) lookups"
            )


@dataclass(frozen=True)
class EmbeddingConfig(BaseEmbeddingConfig):
    """A sequence table: each id keeps its own ``[embedding_dim]`` row (no pooling)."""


class EmbOptimType(str, enum.Enum):
    """Fused (in-backward) embedding optimizers; every one runs on every device."""

    SGD = "sgd"
    ADAGRAD = "adagrad"
    ROWWISE_ADAGRAD = "rowwise_adagrad"
    ADAM = "adam"
    ADAMW = "adamw"
    # fbgemm's / TorchRec's names for the same rules (aliases: ``EXACT_SGD is SGD``)
    EXACT_SGD = "sgd"
    EXACT_ADAGRAD = "adagrad"
    EXACT_ROWWISE_ADAGRAD = "rowwise_adagrad"

    @classmethod
    def parse(cls, value: object) -> "EmbOptimType":
        """A member from itself, its value or name in any case, or fbgemm's ``EmbOptimType`` (or its value)."""
        if isinstance(value, EmbOptimType):
            return value
        raw = getattr(value, "value", value)  # fbgemm_gpu's EmbOptimType member
        key = str(raw).lower()
        if key in _FBGEMM_OPTIM_NAMES:
            return cls(_FBGEMM_OPTIM_NAMES[key])
        try:
            return cls(key)
        except ValueError:
            raise unknown_name("embedding optimizer", value, [m.value for m in cls]) from None

    def state_per_row(self, dim: int) -> int:
        """Optimizer state elements per row of a ``dim``-wide table (for memory planning)."""
        return {
            EmbOptimType.SGD: 0,
            EmbOptimType.ADAGRAD: dim,
            EmbOptimType.ROWWISE_ADAGRAD: 1,
            EmbOptimType.ADAM: 2 * dim,
            EmbOptimType.ADAMW: 2 * dim,
        }[self]


#: fbgemm_gpu ``EmbOptimType`` values (and names) -> ours: the exact rules fbgemm names that we implement
_FBGEMM_OPTIM_NAMES = {
    "exact_sgd": "sgd",
    "exact_adagrad": "adagrad",
    "exact_row_wise_adagrad": "rowwise_adagrad",
    "exact_rowwise_adagrad": "rowwise_adagrad",
    "row_wise_adagrad": "rowwise_adagrad",
}


@dataclass(frozen=True, kw_only=True)
class FusedOptimConfig:
    """Hyper-parameters of the fused embedding optimizer (one place for defaults).

    ``weight_decay`` is L2 (added to the gradient) for sgd/adagrad/adam, decoupled
    for adamw; it applies to the rows a batch touches (row-sparse, "lazy").
    """

    optimizer: EmbOptimType = EmbOptimType.ADAGRAD
    lr: float = 0.01
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "optimizer", EmbOptimType.parse(self.optimizer))
        for name in ("lr", "eps", "beta1", "beta2", "weight_decay"):
            if not _finite_real(getattr(self, name)):
                raise ValueError(f"FusedOptimConfig: {name} must be a finite number, got {getattr(self, name)!r}")
        for name in ("lr", "eps", "weight_decay"):
            if getattr(self, name) < 0:
                raise ValueError(f"FusedOptimConfig: {name} must be >= 0, got {getattr(self, name)}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"FusedOptimConfig: {name} must be in [0, 1), got {getattr(self, name)}")


class EvictionPolicy(str, enum.Enum):
    """Which resident id of a full bucket gives its slot to a new id."""

    LRU = "lru"  # least recently seen (ties: lowest slot)
    LFU = "lfu"  # fewest sightings (ties: least recently seen, then lowest slot)


MAX_SLOTS_PER_BUCKET = 1024


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class DynamicConfig:
    """A dynamic table: raw int64 ids (any value) map to ``num_embeddings`` slots.

    The table is ``num_buckets`` buckets of ``num_embeddings / num_buckets`` slots;
    an id's bucket is a fixed 64-bit hash of the id, and each bucket admits and
    evicts on its own, so results do not depend on how buckets are split over ranks.

    * ``eviction``: ``"lru"`` or ``"lfu"``, used when a new id finds its bucket full.
    * ``ttl_steps``: ``k``: a row (or candidate) last seen at training step ``s`` is freed
      at the start of step ``s + k + 1``; its id then comes back as a new one, with a fresh
      row (``None``: never).
    * ``min_count``: an id gets a row only once it has been seen this many times
      (counted in a bounded per-bucket candidate table); until then it reads zeros
      and gets no gradient.
    * ``num_buckets``: ``None`` picks ``num_embeddings / s`` buckets of ``s`` slots,
      ``s`` the largest divisor of ``num_embeddings`` up to 16.
    * ``candidates_per_bucket``: size of each bucket's candidate table (``None``: as
      many as the bucket has slots); only used when ``min_count > 1``.
    * ``seed``: mixed with the table name, slot and slot generation to draw each new
      row's init (the table's ``weight_init_min/max`` or ``init_fn``).
    """

    eviction: EvictionPolicy = EvictionPolicy.LRU
    ttl_steps: int | None = None
    min_count: int = 1
    num_buckets: int | None = None
    candidates_per_bucket: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "eviction", _parse_member(EvictionPolicy, self.eviction, "DynamicConfig: eviction"))
        ttl = self.ttl_steps
        if ttl is not None and (not _is_int(ttl) or ttl < 1):
            raise ValueError(f"DynamicConfig: ttl_steps must be an int >= 1 or None, got {ttl!r}")
        if not _is_int(self.min_count) or self.min_count < 1:
            raise ValueError(f"DynamicConfig: min_count must be an int >= 1, got {self.min_count!r}")
        for name in ("num_buckets", "candidates_per_bucket"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"DynamicConfig: {name} must be an int >= 1 or None, got {value!r}")
        cands = self.candidates_per_bucket
        if cands is not None and cands > MAX_SLOTS_PER_BUCKET:
            raise ValueError(
                f"DynamicConfig: candidates_per_bucket must be in [1, {MAX_SLOTS_PER_BUCKET}], got {cands}"
            )
        if not _is_int(self.seed) or not 0 <= self.seed < 2**31:
            raise ValueError(f"DynamicConfig: seed must be an int in [0, 2**31), got {self.seed!r}")

    def layout(self, num_embeddings: int, table: str) -> tuple[int, int]:
        """``(num_buckets, slots_per_bucket)`` of table ``table`` with ``num_embeddings`` rows."""
        buckets = self.num_buckets
        if buckets is None:
            slots = max(d for d in range(1, 17) if num_embeddings % d == 0)
            return num_embeddings // slots, slots
        if buckets > num_embeddings or num_embeddings % buckets:
            raise ValueError(
                f"dynamic table '{table}': num_buckets {buckets} must divide num_embeddings {num_embeddings} "
                f"(a divisor in [1, {num_embeddings}])"
            )
        slots = num_embeddings // buckets
        if slots > MAX_SLOTS_PER_BUCKET:
            raise ValueError(
                f"dynamic table '{table}': {num_embeddings} rows in {buckets} buckets is {slots} slots per bucket; "
                f"at most {MAX_SLOTS_PER_BUCKET} are allowed (use num_buckets >= "
                f"{-(-num_embeddings // MAX_SLOTS_PER_BUCKET)})"
            )
        return buckets, slots

    def candidate_slots(self, slots_per_bucket: int) -> int:
        """Candidate-table entries per bucket (0 when every id is admitted at once)."""
        if self.min_count == 1:
            return 0
        return slots_per_bucket if self.candidates_per_bucket is None else self.candidates_per_bucket
