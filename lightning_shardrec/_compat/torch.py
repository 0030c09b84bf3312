"""Every private torch name the library uses: what it is, since which release, and what happens without it.

Supported: torch 2.11 through 2.14 (the suite runs at 2.11, 2.13 and 2.14.1). Each wrapper below
names the private symbol it stands for, the first release where it has the form used here, and
the fallback where it is missing (a public route, a reduced behaviour, or a ``RuntimeError``
naming the feature that needs it). Only modules ``import torch`` has already loaded are imported
at the top; ``torch.distributed._shard``, ``torch._inductor`` and ``torch.distributed.optim`` load on
first use.

Public routes taken elsewhere instead of a private name (no wrapper needed): the streamed file's
storage alignment reads ``torch.utils.serialization.config``; DCP is read with ``dcp.load(...,
no_dist=True)`` into tensors allocated from the checkpoint's metadata (not ``_load_state_dict`` and
``_EmptyStateDictLoadPlanner``); a record's offset in a zip archive is read with :mod:`zipfile`.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
import torch.fx._pytree as _fx_pytree
import torch.utils._pytree as _pytree
from torch import Tensor

if TYPE_CHECKING:
    from torch.distributed._shard.sharded_tensor import ShardedTensor


def _missing(symbol: str, feature: str) -> RuntimeError:
    return RuntimeError(
        f"torch {torch.__version__} has no {symbol}, which {feature} needs; lightning_shardrec supports torch 2.11 "
        "through 2.14 (see docs/install.md)"
    )


# --- torch.save's zip archive, written a tensor at a time (checkpoint/streamed_file.py) ---------------------------


def open_zipfile_writer(name: str) -> Any:
    """``torch.serialization._open_zipfile_writer(name)``: the context manager ``torch.save`` writes a file
    through; ``.file_like`` is its ``torch._C.PyTorchFileWriter`` (``write_record(name, data, nbytes)``).

    Since torch 1.6 in this form. Missing: ``RuntimeError`` (the full checkpoint format cannot be
    streamed; the sharded format does not need it).
    """
    opener = getattr(torch.serialization, "_open_zipfile_writer", None)
    if opener is None:
        raise _missing("torch.serialization._open_zipfile_writer", "the streamed full-format checkpoint")
    return opener(name)


def reserve_record(writer: Any, name: str, nbytes: int) -> None:
    """``PyTorchFileWriter.write_record_metadata(name, nbytes)``: a record's header and room, its bytes written
    later (what ``torch.serialization.skip_data`` saves with).

    Since torch 2.5. Missing: ``RuntimeError`` (a table too big to hold whole cannot be streamed).
    """
    if not hasattr(writer, "write_record_metadata"):
        raise _missing("PyTorchFileWriter.write_record_metadata", "reserving a record of the full-format checkpoint")
    writer.write_record_metadata(name, nbytes)


def rebuild_tensor_v2() -> Callable[..., Tensor]:
    """``torch._utils._rebuild_tensor_v2``: the function every ``torch.save`` pickle names to rebuild a tensor
    (and that ``torch.load(weights_only=True)`` allows).

    Since torch 1.0; it cannot move without breaking every checkpoint ever written. Missing:
    ``RuntimeError`` (the streamed file would not load).
    """
    rebuild = getattr(torch._utils, "_rebuild_tensor_v2", None)
    if rebuild is None:
        raise _missing("torch._utils._rebuild_tensor_v2", "the streamed full-format checkpoint")
    return rebuild  # type: ignore[no-any-return]


def storage_type(dtype: torch.dtype) -> Any:
    """The legacy storage class ``torch.save`` pickles for ``dtype`` (``torch.FloatStorage`` for float32):
    ``torch.storage._dtype_to_storage_type_map()``.

    Since torch 1.13. Missing: the same table built from the public legacy classes' ``dtype``.
    """
    table = getattr(torch.storage, "_dtype_to_storage_type_map", None)
    if table is not None:
        return getattr(torch, table()[dtype])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # TypedStorage is deprecated
        classes = [getattr(torch, n) for n in dir(torch) if n.endswith("Storage") and n[0].isupper()]
        by_dtype = {c.dtype: c for c in classes if isinstance(getattr(c, "dtype", None), torch.dtype)}
    return by_dtype[dtype]


def typed_storage_parts(storage: torch.storage.TypedStorage) -> tuple[torch.UntypedStorage, Any, int]:
    """``(untyped storage, legacy storage class, number of elements)`` of a ``TypedStorage``, what ``torch.save``
    records for it: ``._untyped_storage``, ``._pickle_storage_type()``, ``._size()``.

    Since torch 2.0 (the typed/untyped split). Missing: the public ``untyped()``, ``pickle_storage_type()``
    and ``size()``, which warn that TypedStorage is deprecated (silenced here).
    """
    if hasattr(storage, "_pickle_storage_type"):
        return storage._untyped_storage, getattr(torch, storage._pickle_storage_type()), storage._size()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return storage.untyped(), getattr(torch, storage.pickle_storage_type()), storage.size()


def storage_key(storage: torch.UntypedStorage) -> int | tuple[int, int]:
    """The identity ``torch.save`` keys a storage by (a storage shared by two tensors is written once):
    ``storage._cdata``.

    Since torch 1.0. Missing: ``(data_ptr, nbytes)`` (equal for the same memory).
    """
    cdata = getattr(storage, "_cdata", None)
    return (storage.data_ptr(), storage.nbytes()) if cdata is None else cdata


# --- pytree (sparse/pytree.py, checkpoint/, inference/program.py) --------------------------------------------------
# ``torch.utils._pytree`` is the registry torch.export and torch.compile flatten inputs with; torch has no public
# ``torch.utils.pytree`` up to 2.14. The names below have this form in every supported release (``flatten_with_keys_fn``
# since torch 2.3); missing, importing the library fails here with the name: the sparse types cannot be exported
# without them.

tree_map = _pytree.tree_map
tree_leaves = _pytree.tree_leaves
TreeSpec = _pytree.TreeSpec
KeyEntry = _pytree.KeyEntry
GetAttrKey = _pytree.GetAttrKey


def register_pytree_node(
    cls: type, flatten: Callable[..., Any], unflatten: Callable[..., Any], *, name: str, flatten_with_keys: Any
) -> None:
    """``torch.utils._pytree.register_pytree_node``."""
    _pytree.register_pytree_node(
        cls, flatten, unflatten, serialized_type_name=name, flatten_with_keys_fn=flatten_with_keys
    )


def is_pytree_node(cls: type) -> bool:
    """Whether ``cls`` is registered (``torch.utils._pytree.SUPPORTED_NODES``)."""
    return cls in _pytree.SUPPORTED_NODES


def register_flatten_spec(cls: type, flatten: Callable[[Any, Any], list[Any]]) -> None:
    """``torch.fx._pytree.register_pytree_flatten_spec``: how an exported program's ``module()`` flattens ``cls``
    against its input spec. Since torch 1.10; missing, importing the library fails here with the name."""
    _fx_pytree.register_pytree_flatten_spec(cls, flatten)


def detect_fake(tensors: Sequence[Tensor | None]) -> bool:
    """Whether ``tensors`` are fake (being traced by ``torch.export``): ``torch._guards.detect_fake_mode``.

    Since torch 2.0. Missing: False (a traced KJT is then checked as a real one, and export may refuse it).
    """
    guards = getattr(torch, "_guards", None)
    detect = getattr(guards, "detect_fake_mode", None)
    return detect is not None and detect(tensors) is not None


# --- tensor subclasses and dispatch modes (checkpoint/stored_tensor.py, gpu_check/syncs.py) -------------------------


def make_wrapper_subclass(cls: type, size: Sequence[int], dtype: torch.dtype) -> Any:
    """``torch.Tensor._make_wrapper_subclass``: a CPU tensor of ``cls`` with shape and dtype and no storage, the
    documented way to write a ``__torch_dispatch__`` subclass. Since torch 1.10; missing: ``RuntimeError``."""
    make = getattr(Tensor, "_make_wrapper_subclass", None)
    if make is None:
        raise _missing("torch.Tensor._make_wrapper_subclass", "read_full(lazy=True)")
    return make(cls, size, dtype=dtype, device=torch.device("cpu"), requires_grad=False)


#: ``torch._C._disabled_torch_function_impl``: set as a subclass's ``__torch_function__`` so that only
#: ``__torch_dispatch__`` sees its operations. Since torch 1.7; missing: importing the library fails here.
disabled_torch_function_impl = torch._C._disabled_torch_function_impl

try:  # ``torch.utils._python_dispatch.TorchDispatchMode``: the base of a dispatch mode (documented under
    # "Extending torch with a __torch_dispatch__ mode"). Since torch 1.13.
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # missing: a mode that refuses to start, naming the feature

    class TorchDispatchMode:  # type: ignore[no-redef]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise _missing("torch.utils._python_dispatch.TorchDispatchMode", "gpu_check's sync counter")


# --- checks inside traced code (inference/serving_ebc.py) ----------------------------------------------------------


def check(condition: Any, message: Callable[[], str] | None = None) -> None:
    """``torch._check``: a condition ``torch.export`` records as a fact about symbolic sizes (documented in
    torch's reference). Since torch 2.1; missing: a Python check that raises ``RuntimeError``."""
    fn = getattr(torch, "_check", None)
    if fn is not None:
        fn(condition, message)
    elif not condition:
        raise RuntimeError(message() if message is not None else "check failed")


def assert_async(condition: Tensor, message: str) -> None:
    """``torch._assert_async(cond, msg)``: fails the device stream (no host sync) when ``cond`` is false.

    Present with a message in every supported release (2.11-2.14). Missing: ``RuntimeError`` raised from a host
    read of ``cond``.
    """
    fn = getattr(torch, "_assert_async", None)
    if fn is not None:
        fn(condition, message)
    elif not bool(condition):
        raise RuntimeError(message)


@contextlib.contextmanager
def size_oblivious_export() -> Iterator[None]:
    """``torch.fx.experimental._config.patch(backed_size_oblivious=True)``: export treats a size-1 example
    dimension as any size instead of specialising on it.

    Present in every supported release (2.11-2.14). Missing: nothing patched (export may then need an example
    batch larger than 1).
    """
    config = getattr(torch.fx.experimental, "_config", None)
    if config is None or not hasattr(config, "backed_size_oblivious"):
        yield
        return
    with config.patch(backed_size_oblivious=True):
        yield


def aoti_compile_and_package(program: Any, package_path: str, inductor_configs: Mapping[str, Any]) -> Any:
    """``torch._inductor.aoti_compile_and_package``: compile an ExportedProgram into an AOTInductor package,
    the entry point torch's AOTInductor docs give (no public alias as of 2.14). Since torch 2.6; missing:
    ``RuntimeError`` (export with ``format="pt2"`` instead)."""
    try:
        from torch._inductor import aoti_compile_and_package as compile_package
    except ImportError:
        raise _missing("torch._inductor.aoti_compile_and_package", "export(format='aoti')") from None
    return compile_package(program, package_path=package_path, inductor_configs=dict(inductor_configs))


# --- distributed (optim/, distributed/, lightning/strategies/strategy.py) -------------------------------------------


def apply_optimizer_in_backward(
    optimizer_class: type[torch.optim.Optimizer], params: Any, optimizer_kwargs: dict[str, Any]
) -> None:
    """``torch.distributed.optim.apply_optimizer_in_backward._apply_optimizer_in_backward``: each parameter
    steps its own optimizer from a gradient hook (TorchRec's in-backward API stands on it).

    Since torch 2.0. Imported on call: ``torch.distributed.optim`` scripts its functional optimizers at
    import (slow). Missing: ``RuntimeError``.
    """
    try:
        from torch.distributed.optim.apply_optimizer_in_backward import _apply_optimizer_in_backward
    except ImportError:
        raise _missing("_apply_optimizer_in_backward", "apply_optimizer_in_backward") from None
    _apply_optimizer_in_backward(optimizer_class=optimizer_class, params=params, optimizer_kwargs=optimizer_kwargs)


def default_store() -> Any:
    """The default process group's rendezvous store: ``torch.distributed.distributed_c10d._get_default_store()``.

    Since torch 1.x. Missing or failing: None (the health monitor is then off).
    """
    try:
        return torch.distributed.distributed_c10d._get_default_store()
    except Exception:
        return None


def ddp_ignore(module: torch.nn.Module, names: list[str]) -> None:
    """Make DDP leave the parameters and buffers ``names`` of ``module`` alone (updated in backward by their fused
    optimizers): ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``.

    Since torch 1.8 (torch's own note: a workaround until the API is finalised, pytorch#43690). Missing: the
    attribute it sets, ``module._ddp_params_and_buffers_to_ignore``, which DDP reads.
    """
    ddp = torch.nn.parallel.DistributedDataParallel
    setter = getattr(ddp, "_set_params_and_buffers_to_ignore_for_model", None)
    if setter is not None:
        setter(module, names)
    else:
        setattr(module, "_ddp_params_and_buffers_to_ignore", names)  # noqa: B010  (what torch's setter sets)


# --- ShardedTensor: the sharded checkpoint's tables (checkpoint/, distributed/dmp/dmp_state.py, inference/) ---------
# ``torch.distributed._shard.sharded_tensor`` (since torch 1.10, deprecated for DTensor since 2.4) is the type
# sharded checkpoints and ``DistributedModelParallel.state_dict()`` hold, as in TorchRec: a table's shards sit at
# any offsets the plan gives (DTensor's even placements cannot say them), and DCP saves its metadata in the
# checkpoint format. Missing: ``RuntimeError`` naming the sharded checkpoint (the full format does not need it).


def _sharded_tensor_module() -> Any:
    try:
        import torch.distributed._shard.sharded_tensor as sharded_tensor
    except ImportError:
        raise _missing("torch.distributed._shard.sharded_tensor", "the sharded checkpoint format") from None
    return sharded_tensor


def sharded_tensor_type() -> type[ShardedTensor]:
    """torch's ``ShardedTensor`` class (what TorchRec's ``torchrec.distributed.types.ShardedTensor`` is)."""
    return _sharded_tensor_module().ShardedTensor  # type: ignore[no-any-return]


def is_sharded_tensor(value: Any) -> TypeGuard[ShardedTensor]:
    """Whether ``value`` is a ``ShardedTensor`` (a ``Tensor`` subclass). ``torch.distributed._shard`` is not
    imported for this: until something imported it, no value can be one."""
    module = sys.modules.get("torch.distributed._shard.sharded_tensor")
    return module is not None and isinstance(value, module.ShardedTensor)


def sharded_tensor_from_plan(
    size: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    pieces: Sequence[tuple[Sequence[int], Sequence[int], int]],
    local: Mapping[tuple[int, ...], Tensor],
    rank: int,
) -> ShardedTensor:
    """A ShardedTensor of global ``size`` whose shards are ``pieces`` ``(offsets, sizes, rank)``, this rank's
    ones backed by ``local[offsets]``; no collective (``ShardedTensor._init_from_local_shards_and_global_metadata``,
    since torch 1.12)."""
    st = _sharded_tensor_module()
    metas = [
        st.ShardMetadata(shard_offsets=list(o), shard_sizes=list(s), placement=f"rank:{r}/{device}")
        for o, s, r in pieces
    ]
    global_meta = st.ShardedTensorMetadata(
        shards_metadata=metas, size=torch.Size(size), tensor_properties=st.metadata.TensorProperties(dtype=dtype)
    )
    mine = [st.Shard(local[tuple(m.shard_offsets)], m) for m in metas if m.placement.rank() == rank]
    return st.ShardedTensor._init_from_local_shards_and_global_metadata(  # type: ignore[no-any-return]
        mine, global_meta, process_group=None
    )


def sharded_tensor_from_layout(
    size: Sequence[int],
    dtype: torch.dtype,
    layout: Sequence[tuple[Sequence[int], Sequence[int], str]],
    local: Mapping[int, Tensor],
    process_group: Any,
) -> ShardedTensor:
    """A ShardedTensor of global ``size`` whose shards are ``layout`` ``(offsets, sizes, "rank:R/device")``, the
    ones at the indices of ``local`` backed by this rank's tensors; no collective (global ranks in the
    placements; ``ShardedTensor._init_from_local_shards_and_global_metadata``, since torch 1.12)."""
    st = _sharded_tensor_module()
    metas = [st.ShardMetadata(shard_offsets=list(o), shard_sizes=list(s), placement=p) for o, s, p in layout]
    global_meta = st.ShardedTensorMetadata(
        shards_metadata=metas,
        size=torch.Size(size),
        tensor_properties=st.metadata.TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False),
    )
    mine = [st.Shard(t, metas[i]) for i, t in local.items()]
    return st.ShardedTensor._init_from_local_shards_and_global_metadata(  # type: ignore[no-any-return]
        mine, global_meta, process_group=process_group
    )


