"""TorchRec's awaitables (``torchrec.distributed.types.Awaitable`` / ``LazyAwaitable`` / ``NoWait``).

The sharded collections here return ready results (their output's ``wait()`` returns itself); these
classes serve programs that write their own awaitables, as TorchRec's tutorials do:
``wait()`` runs ``_wait_impl()`` once, then each of ``callbacks`` on the result in order.
A :class:`LazyAwaitable` also waits by itself when used: an attribute read or a torch function
on it acts on its result.
"""

from __future__ import annotations

import abc
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from lightning_shardrec._compat import torch as compat
from lightning_shardrec.sparse.fx_proxy import ProxyableABCMeta

W = TypeVar("W")
KT = TypeVar("KT")
VT = TypeVar("VT")


class Awaitable(abc.ABC, Generic[W]):
    """A result computed on ``wait()`` (by ``_wait_impl``), then passed through ``callbacks``."""

    def __init__(self) -> None:
        self._callbacks: list[Callable[[W], W]] = []
        self._result: W | None = None  # None until waited (TorchRec's attribute)
        self._waited = False

    @property
    def callbacks(self) -> list[Callable[[W], W]]:
        return self._callbacks

    @abc.abstractmethod
    def _wait_impl(self) -> W: ...

    def wait(self) -> W:
        if not self._waited:
            result = self._wait_impl()
            for callback in self._callbacks:
                result = callback(result)
            self._result, self._waited = result, True
        return self._result  # type: ignore[return-value]


class NoWait(Awaitable[W]):
    """An awaitable of a result already at hand."""

    def __init__(self, obj: W) -> None:
        super().__init__()
        self._obj = obj

    def _wait_impl(self) -> W:
        return self._obj


class LazyAwaitable(Awaitable[W], metaclass=ProxyableABCMeta):  # built from an fx Proxy: one graph node
    """An awaitable that waits when its result is used: attribute reads, torch functions, operators
    (``+``, ``==``, ``[key]``, ... and their reflections, as TorchRec's)."""

    def __getattr__(self, name: str) -> Any:
        if name in ("_result", "_waited"):  # Awaitable.__init__ sets them
            raise RuntimeError(
                f"LazyAwaitable type {type(self)} has not been initialized properly, did you forget to call 'super()'?"
            )
        if name.startswith("_"):  # our own state (before __init__ ran, or a missing private name)
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return getattr(self.wait(), name)

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        new_args = compat.tree_map(_ready, tuple(args))
        new_kwargs = compat.tree_map(_ready, dict(kwargs or {}))
        return func(*new_args, **new_kwargs)


def _ready(x: Any) -> Any:
    return x.wait() if isinstance(x, LazyAwaitable) else x


def _install_operators() -> None:
    """``LazyAwaitable``'s operators wait for the operands, then apply ``operator.<name>`` (TorchRec's set:
    torch.fx's magic methods, and the reflected ones)."""

    def unary_or_binary(op: Callable[..., Any]) -> Callable[..., Any]:
        def method(*args: Any) -> Any:
            return op(*(_ready(a) for a in args))

        return method

    def reflected(op: Callable[..., Any]) -> Callable[..., Any]:
        def method(self: Any, other: Any) -> Any:
            return op(_ready(other), _ready(self))

        return method

    names = ("eq", "ne", "lt", "gt", "le", "ge", "pos", "neg", "invert", "add", "sub", "mul", "floordiv", "truediv",
             "mod", "pow", "lshift", "rshift", "and_", "or_", "xor", "getitem", "matmul")  # fmt: skip
    for name in names:
        dunder = f"__{name.rstrip('_')}__"
        setattr(LazyAwaitable, dunder, unary_or_binary(getattr(operator, name)))
        if name not in ("eq", "ne", "lt", "gt", "le", "ge", "pos", "neg", "invert", "getitem"):
            setattr(LazyAwaitable, f"__r{name.rstrip('_')}__", reflected(getattr(operator, name)))
    LazyAwaitable.__hash__ = object.__hash__  # type: ignore[method-assign]  # awaitables stay hashable


_install_operators()


class LazyNoWait(LazyAwaitable[W]):
    """A lazy awaitable of a result already at hand."""

    def __init__(self, obj: W) -> None:
        super().__init__()
        self._obj = obj

    def _wait_impl(self) -> W:
        return self._obj


class LazyGetItemMixin(Generic[KT, VT]):
    """Put before ``LazyAwaitable`` in the bases: ``awaitable[key]`` is then another lazy awaitable (of the
    result's ``[key]``) instead of a wait."""

    def __getitem__(self, key: KT) -> LazyAwaitable[VT]:
        return GetItemLazyAwaitable(self, key)  # type: ignore[arg-type]


class GetItemLazyAwaitable(LazyAwaitable[W], Generic[W, KT]):
    """``parent.wait()[key]``, waited for when used."""

    def __init__(self, parent: LazyAwaitable[Any], key: KT) -> None:
        super().__init__()
        self._parent = parent
        self._key = key

    def _wait_impl(self) -> W:
        return _ready(self._parent)[self._key]  # type: ignore[no-any-return]


__all__ = ["Awaitable", "GetItemLazyAwaitable", "LazyAwaitable", "LazyGetItemMixin", "LazyNoWait", "NoWait"]
