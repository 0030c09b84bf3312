"""The fixed 64-bit hash of dynamic tables: an id's bucket on every rank, device and run."""

from __future__ import annotations

from torch import Tensor


def _s64(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


GOLDEN = _s64(0x9E3779B97F4A7C15)
_C1 = _s64(0xBF58476D1CE4E5B9)
_C2 = _s64(0x94D049BB133111EB)


def shr(x: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 ``x`` by ``k`` bits (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix64(x: Tensor) -> Tensor:
    """splitmix64 of int64 ``x`` (two's-complement wraparound), elementwise, any device."""
    z = x + GOLDEN
    z ^= shr(z, 30)  # in place: one new tensor in all
    z *= _C1
    z ^= shr(z, 27)
    z *= _C2
    return z.bitwise_xor_(shr(z, 31))


def bucket_of(ids: Tensor, num_buckets: int | Tensor) -> Tensor:
    """Bucket in ``[0, num_buckets)`` of every raw int64 id: the top 63 hash bits mod ``num_buckets``
    (an int, or a tensor of per-id bucket counts)."""
    return shr(mix64(ids.long()), 1) % num_buckets
