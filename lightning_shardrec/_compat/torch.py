"""Private torch names this package uses, each with what it is, since when, and the fallback.

Minimal version (helper h42): the lead merges it with the fuller module of helper h40t.
"""

from __future__ import annotations

import torch
from torch import Tensor


def assert_async(cond: Tensor, message: str) -> None:
    """Fail if the 0-d bool ``cond`` is False, without a host sync on CUDA.

    ``torch._assert_async(tensor, msg)`` (private; present since torch 1.9, with a message since
    2.0): on CUDA a device-side assert, raised at the next synchronisation (fatal to the CUDA
    context, as fbgemm's ``BoundsCheckMode.FATAL``); on CPU it raises ``RuntimeError`` at once.
    Fallback when it is gone: ``if not bool(cond): raise RuntimeError(message)`` (one host sync).
    """
    check = getattr(torch, "_assert_async", None)
    if check is None:
        if not bool(cond):
            raise RuntimeError(message)
        return
    check(cond, message)
