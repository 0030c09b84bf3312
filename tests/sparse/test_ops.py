"""Jagged primitives in ``lightning_shardrec.sparse.ops``: worked examples, and the
fbgemm operators pinned against the plain-torch fallback."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_shardrec import _fbgemm
from lightning_shardrec.sparse import ops

needs_fbgemm = pytest.mark.needs_fbgemm
BOTH_PATHS = [False, pytest.param(True, marks=needs_fbgemm, id="fbgemm")]
PROPS = settings(max_examples=50, deadline=None)


# --- complete_cumsum ------------------------------------------------------------------
@pytest.mark.parametrize("use_fbgemm", BOTH_PATHS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_complete_cumsum_example(use_fbgemm: bool, dtype: torch.dtype) -> None:
    out = ops.complete_cumsum(torch.tensor([2, 0, 1, 3], dtype=dtype), use_fbgemm=use_fbgemm)
    assert out.tolist() == [0, 2, 2, 3, 6]
    assert out.dtype == dtype


@pytest.mark.parametrize("use_fbgemm", BOTH_PATHS)
def test_complete_cumsum_empty_is_single_zero(use_fbgemm: bool) -> None:
    out = ops.complete_cumsum(torch.empty(0, dtype=torch.int64), use_fbgemm=use_fbgemm)
    assert out.tolist() == [0]


# --- gather_index / segment_ids ------------------------------------------------------
def test_gather_index_concatenates_ranges() -> None:
    out = ops.gather_index(torch.tensor([5, 0, 9]), torch.tensor([2, 3, 0]))
    assert out.tolist() == [5, 6, 0, 1, 2]


def test_segment_ids_skips_empty_bags() -> None:
    assert ops.segment_ids(torch.tensor([2, 0, 1])).tolist() == [0, 0, 2]


# --- permute_2d ------------------------------------------------------------------------
# None: the automatic choice, on CPU with few keys the key-by-key host copy
PERMUTE_PATHS = [pytest.param(None, id="auto"), *BOTH_PATHS]


@pytest.mark.parametrize("use_fbgemm", PERMUTE_PATHS)
def test_permute_2d_reorders_drops_and_repeats_keys(use_fbgemm: bool) -> None:
    # keys a, b, c with batch 2:  a=[[1], [2, 3]]  b=[[], [4]]  c=[[5, 6], []]
    lengths = torch.tensor([[1, 2], [0, 1], [2, 0]])
    values = torch.tensor([1, 2, 3, 4, 5, 6])
    weights = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    out_l, out_v, out_w = ops.permute_2d(
        torch.tensor([2, 0, 2]), lengths, values, weights, use_fbgemm=use_fbgemm
    )  # c, a, c  (b dropped, c repeated)
    assert out_l.tolist() == [[2, 0], [1, 2], [2, 0]]
    assert out_v.tolist() == [5, 6, 1, 2, 3, 5, 6]
    assert out_w is not None
    torch.testing.assert_close(out_w, torch.tensor([0.5, 0.6, 0.1, 0.2, 0.3, 0.5, 0.6]))


@pytest.mark.parametrize("use_fbgemm", PERMUTE_PATHS)
def test_permute_2d_without_weights_returns_none(use_fbgemm: bool) -> None:
    _, values, weights = ops.permute_2d(
        torch.tensor([1, 0]),
        torch.tensor([[1], [2]]),
        torch.tensor([7, 8, 9]),
        use_fbgemm=use_fbgemm,
    )
    assert values.tolist() == [8, 9, 7]
    assert weights is None


@PROPS
@given(
    keys=st.integers(1, 9),
    batch=st.integers(0, 5),
    order=st.lists(st.integers(0, 8), max_size=12),
    weighted=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_permute_2d_host_copy_equals_the_gather(
    keys: int, batch: int, order: list[int], weighted: bool, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (keys, batch), generator=g, dtype=torch.int32)
    values = torch.randint(0, 100, (int(lengths.sum()),), generator=g)
    weights = torch.rand(values.shape, generator=g) if weighted else None
    permute = torch.tensor([k % keys for k in order], dtype=torch.long)
    got = ops._permute_2d_slices(permute, lengths, values, weights)
    want = ops.permute_2d(permute, lengths, values, weights, use_fbgemm=False)
    for a, b in zip(got, want, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)  # type: ignore[arg-type]


def test_permute_2d_takes_the_host_copy_on_cpu_with_few_keys_of_many_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = ops._permute_2d_slices
    monkeypatch.setattr(ops, "_permute_2d_slices", lambda p, *a: calls.append(p.numel()) or real(p, *a))
    few, many, ids = ops.SLICES_UP_TO, ops.SLICES_UP_TO + 1, ops.SLICE_MIN_IDS_PER_KEY
    for k, per_key in ((few, ids), (many, ids), (few, ids - 1)):  # one bag a key
        ops.permute_2d(torch.arange(k).flip(0), torch.full((k, 1), per_key), torch.arange(k * per_key))
    assert calls == [few]  # above either bound: fbgemm's operator or torch's gather, never a key-by-key loop


# --- jagged_to_padded_dense ------------------------------------------------------------
@pytest.mark.parametrize("use_fbgemm", BOTH_PATHS)
def test_jagged_to_padded_dense_torchrec_docstring_example(use_fbgemm: bool) -> None:
    # The example from TorchRec's JaggedTensor.to_padded_dense docstring.
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
    offsets = torch.tensor([0, 2, 2, 3, 4, 5, 8], dtype=torch.int32)
    out = ops.jagged_to_padded_dense(values, offsets, 2, 10.0, use_fbgemm=use_fbgemm)
    expected = [[1, 2], [10, 10], [3, 10], [4, 10], [5, 10], [6, 7]]
    assert out.tolist() == expected


@pytest.mark.parametrize("use_fbgemm", BOTH_PATHS)
def test_jagged_to_padded_dense_2d_values(use_fbgemm: bool) -> None:
    values = torch.arange(6.0).view(3, 2)  # three rows of D=2
    out = ops.jagged_to_padded_dense(values, torch.tensor([0, 2, 2, 3]), 3, -1.0, use_fbgemm=use_fbgemm)
    assert out.shape == (3, 3, 2)
    assert out[0].tolist() == [[0, 1], [2, 3], [-1, -1]]
    assert out[1].tolist() == [[-1, -1]] * 3
    assert out[2].tolist() == [[4, 5], [-1, -1], [-1, -1]]


def test_jagged_to_padded_dense_integer_values_keep_dtype() -> None:
    out = ops.jagged_to_padded_dense(torch.tensor([4, 5, 6]), torch.tensor([0, 1, 3]), 3, 7)
    assert out.dtype == torch.int64
    assert out.tolist() == [[4, 7, 7], [5, 6, 7]]


# --- fbgemm vs torch, property-based ----------------------------------------------------
@st.composite
def key_major_batches(
    draw: st.DrawFn,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(permute [K'], lengths [K, B], values [N], weights [N])."""
    num_keys = draw(st.integers(1, 5))
    batch = draw(st.integers(0, 4))
    n = num_keys * batch
    lengths = torch.tensor(draw(st.lists(st.integers(0, 4), min_size=n, max_size=n)), dtype=torch.int64)
    lengths = lengths.view(num_keys, batch)
    total = int(lengths.sum())
    values = torch.tensor(draw(st.lists(st.integers(0, 10**6), min_size=total, max_size=total)), dtype=torch.int64)
    weights = torch.tensor(
        draw(st.lists(st.floats(-10, 10, width=32), min_size=total, max_size=total)),
        dtype=torch.float32,
    )
    permute = torch.tensor(draw(st.lists(st.integers(0, num_keys - 1), min_size=0, max_size=7)), dtype=torch.int64)
    return permute, lengths, values, weights


