"""``accumulate_rows`` (sort + one embedding_bag) against the plain per-id sum."""

import pytest
import torch

from lightning_shardrec.kernels import row_updates


def naive(ids, grad, source, weights):
    per_id = grad if source is None else grad[source]
    if weights is not None:
        per_id = per_id * weights.unsqueeze(1)
    rows = torch.unique(ids)
    return rows, torch.stack([per_id[ids == r].sum(0) for r in rows]) if rows.numel() else grad[:0]


@pytest.mark.parametrize("pooled", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("num_rows", [None, 50, 2**40])  # int32 sort keys only when the rows fit
def test_accumulate_rows_matches_per_id_sum(pooled, weighted, num_rows):
    g = torch.Generator().manual_seed(0)
    n, bags = 200, 30
    ids = torch.randint(0, 50, (n,), generator=g)
    source = torch.randint(0, bags, (n,), generator=g) if pooled else None
    grad = torch.randn(bags if pooled else n, 6, generator=g)
    weights = torch.rand(n, generator=g) if weighted else None
    rows, summed = row_updates.accumulate_rows(ids, grad, source, weights, num_rows=num_rows)
    want_rows, want = naive(ids, grad, source, weights)
    assert torch.equal(rows, want_rows)
    torch.testing.assert_close(summed, want, rtol=1e-5, atol=1e-6)


def test_accumulate_rows_handles_no_ids():
    rows, summed = row_updates.accumulate_rows(torch.zeros(0, dtype=torch.long), torch.zeros(3, 4), torch.zeros(0))
    assert rows.numel() == 0 and summed.shape == (0, 4)


def test_accumulate_rows_is_deterministic():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 5, (5000,), generator=g)  # many repeats per row: order matters in fp32
    grad = torch.randn(5000, 8, generator=g)
    a = row_updates.accumulate_rows(ids, grad, num_rows=5)[1]
    b = row_updates.accumulate_rows(ids, grad, num_rows=5)[1]
    assert torch.equal(a, b)


def test_write_rows_wide_and_narrow_agree():
    base = torch.randn(40, 12)  # 12 fp32 = 48 bytes: copied as complex128 words
    rows = torch.tensor([3, 0, 39, 17])
    values = torch.randn(4, 12)
    wide, plain = base.clone(), base.clone()
    row_updates.write_rows(wide, rows, values)
    plain[rows] = values
    assert torch.equal(wide, plain)
    odd = torch.randn(40, 6)[:, :5]  # strided rows take the element-wise path
    row_updates.write_rows(odd, rows, values[:, :5])
    assert torch.equal(odd[rows], values[:, :5])
