"""Plain ``nn.EmbeddingBag`` / ``nn.Embedding`` modules as one-table collections.

An existing recommender holds its tables as plain torch modules. :func:`swap_embedding_modules`
replaces each (in place, same attribute) by an adapter that *is* a one-table
:class:`EmbeddingBagCollection` / :class:`EmbeddingCollection`, so the planner and the
sharders treat it like any collection, while it keeps the torch module's call and result::

    bag(input, offsets=None, per_sample_weights=None) -> [B, D]   # modes sum / mean / max
    emb(input) -> [*input.shape, D]                                # any input shape

The adapter holds the user's own ``weight`` Parameter (the optimizer built from
``configure_optimizers`` still finds it), and the sharded adapter saves it under the
module's own key (``user_emb.weight``), so checkpoints load into the plain model.

How each call becomes one feature of a KJT (``feature`` = the module path):

* ``EmbeddingBag`` sum/mean: bags as given (2-D input: ``B`` bags of ``L`` ids); ids equal
  to ``padding_idx`` are dropped from their bag, as torch excludes them (mean divides by the
  remaining count). Pooled by an EmbeddingBagCollection.
* ``EmbeddingBag`` max: one row per id from an EmbeddingCollection, max-reduced per bag
  (``scatter_reduce``, empty bags 0, as torch).
* ``Embedding``: one id per bag; rows at ``padding_idx`` pass forward and get no gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_shardrec.configs import DataType, EmbeddingBagConfig, EmbeddingConfig, PoolingType
from lightning_shardrec.modules.embedding_bag_collection import EmbeddingBagCollection
from lightning_shardrec.modules.embedding_collection import EmbeddingCollection
from lightning_shardrec.sparse import KeyedJaggedTensor

_DTYPES = {torch.float32: DataType.FP32, torch.float16: DataType.FP16, torch.bfloat16: DataType.BF16}


@dataclass(frozen=True)
class PlainSpec:
    """What the replaced torch module did: enough to convert its calls to and from a KJT."""

    path: str  #: module path in the user's model (names it in errors; the KJT feature key)
    kind: str  #: "EmbeddingBag" or "Embedding"
    mode: str  #: "sum", "mean", "max" for bags; "lookup" for Embedding
    padding_idx: int | None = None
    include_last_offset: bool = False

    @property
    def where(self) -> str:
        return f"{self.kind} '{self.path}'"


def table_name(path: str) -> str:
    """A table name for the module at ``path`` (``tower.user_emb`` -> ``tower_user_emb``)."""
    return path.replace(".", "_")


def _check_ids(spec: PlainSpec, input: Tensor) -> None:
    if not isinstance(input, Tensor):
        raise TypeError(f"{spec.where}: input must be a tensor of ids, got {type(input).__name__}")
    if input.is_floating_point() or input.is_complex() or input.dtype == torch.bool:
        raise TypeError(f"{spec.where}: input must hold integer ids (int32/int64), got dtype {input.dtype}")


def bag_features(
    spec: PlainSpec, input: Tensor, offsets: Tensor | None, per_sample_weights: Tensor | None, weighted: bool
) -> KeyedJaggedTensor:
    """``EmbeddingBag.forward``'s arguments as a one-feature KJT of ``B`` bags."""
    _check_ids(spec, input)
    if per_sample_weights is not None and spec.mode != "sum":
        raise ValueError(
            f"{spec.where}: per_sample_weights is only supported for mode='sum' (as in torch), got mode={spec.mode!r}"
        )
    if per_sample_weights is not None and per_sample_weights.shape != input.shape:
        raise ValueError(
            f"{spec.where}: per_sample_weights has shape {tuple(per_sample_weights.shape)}, "
            f"input {tuple(input.shape)}; they must match"
        )
    if input.dim() == 2:
        if offsets is not None:
            raise ValueError(f"{spec.where}: offsets must be None when input is 2-D [B, L], got {tuple(offsets.shape)}")
        values = input.reshape(-1)
        lengths = torch.full((input.shape[0],), input.shape[1], dtype=torch.long, device=input.device)
    elif input.dim() == 1:
        if offsets is None or offsets.dim() != 1:
            got = None if offsets is None else tuple(offsets.shape)
            raise ValueError(f"{spec.where}: 1-D input needs 1-D offsets (one start per bag), got {got}")
        offsets = offsets.to(device=input.device, dtype=torch.long)
        if not spec.include_last_offset:
            offsets = torch.cat([offsets, offsets.new_full((1,), input.numel())])
        lengths = offsets[1:] - offsets[:-1]
        values = input
    else:
        raise ValueError(
            f"{spec.where}: input must be 1-D (with offsets) or 2-D [B, L], got shape {tuple(input.shape)}"
        )
    weights = None if per_sample_weights is None else per_sample_weights.reshape(-1)
    if spec.padding_idx is not None:  # torch leaves padding ids out of their bag
        keep = values != spec.padding_idx
        bag = torch.repeat_interleave(
            torch.arange(lengths.numel(), device=values.device), lengths, output_size=values.numel()
        )  # output_size: no device sync
        lengths = torch.zeros_like(lengths).index_add_(0, bag, keep.to(lengths.dtype))
        values = values[keep]
        weights = None if weights is None else weights[keep]
    if weighted and weights is None:
        weights = torch.ones(values.numel(), device=values.device)
    return KeyedJaggedTensor(
        [spec.path], values, weights, lengths=lengths, length_per_key=None if values.is_cuda else [values.numel()]
    )


