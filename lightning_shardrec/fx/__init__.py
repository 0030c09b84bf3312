"""TorchRec's ``torchrec.fx``: the fx :class:`Tracer` with ``leaf_modules`` and :func:`symbolic_trace`."""

from lightning_shardrec.fx.tracer import Tracer, symbolic_trace

__all__ = ["Tracer", "symbolic_trace"]
