"""Exception types of the sparse types, matching what TorchRec's users catch.

TorchRec signals several misuses of its jagged types with ``assert`` (an
``AssertionError``): float lengths, ``weights()`` of an unweighted tensor, ``concat``
of KJTs with different batch sizes. Ours raise :class:`JaggedAssertionError`, a
``ValueError`` (this library's convention for bad input) that is also an
``AssertionError``, so ``except AssertionError`` written for TorchRec still catches it
and, unlike an ``assert``, it survives ``python -O``. :class:`JaggedIndexError` does
the same for TorchRec's ``IndexError``.
"""

from __future__ import annotations


class JaggedAssertionError(ValueError, AssertionError):
    """Bad input to a jagged type where TorchRec raises ``AssertionError``."""


class JaggedIndexError(ValueError, IndexError):
    """A key index or key count out of range (``permute``, ``split``).

    TorchRec's list indexing raises ``IndexError`` there.
    """