def lookup_features(spec: PlainSpec, input: Tensor) -> KeyedJaggedTensor:
    """``Embedding.forward``'s ids (any shape) as a one-feature KJT of one-id bags."""
    _check_ids(spec, input)
    values = input.reshape(-1)
    lengths = torch.ones(values.numel(), dtype=torch.long, device=values.device)
    return KeyedJaggedTensor._trusted([spec.path], values, None, lengths, values.numel(), [values.numel()])


def max_pool(rows: Tensor, lengths: Tensor) -> Tensor:
    """Per-bag, per-column max of ``rows [N, D]`` over bags of ``lengths [B]`` -> ``[B, D]`` (empty bags 0)."""
    bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=rows.device), lengths, output_size=rows.shape[0])
    out = rows.new_zeros(lengths.numel(), rows.shape[1])
    return out.scatter_reduce(0, bag.unsqueeze(1).expand_as(rows), rows, "amax", include_self=False)


def unpadded(spec: PlainSpec, input: Tensor, rows: Tensor) -> Tensor:
    """``rows [N, D]`` of ``Embedding``'s ids, reshaped to ``[*input.shape, D]``; padding rows get no gradient."""
    if spec.padding_idx is not None:
        pad = (input.reshape(-1) == spec.padding_idx).unsqueeze(1)
        rows = torch.where(pad, rows.detach(), rows)
    return rows.view(*input.shape, rows.shape[1])


class EmbeddingBagCall:
    """``nn.EmbeddingBag``'s forward on top of a collection's ``forward(kjt)`` (mixed into the adapters)."""

    spec: PlainSpec

    def forward(  # type: ignore[override]
        self, input: Tensor, offsets: Tensor | None = None, per_sample_weights: Tensor | None = None
    ) -> Tensor:
        weighted = self.spec.mode == "sum"
        kjt = bag_features(self.spec, input, offsets, per_sample_weights, weighted)
        out = super().forward(kjt)  # type: ignore[misc]
        if self.spec.mode == "max":
            jt = out[self.spec.path]
            return max_pool(jt.values(), jt.lengths())
        return out.values()


class EmbeddingCall:
    """``nn.Embedding``'s forward on top of a collection's ``forward(kjt)`` (mixed into the adapters)."""

    spec: PlainSpec

    def forward(self, input: Tensor) -> Tensor:  # type: ignore[override]
        out = super().forward(lookup_features(self.spec, input))  # type: ignore[misc]
        return unpadded(self.spec, input, out[self.spec.path].values())