@needs_fbgemm
@PROPS
@given(st.lists(st.integers(0, 1000), max_size=20), st.sampled_from([torch.int32, torch.int64]))
def test_complete_cumsum_fbgemm_matches_torch(lengths: list[int], dtype: torch.dtype) -> None:
    t = torch.tensor(lengths, dtype=dtype)
    torch.testing.assert_close(
        ops.complete_cumsum(t, use_fbgemm=True),
        ops.complete_cumsum(t, use_fbgemm=False),
        rtol=0,
        atol=0,
    )


@needs_fbgemm
@PROPS
@given(key_major_batches(), st.booleans())
def test_permute_2d_fbgemm_matches_torch(batch: tuple, weighted: bool) -> None:
    permute, lengths, values, weights = batch
    w = weights if weighted else None
    fb = ops.permute_2d(permute, lengths, values, w, use_fbgemm=True)
    pt = ops.permute_2d(permute, lengths, values, w, use_fbgemm=False)
    assert torch.equal(fb[0], pt[0])
    assert torch.equal(fb[1], pt[1])
    if weighted:
        assert torch.equal(fb[2], pt[2])
    else:
        assert fb[2] is None and pt[2] is None


@needs_fbgemm
@PROPS
@given(
    st.lists(st.integers(0, 5), max_size=8),
    st.integers(0, 6),
    st.sampled_from([1, 3]),
    st.floats(-5, 5, width=32),
)
def test_jagged_to_padded_dense_fbgemm_matches_torch(
    lengths: list[int], max_length: int, dim: int, padding: float
) -> None:
    offsets = ops.complete_cumsum(torch.tensor(lengths, dtype=torch.int64), use_fbgemm=False)
    values = torch.randn(int(offsets[-1]), dim)
    if dim == 1:
        values = values.view(-1)  # exercise the 1-D path as well
    fb = ops.jagged_to_padded_dense(values, offsets, max_length, padding, use_fbgemm=True)
    pt = ops.jagged_to_padded_dense(values, offsets, max_length, padding, use_fbgemm=False)
    assert fb.shape == pt.shape == (len(lengths), max_length, *([] if dim == 1 else [dim]))
    assert torch.equal(fb, pt)


@PROPS
@given(key_major_batches())
def test_permute_2d_torch_matches_per_key_reference(batch: tuple) -> None:
    """The fallback against a loop over keys (runs without fbgemm too)."""
    permute, lengths, values, weights = batch
    out_l, out_v, out_w = ops.permute_2d(permute, lengths, values, weights, use_fbgemm=False)
    per_key = torch.split(values, lengths.sum(1).tolist())
    per_key_w = torch.split(weights, lengths.sum(1).tolist())
    idx = permute.tolist()
    assert out_l.tolist() == [lengths[i].tolist() for i in idx]
    assert out_v.tolist() == [v for i in idx for v in per_key[i].tolist()]
    assert out_w is not None
    assert out_w.tolist() == [w for i in idx for w in per_key_w[i].tolist()]


# --- the fbgemm switch ---------------------------------------------------------------------
def test_disable_env_var_forces_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_SHARDREC_DISABLE_FBGEMM", "1")
    _fbgemm._load.cache_clear()
    try:
        assert not _fbgemm.fbgemm_available()
        assert not _fbgemm.fbgemm_ops_on("cpu")
        # the default (use_fbgemm=None) path still gives the documented result
        assert ops.complete_cumsum(torch.tensor([2, 0, 1])).tolist() == [0, 2, 2, 3]
    finally:
        _fbgemm._load.cache_clear()  # recomputed under the restored environment


def test_fbgemm_ops_never_claim_meta_device() -> None:
    assert not _fbgemm.fbgemm_ops_on("meta")
