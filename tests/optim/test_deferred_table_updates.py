"""``DeferredTableUpdates`` in plain PyTorch: the window's row gradients equal a dense table's ``.grad``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_shardrec import FusedOptimConfig, KeyedJaggedTensor
from lightning_shardrec.kernels import TableSpec, make_kernel
from lightning_shardrec.optim import DeferredTableUpdates

SPECS = [TableSpec(name="t", num_embeddings=9, embedding_dim=4), TableSpec(name="u", num_embeddings=5, embedding_dim=4)]
# two micro-batches over two tables (features f -> t, g -> u); rows 2 and 8 of t are read by both
KJTS = [
    KeyedJaggedTensor(["f", "g"], torch.tensor([1, 2, 2, 8, 0, 4, 4]), None, torch.tensor([2, 0, 3, 1, 1, 0])),
    KeyedJaggedTensor(["f", "g"], torch.tensor([8, 2, 5, 3]), None, torch.tensor([1, 2, 0, 0, 0, 1])),
]
START = [torch.arange(36.0).view(9, 4) / 36, torch.arange(20.0).view(5, 4) / -20]
TARGET = torch.arange(24.0).view(3, 8) / 10


def kernel(optimizer: str = "adagrad", backend: str = "torch"):
    config = FusedOptimConfig(optimizer=optimizer, lr=0.5)
    k = make_kernel(SPECS, [0, 1], config, pooled=True, device="cpu", kernel=backend)
    k.load_weights(START)
    return k


def dense_grads(scale: float = 1.0) -> list[torch.Tensor]:
    """The tables' ``.grad`` in one process after both micro-batches (loss / 2 each)."""
    weights = [w.clone().requires_grad_() for w in START]
    for kjt in KJTS:
        outs = []
        for w, key in zip(weights, ("f", "g"), strict=True):
            jt = kjt[key]
            outs.append(F.embedding_bag(jt.values(), w, jt.offsets()[:-1], mode="sum"))
        (scale * F.mse_loss(torch.cat(outs, 1), TARGET) / 2).backward()
    return [w.grad for w in weights]


def accumulate(k, updates, scale: float = 1.0) -> None:
    for kjt in KJTS:
        (scale * F.mse_loss(k(kjt), TARGET) / 2).backward()


def kept(updates) -> list[torch.Tensor]:
    """The kept gradients as dense ``[rows, dim]`` per table (zero rows where nothing was kept)."""
    (entry,) = updates._kept.values()  # one dim group holds both tables
    flat = torch.zeros(sum(s.num_embeddings for s in SPECS), 4).index_copy_(0, entry.rows, entry.grad)
    return list(flat.split([s.num_embeddings for s in SPECS]))


def test_window_sum_is_the_dense_gradient_and_applies_once():
    k = kernel()
    updates = DeferredTableUpdates([k])
    accumulate(k, updates)
    for t, (got, want) in enumerate(zip(kept(updates), dense_grads(), strict=True)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=f"table {t}")
        torch.testing.assert_close(k.split_weights()[t], START[t], rtol=0, atol=0)  # not moved yet
    want_sq = sum(g.square().sum() for g in dense_grads())
    torch.testing.assert_close(updates.sum_squares(), want_sq)
    # rows 0, 1, 2, 5, 8 of t and 3, 4 of u: 7 kept (fp32 rows, int64 ids), in buffers grown to 2 x 7
    assert updates.pending == 1 and updates.kept_bytes() == 14 * (4 * 4 + 8)
    reference = [w.clone() for w in START]
    sums = [torch.zeros_like(w) for w in START]
    for w, s, g in zip(reference, sums, dense_grads(), strict=True):  # torch.optim.Adagrad once
        s += g * g
        w -= 0.5 * g / (s.sqrt() + 1e-8)
    updates.apply()
    assert updates.pending == 0
    for t in range(2):
        torch.testing.assert_close(k.split_weights()[t], reference[t], rtol=1e-6, atol=1e-7, msg=f"table {t}")


def test_scaled_window_is_checked_unscaled_clipped_and_discarded():
    k = kernel("sgd")
    updates = DeferredTableUpdates([k])
    accumulate(k, updates, scale=2.0**10)
    assert float(updates.found_inf()) == 0.0
    updates.unscale_(2.0**10)
    for got, want in zip(kept(updates), dense_grads(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    updates.clamp_(0.01)
    updates.scale_(torch.tensor(0.5))
    for got, want in zip(kept(updates), dense_grads(), strict=True):
        torch.testing.assert_close(got, want.clamp(-0.01, 0.01) * 0.5, rtol=1e-6, atol=1e-8)
    accumulate(k, updates, scale=float("inf"))
    assert float(updates.found_inf()) == 1.0
    updates.discard()
    assert updates.skipped_steps == 1 and updates.pending == 0
    torch.testing.assert_close(k.split_weights()[0], START[0], rtol=0, atol=0)
    updates.detach()
    accumulate(k, updates)  # detached: the rule runs in backward again
    assert not torch.equal(k.split_weights()[0], START[0]) and updates.pending == 0


@pytest.mark.needs_fbgemm
def test_fbgemm_kernels_are_refused_by_name():
    with pytest.raises(ValueError, match=r"DeferredTableUpdates needs torch kernels .* got backends \['fbgemm'\]"):
        DeferredTableUpdates([kernel("sgd", "fbgemm")])


def test_a_later_window_reuses_the_buffers_and_starts_empty():
    k = kernel("sgd")
    updates = DeferredTableUpdates([k])
    accumulate(k, updates)
    updates.apply()
    fresh = kernel("sgd")
    fresh.load_weights([w.clone() for w in k.split_weights()])
    fresh_updates = DeferredTableUpdates([fresh])
    for _ in range(2):  # window 2 of k (in window 1's buffers) vs window 1 of a kernel at the same weights
        accumulate(k, updates)
        accumulate(fresh, fresh_updates)
        for got, want in zip(kept(updates), kept(fresh_updates), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        updates.apply()
        fresh_updates.apply()
        for got, want in zip(k.split_weights(), fresh.split_weights(), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