def enumerable_sharding_spec(layout: Sequence[tuple[Sequence[int], Sequence[int], str]]) -> Any:
    """``torch.distributed._shard.sharding_spec.EnumerableShardingSpec`` of ``layout`` ``(offsets, sizes,
    "rank:R/device")``: TorchRec's ``ParameterSharding.sharding_spec`` (since torch 1.10). Missing: ``RuntimeError``."""
    try:
        from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
    except ImportError:
        raise _missing("torch.distributed._shard.sharding_spec", "ParameterSharding.sharding_spec") from None
    st = _sharded_tensor_module()
    return EnumerableShardingSpec(
        [st.ShardMetadata(shard_offsets=list(o), shard_sizes=list(z), placement=p) for o, z, p in layout]
    )


def sharded_tensor_from_local(
    local: Sequence[tuple[Tensor, Sequence[int]]], size: Sequence[int], rank: int, process_group: Any
) -> ShardedTensor:
    """Collective over ``process_group``: a ShardedTensor of global ``size`` from every rank's ``(tensor,
    offsets)`` shards, the metadata exchanged (``ShardedTensor._init_from_local_shards``, since torch 1.11)."""
    st = _sharded_tensor_module()
    shards = [st.Shard.from_tensor_and_offsets(t, list(offsets), rank) for t, offsets in local]
    return st.ShardedTensor._init_from_local_shards(  # type: ignore[no-any-return]
        shards, *size, process_group=process_group
    )


