"""Sparse types built inside an ``torch.fx`` symbolic trace become graph nodes, as TorchRec's.

TorchRec gives its types torch's ``ProxyableClassMeta``; that one asks ``is_fx_tracing()`` on every
construction, which logs torch's "is_fx_tracing will return true for both fx.symbolic_trace and
torch.export" warning in every program that builds a batch. :class:`ProxyableConstruction` does the same
job by looking at the arguments: when one is an fx ``Proxy`` (only inside a trace), the construction is
recorded as one ``call_function`` node whose target is the class; otherwise the class is built as usual.
"""

from __future__ import annotations

import abc
from typing import Any

import torch


def _tracer_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The tracer of the first fx ``Proxy`` among the arguments (and one level into lists, tuples, dicts)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.fx.Proxy):
            return a.tracer
        inner: Any
        if isinstance(a, list | tuple):
            inner = a
        elif isinstance(a, dict):
            inner = a.values()
        else:
            continue
        for b in inner:
            if isinstance(b, torch.fx.Proxy):
                return b.tracer
    return None


class ProxyableConstruction(type):
    """Metaclass: ``Cls(...)`` with an fx ``Proxy`` argument records ``Cls(...)`` as a graph node."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        tracer = _tracer_of(args, kwargs)
        if tracer is None:
            return super().__call__(*args, **kwargs)
        return tracer.create_proxy("call_function", cls, args, kwargs)


class ProxyableABCMeta(abc.ABCMeta, ProxyableConstruction):
    """:class:`ProxyableConstruction` for abstract base classes."""


__all__ = ["ProxyableABCMeta", "ProxyableConstruction"]