class PlainEmbeddingBag(EmbeddingBagCall, EmbeddingBagCollection):  # type: ignore[misc]  # nn.Embedding(Bag)'s call, not a KJT's
    """An ``nn.EmbeddingBag`` (mode sum/mean) as a one-table EmbeddingBagCollection; same call and result."""

    def __init__(self, module: nn.EmbeddingBag, path: str) -> None:
        config = EmbeddingBagConfig(
            name=table_name(path),
            num_embeddings=module.num_embeddings,
            embedding_dim=module.embedding_dim,
            feature_names=[path],
            data_type=_data_type(module.weight, path),
            pooling=PoolingType.MEAN if module.mode == "mean" else PoolingType.SUM,
        )
        with torch.random.fork_rng(devices=[]):  # the user's weight: no table seed drawn from their RNG
            super().__init__([config], is_weighted=module.mode == "sum", device=torch.device("meta"))
        self.embedding_bags[config.name].weight = module.weight
        self.spec = PlainSpec(path, "EmbeddingBag", module.mode, module.padding_idx, module.include_last_offset)


class PlainMaxEmbeddingBag(EmbeddingBagCall, EmbeddingCollection):  # type: ignore[misc]  # nn.Embedding(Bag)'s call, not a KJT's
    """An ``nn.EmbeddingBag(mode="max")`` as a one-table EmbeddingCollection, max-pooled per bag."""

    def __init__(self, module: nn.EmbeddingBag, path: str) -> None:
        config = _sequence_config(module, path)
        with torch.random.fork_rng(devices=[]):  # the user's weight: no table seed drawn from their RNG
            super().__init__([config], device=torch.device("meta"))
        self.embeddings[config.name].weight = module.weight
        self.spec = PlainSpec(path, "EmbeddingBag", "max", module.padding_idx, module.include_last_offset)


class PlainEmbedding(EmbeddingCall, EmbeddingCollection):  # type: ignore[misc]  # nn.Embedding(Bag)'s call, not a KJT's
    """An ``nn.Embedding`` as a one-table EmbeddingCollection; same call and result."""

    def __init__(self, module: nn.Embedding, path: str) -> None:
        config = _sequence_config(module, path)
        with torch.random.fork_rng(devices=[]):  # the user's weight: no table seed drawn from their RNG
            super().__init__([config], device=torch.device("meta"))
        self.embeddings[config.name].weight = module.weight
        self.spec = PlainSpec(path, "Embedding", "lookup", module.padding_idx)


PlainModule = PlainEmbeddingBag | PlainMaxEmbeddingBag | PlainEmbedding


def _sequence_config(module: nn.Embedding | nn.EmbeddingBag, path: str) -> EmbeddingConfig:
    return EmbeddingConfig(
        name=table_name(path),
        num_embeddings=module.num_embeddings,
        embedding_dim=module.embedding_dim,
        feature_names=[path],
        data_type=_data_type(module.weight, path),
    )


def _data_type(weight: Tensor, path: str) -> DataType:
    if weight.dtype not in _DTYPES:
        raise ValueError(
            f"'{path}': an embedding weight of dtype {weight.dtype} cannot be sharded "
            f"(supported: {', '.join(str(d) for d in _DTYPES)})"
        )
    return _DTYPES[weight.dtype]


def _adapter(module: nn.Module, path: str) -> PlainModule:
    what = f"{type(module).__name__} '{path}'"
    refused = {"max_norm": module.max_norm, "scale_grad_by_freq": module.scale_grad_by_freq}
    for option, value in refused.items():
        if value:
            raise ValueError(
                f"{what}: {option}={value} cannot be sharded (the fused optimizer updates rows in backward). "
                f"Drop the option, or keep the module data-parallel by leaving '{path}' out of "
                "ShardRecStrategy(embedding_modules=[...])"
            )
    if isinstance(module, nn.EmbeddingBag):
        return PlainMaxEmbeddingBag(module, path) if module.mode == "max" else PlainEmbeddingBag(module, path)
    if isinstance(module, nn.Embedding):
        return PlainEmbedding(module, path)
    raise TypeError(f"{what}: not an nn.Embedding or nn.EmbeddingBag")