# --- a tensor's in-place version (distributed/sharded/collection.py: a prefetched batch edited in place) -----------
def inplace_version(t: Tensor) -> int:
    """``Tensor._version`` (since torch 0.4): the counter every in-place operation on ``t`` (or a view of it)
    bumps, which autograd reads to refuse stale saved tensors. No public spelling exists; without it (never
    seen) the count reads 0, so an in-place edit of a prefetched batch would go unnoticed as before the check."""
    return int(getattr(t, "_version", 0))


__all__ = [
    "GetAttrKey",
    "KeyEntry",
    "TorchDispatchMode",
    "TreeSpec",
    "aoti_compile_and_package",
    "apply_optimizer_in_backward",
    "assert_async",
    "check",
    "ddp_ignore",
    "default_store",
    "detect_fake",
    "disabled_torch_function_impl",
    "is_sharded_tensor",
    "make_wrapper_subclass",
    "open_zipfile_writer",
    "rebuild_tensor_v2",
    "enumerable_sharding_spec",
    "inplace_version",
    "is_pytree_node",
    "register_flatten_spec",
    "register_pytree_node",
    "reserve_record",
    "sharded_tensor_from_layout",
    "sharded_tensor_from_local",
    "sharded_tensor_from_plan",
    "size_oblivious_export",
    "storage_key",
    "storage_type",
    "tree_leaves",
    "tree_map",
    "typed_storage_parts",
]
