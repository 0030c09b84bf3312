"""TorchRec's awaitables (``torchrec.distributed.types.Awaitable`` / ``LazyAwaitable`` / ``NoWait``).

The sharded collections here return ready results (their output's ``wait()`` returns itself); these
classes serve programs that write their own awaitables, as TorchRec's tutorials do:
``wait()`` runs ``_wait_impl()`` once, then each of ``callbacks`` on the result in order.
A :class:`LazyAwaitable` also waits by itself when used: an attribute read or a torch function
on it acts on its result.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from lightning_shardrec._compat import torch as compat
from lightning_shardrec.sparse.fx_proxy import ProxyableABCMeta

W = TypeVar("W")
_UNSET: Any = object()


class Awaitable(abc.ABC, Generic[W]):
    """A result computed on ``wait()`` (by ``_wait_impl``), then passed through ``callbacks``."""

    def __init__(self) -> None:
        self._callbacks: list[Callable[[W], W]] = []
        self._result: W = _UNSET

    @property
    def callbacks(self) -> list[Callable[[W], W]]:
        return self._callbacks

    @abc.abstractmethod
    def _wait_impl(self) -> W: ...

    def wait(self) -> W:
        if self._result is _UNSET:
            result = self._wait_impl()
            for callback in self._callbacks:
                result = callback(result)
            self._result = result
        return self._result


class NoWait(Awaitable[W]):
    """An awaitable of a result already at hand."""

    def __init__(self, obj: W) -> None:
        super().__init__()
        self._obj = obj

    def _wait_impl(self) -> W:
        return self._obj


class LazyAwaitable(Awaitable[W], metaclass=ProxyableABCMeta):  # built from an fx Proxy: one graph node
    """An awaitable that waits when its result is used (attribute reads, torch functions)."""

    def __getattr__(self, name: str) -> Any:
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
        def ready(x: Any) -> Any:
            return x.wait() if isinstance(x, LazyAwaitable) else x

        new_args = compat.tree_map(ready, tuple(args))
        new_kwargs = compat.tree_map(ready, dict(kwargs or {}))
        return func(*new_args, **new_kwargs)


__all__ = ["Awaitable", "LazyAwaitable", "NoWait"]
