"""TorchRec's remaining methods and arguments of the sparse types, and ``str()`` in TorchRec's layout."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_shardrec import JaggedTensor, KeyedJaggedTensor, KeyedTensor

T = torch.tensor


@pytest.fixture
def kjt() -> KeyedJaggedTensor:
    # a=[[1.0, 2.0], [], [3.0]]  b=[[4.0], [5.0], [6.0, 7.0, 8.0]]
    return KeyedJaggedTensor(
        ["a", "b"], T([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]), offsets=T([0, 2, 2, 3, 4, 5, 8], dtype=torch.int32)
    )


# --- str() --------------------------------------------------------------------------------------
def test_kjt_str(kjt: KeyedJaggedTensor) -> None:
    assert str(kjt) == (
        'KeyedJaggedTensor({\n    "a": [[1.0, 2.0], [], [3.0]],\n    "b": [[4.0], [5.0], [6.0, 7.0, 8.0]]\n})\n'
    )
    assert str(KeyedJaggedTensor([], torch.empty(0))) == "KeyedJaggedTensor()\n"
    assert str(KeyedJaggedTensor(["k"], T([7]), lengths=T([1]))) == 'KeyedJaggedTensor({\n    "k": [[7]]\n})\n'


def test_kjt_str_weighted_and_variable_batch() -> None:
    kjt = KeyedJaggedTensor(
        ["a", "b"],
        T([1.0, 2.0, 3.0]),
        T([0.5, 1.0, 1.5]),
        lengths=T([2, 0, 1]),
        stride_per_key_per_rank=[[1, 1], [1]],
    )
    assert str(kjt) == (
        'KeyedJaggedTensor({\n    "a": {\n        "values": [[1.0, 2.0], []],\n        "weights": [[0.5, 1.0], []]\n'
        '    },\n    "b": {\n        "values": [[3.0]],\n        "weights": [[1.5]]\n    }\n})\n'
    )


def test_jt_str() -> None:
    jt = JaggedTensor(T([1.0, 2.0, 3.0]), lengths=T([1, 0, 2]))
    assert str(jt) == "JaggedTensor({\n    [[1.0], [], [2.0, 3.0]]\n})\n"
    weighted = JaggedTensor(T([1.0, 2.0]), T([0.5, 1.5]), offsets=T([0, 2]))
    assert str(weighted) == 'JaggedTensor({\n    "values": [[1.0, 2.0]],\n    "weights": [[0.5, 1.5]]\n})\n'
    rows = JaggedTensor(T([[1.0, 2.0], [3.0, 4.0]]), lengths=T([1, 0, 1]))
    assert str(rows) == "JaggedTensor({\n    [[[1.0, 2.0]], [], [[3.0, 4.0]]]\n})\n"
    with pytest.raises(ValueError, match=re.escape("cannot print values of 3 dimensions (shape (1, 1, 1)); at most 2")):
        str(JaggedTensor(torch.zeros(1, 1, 1), lengths=T([1])))


def test_kt_str() -> None:
    kt = KeyedTensor.from_tensor_list(["x", "y"], [T([[1.0], [1.0]]), T([[2.0, 3.0], [2.0, 3.0]])])
    assert str(kt) == 'KeyedTensor({\n    "x": [[1.0], [1.0]],\n    "y": [[2.0, 3.0], [2.0, 3.0]]\n})\n'
    assert str(KeyedTensor([], [], torch.empty(0))) == "KeyedTensor()\n"


def test_repr_keeps_the_compact_form(kjt: KeyedJaggedTensor) -> None:
    assert repr(kjt).startswith("KeyedJaggedTensor(stride=3, keys=['a', 'b'])")


# --- KeyedJaggedTensor methods ------------------------------------------------------------------
def test_sync_caches_and_unsync_drops(kjt: KeyedJaggedTensor) -> None:
    assert kjt.length_per_key_or_none() is None and kjt.offset_per_key_or_none() is None
    assert kjt.sync() is kjt
    assert kjt.length_per_key_or_none() == [3, 5] and kjt.offset_per_key_or_none() == [0, 3, 8]
    assert kjt.unsync() is kjt and kjt.length_per_key_or_none() is None


def test_index_and_lengths_offset_per_key(kjt: KeyedJaggedTensor) -> None:
    assert kjt.index_per_key() == {"a": 0, "b": 1}
    assert kjt.lengths_offset_per_key() == [0, 3, 6]
    assert kjt.permute([1, 1]).index_per_key() == {"b": 1}  # a repeated key resolves to its last copy


def test_flatten_lengths(kjt: KeyedJaggedTensor) -> None:
    flat = kjt.flatten_lengths()
    assert flat.lengths().dim() == 1 and torch.equal(flat.lengths(), kjt.lengths())
    assert flat.keys() == kjt.keys() and flat.length_per_key() == [3, 5]


def test_empty_and_empty_like(kjt: KeyedJaggedTensor) -> None:
    empty = KeyedJaggedTensor.empty(is_weighted=True)
    assert empty.values().dtype == torch.int64 and empty.weights().dtype == torch.float32
    assert empty.lengths().dtype == torch.int32 and empty.to_dict() == {}
    like = KeyedJaggedTensor.empty_like(kjt)
    assert like.keys() == [] and like.stride() == 3 and like.values().dtype == torch.float32
    assert like.weights_or_none() is None and like.lengths().dtype == torch.int32
    assert (
        KeyedJaggedTensor.empty(values_dtype=torch.int32, weights_dtype=torch.float16, is_weighted=True).weights().dtype
        == torch.float16
    )


def test_to_converts_only_the_weights_dtype() -> None:
    kjt = KeyedJaggedTensor(["a"], T([1, 2]), T([0.5, 1.5]), lengths=T([2]))
    out = kjt.to(torch.device("cpu"), non_blocking=False, dtype=torch.float64)
    assert out.weights().dtype == torch.float64 and out.values().dtype == torch.int64
    assert out.lengths().dtype == kjt.lengths().dtype


def test_to_dict_compute_offsets(kjt: KeyedJaggedTensor) -> None:
    assert kjt.to_dict()["a"].offsets_or_none().tolist() == [0, 2, 2, 3]  # type: ignore[union-attr]
    lazy = kjt.to_dict(compute_offsets=False)
    assert lazy["a"].offsets_or_none() is None and lazy["a"].offsets().tolist() == [0, 2, 2, 3]


def test_torchrec_constructor_caches_are_accepted_and_checked() -> None:
    kjt = KeyedJaggedTensor(
        ["a", "b"],
        T([1, 2, 3]),
        None,
        T([1, 0, 1, 1]),
        None,
        2,
        None,
        [2, 2],  # stride_per_key
        [1, 2],  # length_per_key
        [0, 2, 4],  # lengths_offset_per_key
        [0, 1, 3],  # offset_per_key
        {"a": 0, "b": 1},  # index_per_key
        None,  # jt_dict
        None,  # inverse_indices
    )
    assert kjt.length_per_key() == [1, 2]
    with pytest.raises(ValueError, match=re.escape("stride_per_key [3, 1] but the batch gives [2, 2]")):
        KeyedJaggedTensor(["a", "b"], T([1, 2, 3]), lengths=T([1, 0, 1, 1]), stride_per_key=[3, 1])
    with pytest.raises(ValueError, match=re.escape("index_per_key {'a': 1, 'b': 0} but the batch gives")):
        KeyedJaggedTensor(["a", "b"], T([1, 2, 3]), lengths=T([1, 0, 1, 1]), index_per_key={"a": 1, "b": 0})


# --- JaggedTensor / KeyedTensor -----------------------------------------------------------------
def test_jt_empty_and_empty_like() -> None:
    jt = JaggedTensor.empty(is_weighted=True, values_dtype=torch.int64, weights_dtype=torch.float16)
    assert jt.values().dtype == torch.int64 and jt.weights().dtype == torch.float16
    assert jt.lengths().dtype == torch.int32 and jt.offsets().numel() == 0
    like = JaggedTensor.empty_like(JaggedTensor(T([1.0]), T([2.0], dtype=torch.float64), lengths=T([1])))
    assert like.values().dtype == torch.float32 and like.weights().dtype == torch.float64
    assert like.lengths().dtype == torch.int64 and like.to_dense() == []


def test_jt_from_dense_lengths_are_int32() -> None:
    assert JaggedTensor.from_dense([T([1.0]), T([2.0, 3.0])]).lengths().dtype == torch.int32


def test_kt_device_and_torchrec_caches() -> None:
    kt = KeyedTensor(["x", "y"], [1, 2], torch.zeros(2, 3), 1, [0, 1, 3], {"x": 0, "y": 1})
    assert kt.device() == torch.device("cpu")
    with pytest.raises(
        ValueError, match=re.escape("KeyedTensor: offset_per_key [0, 2, 3] but length_per_key gives [0, 1, 3]")
    ):
        KeyedTensor(["x", "y"], [1, 2], torch.zeros(2, 3), offset_per_key=[0, 2, 3])
    with pytest.raises(
        ValueError, match=re.escape("KeyedTensor: index_per_key {'x': 1} disagrees with keys ['x', 'y']")
    ):
        KeyedTensor(["x", "y"], [1, 2], torch.zeros(2, 3), index_per_key={"x": 1})


def test_out_of_range_key_indices_raise_index_error_as_torchrec(kjt: KeyedJaggedTensor) -> None:
    with pytest.raises(IndexError, match=re.escape("permute indices [2] outside [0, 2) for keys ['a', 'b']")):
        kjt.permute([0, 2])
    with pytest.raises(IndexError, match=re.escape("split segments [3] must be non-negative and sum to 2 keys")):
        kjt.split([3])


# --- TorchRec's distribution helpers, key indices, to() default ----------------------------------
def test_kjt_dist_helpers_as_torchrec() -> None:
    kjt = KeyedJaggedTensor(["a", "b", "c"], torch.arange(6), torch.ones(6), lengths=T([1, 2, 0, 1, 1, 1]))
    assert kjt.dist_labels() == ["lengths", "values", "weights"]
    assert kjt.dist_splits([2, 1]) == [[4, 2], [4, 2], [4, 2]]  # bags, ids, weights per destination
    lengths, values, weights = kjt.dist_tensors()
    assert lengths.tolist() == [1, 2, 0, 1, 1, 1] and values.tolist() == list(range(6)) and weights.sum() == 6
    assert kjt._key_indices() == {"a": 0, "b": 1, "c": 2}
    vbe = KeyedJaggedTensor(["a", "b"], T([1, 2, 3]), lengths=T([2, 0, 1]), stride_per_key_per_rank=[[2], [1]])
    assert vbe.dist_labels() == ["lengths", "values", "strides"]
    assert vbe.dist_splits([1, 1]) == [[2, 1], [2, 1], [1, 1]]
    assert vbe.dist_tensors()[2].tolist() == [2, 1]
    with pytest.raises(ValueError, match=re.escape("dist_splits: key_splits [1] sum to 1, not 3 keys")):
        kjt.dist_splits([1])


def test_kt_key_indices_and_to_defaults() -> None:
    import inspect

    kt = KeyedTensor.from_tensor_list(["x", "y"], [T([[1.0]]), T([[2.0, 3.0]])])
    assert kt._key_indices() == {"x": 0, "y": 1}
    assert kt.wait() is kt  # a sharded collection's output: already computed
    for cls in (KeyedJaggedTensor, JaggedTensor, KeyedTensor):
        assert inspect.signature(cls.to).parameters["non_blocking"].default is False


def _sources(batches: list[int], weighted: bool, vbe: bool) -> list[KeyedJaggedTensor]:
    """One KJT over keys ``a``, ``b`` per source rank, batch ``batches[r]`` (per key when ``vbe``)."""
    gen = torch.Generator().manual_seed(sum(batches))
    out = []
    for r, b in enumerate(batches):
        strides = [b, b + 1] if vbe else [b, b]
        lengths = torch.randint(0, 3, (sum(strides),), generator=gen)
        n = int(lengths.sum())
        kw = {"stride_per_key_per_rank": [[s] for s in strides]} if vbe else {}
        out.append(
            KeyedJaggedTensor(
                ["a", "b"], torch.arange(n) + 100 * r, torch.rand(n, generator=gen) if weighted else None, lengths, **kw
            )
        )
    return out


@pytest.mark.parametrize("vbe", [False, True])
@pytest.mark.parametrize("batches", [[2, 2, 2], [1, 3, 2]])
@pytest.mark.parametrize("weighted", [False, True])
def test_kjt_dist_init_rebuilds_what_an_all_to_all_delivered(batches: list[int], weighted: bool, vbe: bool) -> None:
    sources = _sources(batches, weighted, vbe)
    received = [torch.cat(parts) for parts in zip(*(s.dist_tensors() for s in sources), strict=True)]
    keys, n_ranks = ["a", "b"], len(sources)
    if vbe or len(set(batches)) == 1:  # one segment per (source, key), put key-major
        recat = T([r * len(keys) + k for k in range(len(keys)) for r in range(n_ranks)])
    else:  # sources' batches differ: one entry per bag
        first = [sum(2 * b for b in batches[:r]) for r in range(n_ranks)]
        recat = T([first[r] + k * batches[r] + i for k in range(2) for r in range(n_ranks) for i in range(batches[r])])
    got = KeyedJaggedTensor.dist_init(keys, received, vbe, n_ranks, recat, None if vbe else batches)
    assert got.keys() == keys and got.variable_stride_per_key() == vbe
    for key in keys:
        want = [bag for s in sources for bag in s[key].to_dense()]
        assert [t.tolist() for t in got[key].to_dense()] == [t.tolist() for t in want]
        if weighted:
            want_w = [w for s in sources for w in s[key].to_dense_weights()]
            assert torch.equal(torch.cat(got[key].to_dense_weights()), torch.cat(want_w))
    if vbe:
        assert got.stride_per_key_per_rank() == [[s.stride_per_key()[k] for s in sources] for k in range(2)]
    else:
        assert got.stride() == sum(batches)
    with pytest.raises(ValueError, match="dist_init: got 1 tensors; expected"):
        KeyedJaggedTensor.dist_init(keys, received[:1], vbe, n_ranks, recat, batches)


def test_kjt_dist_init_without_recat_keeps_the_order() -> None:
    kjt = KeyedJaggedTensor(["a", "b"], torch.arange(4), lengths=T([1, 0, 2, 1]))
    got = KeyedJaggedTensor.dist_init(["a", "b"], kjt.dist_tensors(), False, 1, None, [2])
    assert got.lengths().tolist() == [1, 0, 2, 1] and got.stride() == 2 and got.length_per_key() == [1, 3]
    with pytest.raises(ValueError, match="a fixed batch needs stride_per_rank"):
        KeyedJaggedTensor.dist_init(["a", "b"], kjt.dist_tensors(), False, 1, None, None)


def test_kjt_dist_init_staggered_sources_and_a_wrong_stride_count() -> None:
    # 4 sources of one key with 1, 2, 3, 4 bags, received in TorchRec's staggered order (stagger 2: ranks 0, 2, 1, 3)
    strides = T([1, 2, 3, 4])
    lengths = torch.ones(10, dtype=torch.long)
    got = KeyedJaggedTensor.dist_init(["a"], [lengths, torch.arange(10), strides], True, 4, None, None, stagger=2)
    assert got.stride_per_key_per_rank() == [[1, 3, 2, 4]]
    with pytest.raises(ValueError, match=re.escape("dist_init: 3 strides for 2 workers x 1 keys")):
        KeyedJaggedTensor.dist_init(["a"], [lengths, torch.arange(10), T([1, 2, 3])], True, 2, None, None)