def find_embedding_modules(model: nn.Module) -> dict[str, nn.Embedding | nn.EmbeddingBag]:
    """Module path -> every plain ``nn.Embedding`` / ``nn.EmbeddingBag`` (exact types; not inside collections)."""
    found: dict[str, nn.Embedding | nn.EmbeddingBag] = {}

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if type(child) in (nn.Embedding, nn.EmbeddingBag):
                found[path] = child  # type: ignore[assignment]
            elif not _is_collection(child):
                walk(child, f"{path}.")  # a collection's own tables are the collection's business

    if not _is_collection(model):
        walk(model, "")
    return found


def _is_collection(module: nn.Module) -> bool:
    return hasattr(module, "embedding_bag_configs") or hasattr(module, "embedding_configs")


def check_embedding_options(
    which: bool | Sequence[str], min_rows: int, owner: str = "swap_embedding_modules"
) -> bool | list[str]:
    """``which`` (``True``, ``False`` or module paths) as a bool or a list; ``min_rows`` an int >= 0."""
    if not isinstance(which, bool) and (isinstance(which, str) or not all(isinstance(p, str) for p in which)):
        raise TypeError(f"{owner}: embedding_modules must be True, False or a list of module paths, got {which!r}")
    if isinstance(min_rows, bool) or not isinstance(min_rows, int) or min_rows < 0:
        raise ValueError(f"{owner}: embedding_min_rows must be an int >= 0, got {min_rows!r}")
    return which if isinstance(which, bool) else list(which)


def swap_embedding_modules(
    model: nn.Module, which: bool | Sequence[str] = True, min_rows: int = 0
) -> dict[str, PlainModule]:
    """Replace plain embedding modules in ``model`` (in place) by shardable adapters.

    ``which``: ``True`` every ``nn.Embedding`` / ``nn.EmbeddingBag`` with at least
    ``min_rows`` rows, ``False`` none, or a list of module paths. A module reached by two
    paths, or whose weight another module also uses (tied weights), is refused: sharding it
    would leave the other user with a stale copy.
    """
    which = check_embedding_options(which, min_rows)
    if which is False:
        return {}
    found = find_embedding_modules(model)
    done = {p for p, m in model.named_modules() if isinstance(getattr(m, "spec", None), PlainSpec)}
    if which is True:
        chosen = [p for p, m in found.items() if m.num_embeddings >= min_rows]
    else:
        which = [p for p in which if p not in done]  # swapped by an earlier setup (validate, then fit)
        unknown = [p for p in which if p not in found]
        if unknown:
            raise ValueError(
                f"embedding_modules names {unknown}, which are not nn.Embedding / nn.EmbeddingBag modules of "
                f"{type(model).__name__}; its embedding modules are {sorted(found)}"
            )
        chosen = list(dict.fromkeys(which))
    _check_not_shared(model, {p: found[p] for p in chosen})
    names = {table_name(p): p for p in found}
    clash = sorted({p for p in chosen if names[table_name(p)] != p})
    if clash:
        raise ValueError(f"embedding modules {clash} map to the same table names as others; rename one of them")
    swapped: dict[str, PlainModule] = {}
    for path in chosen:
        adapter = _adapter(found[path], path)
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, adapter)
        swapped[path] = adapter
    return swapped


def _check_not_shared(model: nn.Module, chosen: dict[str, nn.Module]) -> None:
    paths: dict[int, list[str]] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(m), []).append(path)
    users: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        users.setdefault(id(p), []).append(name)
    for path, m in chosen.items():
        if len(paths[id(m)]) > 1:
            raise ValueError(
                f"{type(m).__name__} '{path}' is reachable as {paths[id(m)]}; a shared module cannot be sharded. "
                "Reach it by one attribute, or leave it out of ShardRecStrategy(embedding_modules=[...])"
            )
        names = users[id(m.weight)]
        if len(names) > 1:
            raise ValueError(
                f"{type(m).__name__} '{path}': its weight is also {[n for n in names if n != path + '.weight']} "
                "(tied weights); a tied table cannot be sharded. Untie it, or leave it out of "
                "ShardRecStrategy(embedding_modules=[...])"
            )
