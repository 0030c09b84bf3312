"""Variable batch per key ("VBE"): ``stride_per_key_per_rank`` and ``inverse_indices`` on a KJT.

The layout used throughout: ``user`` has 2 bags (one rank), ``item`` has 4, ``ad`` has 3.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_shardrec import JaggedTensor, KeyedJaggedTensor
from lightning_shardrec.sparse.errors import JaggedAssertionError

T = torch.tensor


def bags(jt: JaggedTensor) -> list[list[int]]:
    return [b.tolist() for b in jt.to_dense()]


@pytest.fixture
def vbe() -> KeyedJaggedTensor:
    # user=[[10], []]  item=[[20], [21, 22, 23], [], [24]]  ad=[[], [30, 31], []]
    return KeyedJaggedTensor(
        keys=["user", "item", "ad"],
        values=T([10, 20, 21, 22, 23, 24, 30, 31]),
        weights=T([1.0, 2.0, 2.1, 2.2, 2.3, 2.4, 3.0, 3.1]),
        lengths=T([1, 0, 1, 3, 0, 1, 0, 2, 0], dtype=torch.int32),
        stride_per_key_per_rank=[[2], [4], [3]],
    )


def test_accessors(vbe: KeyedJaggedTensor) -> None:
    assert vbe.variable_stride_per_key()
    assert vbe.stride_per_key_per_rank() == [[2], [4], [3]]
    assert vbe.stride_per_key() == [2, 4, 3]
    assert vbe.stride() == 4  # the largest per-key batch when no inverse indices say otherwise
    assert vbe.lengths_offset_per_key() == [0, 2, 6, 9]
    assert vbe.length_per_key() == [1, 5, 2]
    assert vbe.offset_per_key() == [0, 1, 6, 8]
    assert vbe.inverse_indices_or_none() is None


def test_fixed_batch_reports_no_variable_stride() -> None:
    kjt = KeyedJaggedTensor(["a", "b"], T([1, 2, 3]), lengths=T([1, 0, 1, 1]))
    assert not kjt.variable_stride_per_key()
    assert kjt.stride_per_key_per_rank() == []
    assert kjt.stride_per_key() == [2, 2]
    assert kjt.lengths_offset_per_key() == [0, 2, 4]


def test_several_ranks_per_key_sum() -> None:
    kjt = KeyedJaggedTensor(
        ["a", "b"], T([1, 2, 3, 4, 5, 6, 7, 8]), lengths=T([2, 0, 1, 1, 1, 3]), stride_per_key_per_rank=[[1, 1], [1, 3]]
    )
    assert kjt.stride_per_key() == [2, 4]
    assert kjt.length_per_key() == [2, 6]
    assert bags(kjt["a"]) == [[1, 2], []]
    assert bags(kjt["b"]) == [[3], [4], [5], [6, 7, 8]]


def test_stride_per_key_per_rank_as_tensor() -> None:
    kjt = KeyedJaggedTensor(["a", "b"], T([1, 2]), lengths=T([1, 1, 0]), stride_per_key_per_rank=T([[1], [2]]))
    assert kjt.stride_per_key_per_rank() == [[1], [2]]


def test_inverse_indices_set_the_stride(vbe: KeyedJaggedTensor) -> None:
    inverse = T([[0, 1, 0, 1, 1], [0, 1, 2, 3, 3], [0, 1, 2, 2, 0]])
    kjt = KeyedJaggedTensor(
        vbe.keys(),
        vbe.values(),
        lengths=vbe.lengths(),
        stride_per_key_per_rank=[[2], [4], [3]],
        inverse_indices=(vbe.keys(), inverse),
    )
    assert kjt.stride() == 5
    keys, tensor = kjt.inverse_indices()
    assert keys == vbe.keys() and torch.equal(tensor, inverse)


def test_inverse_indices_missing_raises_assertion_error(vbe: KeyedJaggedTensor) -> None:
    with pytest.raises(AssertionError, match=re.escape("has no inverse_indices; use inverse_indices_or_none()")):
        vbe.inverse_indices()


def test_getitem_and_to_dict(vbe: KeyedJaggedTensor) -> None:
    assert bags(vbe["user"]) == [[10], []]
    assert bags(vbe["item"]) == [[20], [21, 22, 23], [], [24]]
    jts = vbe.to_dict()
    assert list(jts) == ["user", "item", "ad"]
    assert bags(jts["ad"]) == [[], [30, 31], []]
    assert jts["ad"].weights().tolist() == pytest.approx([3.0, 3.1])
    assert jts["item"].lengths().tolist() == [1, 3, 0, 1]
    assert jts["item"].offsets().tolist() == [0, 1, 4, 4, 5]


def test_split(vbe: KeyedJaggedTensor) -> None:
    a, b, c = vbe.split([1, 0, 2])
    assert a.keys() == ["user"] and b.keys() == [] and c.keys() == ["item", "ad"]
    assert [s.stride() for s in (a, b, c)] == [4, 4, 4]
    assert a.stride_per_key_per_rank() == [[2]] and c.stride_per_key_per_rank() == [[4], [3]]
    assert b.variable_stride_per_key() and b.lengths().numel() == 0 and b.values().numel() == 0
    assert a.lengths().tolist() == [1, 0] and a.values().tolist() == [10]
    assert c.lengths().tolist() == [1, 3, 0, 1, 0, 2, 0]
    assert c.values().tolist() == [20, 21, 22, 23, 24, 30, 31]
    assert c.weights().tolist() == pytest.approx([2.0, 2.1, 2.2, 2.3, 2.4, 3.0, 3.1])
    assert bags(c["ad"]) == [[], [30, 31], []]


def test_permute(vbe: KeyedJaggedTensor) -> None:
    out = vbe.permute([1, 0, 2])
    assert out.keys() == ["item", "user", "ad"]
    assert out.stride_per_key_per_rank() == [[4], [2], [3]]
    assert out.lengths().tolist() == [1, 3, 0, 1, 1, 0, 0, 2, 0]
    assert out.values().tolist() == [20, 21, 22, 23, 24, 10, 30, 31]
    assert out.weights().tolist() == pytest.approx([2.0, 2.1, 2.2, 2.3, 2.4, 1.0, 3.0, 3.1])
    assert out.offset_per_key() == [0, 5, 6, 8]
    assert out.stride() == vbe.stride()


def test_permute_repeats_and_drops(vbe: KeyedJaggedTensor) -> None:
    out = vbe.permute([2, 2, 0])
    assert out.keys() == ["ad", "ad", "user"]
    assert out.stride_per_key() == [3, 3, 2]
    assert out.lengths().tolist() == [0, 2, 0, 0, 2, 0, 1, 0]
    assert out.values().tolist() == [30, 31, 30, 31, 10]


def test_permute_drops_inverse_indices_as_torchrec(vbe: KeyedJaggedTensor) -> None:
    kjt = KeyedJaggedTensor(
        vbe.keys(),
        vbe.values(),
        lengths=vbe.lengths(),
        stride_per_key_per_rank=[[2], [4], [3]],
        inverse_indices=(vbe.keys(), T([[0, 1], [0, 3], [1, 2]])),
    )
    assert kjt.permute([0, 1, 2]).inverse_indices_or_none() is None
    assert all(s.inverse_indices_or_none() is None for s in kjt.split([1, 2]))


def test_from_lengths_and_offsets_sync_agree(vbe: KeyedJaggedTensor) -> None:
    a = KeyedJaggedTensor.from_lengths_sync(
        vbe.keys(), vbe.values(), vbe.lengths(), stride_per_key_per_rank=[[2], [4], [3]]
    )
    b = KeyedJaggedTensor.from_offsets_sync(
        vbe.keys(), vbe.values(), vbe.offsets(), stride_per_key_per_rank=[[2], [4], [3]]
    )
    assert a.length_per_key_or_none() == b.length_per_key_or_none() == [1, 5, 2]
    assert torch.equal(a.lengths(), b.lengths())
    assert a.variable_stride_per_key() and b.variable_stride_per_key()


def test_concat(vbe: KeyedJaggedTensor) -> None:
    a, c = vbe.split([1, 2])
    out = KeyedJaggedTensor.concat([a, c])
    assert out.keys() == vbe.keys()
    assert out.stride_per_key_per_rank() == [[2], [4], [3]]
    assert torch.equal(out.lengths(), vbe.lengths()) and torch.equal(out.values(), vbe.values())


def test_concat_joins_inverse_indices() -> None:
    def one(key: str, stride: int) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(
            [key],
            T(list(range(stride))),
            lengths=T([1] * stride),
            stride_per_key_per_rank=[[stride]],
            inverse_indices=([key], T([[0] * 3])),
        )

    out = KeyedJaggedTensor.concat([one("a", 1), one("b", 2)])
    assert out.inverse_indices()[0] == ["a", "b"]
    assert out.inverse_indices()[1].shape == (2, 3)
    assert out.stride() == 3


def test_concat_mixing_variable_and_fixed_batch(vbe: KeyedJaggedTensor) -> None:
    fixed = KeyedJaggedTensor(["z"], T([1]), lengths=T([1]))
    with pytest.raises(AssertionError, match="cannot mix variable-batch"):
        KeyedJaggedTensor.concat([vbe, fixed])


def test_concat_inverse_indices_on_some_only(vbe: KeyedJaggedTensor) -> None:
    with_inverse = KeyedJaggedTensor(
        ["z"], T([1]), lengths=T([1]), stride_per_key_per_rank=[[1]], inverse_indices=(["z"], T([[0, 0]]))
    )
    with pytest.raises(JaggedAssertionError, match="inverse_indices must be set on all KJTs or on none"):
        unweighted = KeyedJaggedTensor(
            vbe.keys(), vbe.values(), lengths=vbe.lengths(), stride_per_key_per_rank=[[2], [4], [3]]
        )
        KeyedJaggedTensor.concat([unweighted, with_inverse])


def test_to_keeps_vbe_and_moves_inverse(vbe: KeyedJaggedTensor) -> None:
    kjt = KeyedJaggedTensor(
        vbe.keys(),
        vbe.values(),
        vbe.weights(),
        vbe.lengths(),
        stride_per_key_per_rank=[[2], [4], [3]],
        inverse_indices=(vbe.keys(), T([[0, 1], [0, 3], [1, 2]])),
    )
    out = kjt.to("meta", dtype=torch.float16)
    assert out.stride_per_key_per_rank() == [[2], [4], [3]]
    assert out.inverse_indices()[1].device.type == "meta"
    assert out.weights().dtype == torch.float16 and out.values().dtype == torch.int64


def test_empty_like_keeps_batch(vbe: KeyedJaggedTensor) -> None:
    out = KeyedJaggedTensor.empty_like(vbe)
    assert out.keys() == [] and out.variable_stride_per_key()
    assert out.weights().dtype == vbe.weights().dtype and out.lengths().dtype == torch.int32
    assert out.stride() == vbe.stride()


def test_empty_rows() -> None:
    kjt = KeyedJaggedTensor(
        ["a"], T([], dtype=torch.int64), lengths=T([], dtype=torch.int32), stride_per_key_per_rank=[[]]
    )
    assert kjt.stride() == 0 and kjt.lengths().numel() == 0 and kjt.values().numel() == 0


def test_pickle_round_trip(vbe: KeyedJaggedTensor) -> None:
    import pickle

    out = pickle.loads(pickle.dumps(vbe))
    assert out.stride_per_key_per_rank() == vbe.stride_per_key_per_rank()
    assert bags(out["item"]) == bags(vbe["item"])


# --- errors ---------------------------------------------------------------------------------------
def test_stride_per_key_per_rank_total_must_match_lengths() -> None:
    with pytest.raises(
        ValueError, match=re.escape("stride_per_key_per_rank [[1], [1]] describes 2 bags but there are 3 lengths")
    ):
        KeyedJaggedTensor(["a", "b"], T([1, 2]), lengths=T([1, 1, 0]), stride_per_key_per_rank=[[1], [1]])


def test_stride_per_key_per_rank_entries_must_be_non_negative_ints() -> None:
    with pytest.raises(ValueError, match=re.escape("stride_per_key_per_rank entries must be ints >= 0, got row [-1]")):
        KeyedJaggedTensor(["a"], T([1]), lengths=T([1]), stride_per_key_per_rank=[[-1]])
    with pytest.raises(TypeError, match="stride_per_key_per_rank must be a list of lists of ints, got row 3"):
        KeyedJaggedTensor(["a"], T([1]), lengths=T([1]), stride_per_key_per_rank=[3])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="stride_per_key_per_rank must be a list of lists of ints, got 3"):
        KeyedJaggedTensor(["a"], T([1]), lengths=T([1]), stride_per_key_per_rank=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"stride_per_key_per_rank must be a 2-D integer tensor \[keys, ranks\]"):
        KeyedJaggedTensor(["a"], T([1]), lengths=T([1]), stride_per_key_per_rank=T([[1.0]]))


def test_rows_must_match_keys_when_used() -> None:
    kjt = KeyedJaggedTensor(["a", "b", "c"], T([1, 2, 3]), lengths=T([1, 1, 1]), stride_per_key_per_rank=[[2], [1]])
    assert kjt.stride() == 2
    with pytest.raises(AssertionError, match=re.escape("stride_per_key_per_rank has 2 rows for 3 keys")):
        kjt.stride_per_key()


def test_inverse_indices_must_be_a_pair() -> None:
    with pytest.raises(TypeError, match="inverse_indices must be a \\(keys, tensor\\) pair, got Tensor"):
        KeyedJaggedTensor(["a"], T([1]), lengths=T([1]), stride_per_key_per_rank=[[1]], inverse_indices=T([[0]]))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="inverse_indices tensor must hold integer rows, got dtype torch.float32"):
        KeyedJaggedTensor(
            ["a"], T([1]), lengths=T([1]), stride_per_key_per_rank=[[1]], inverse_indices=(["a"], T([[0.0]]))
        )


def test_length_per_key_checked_against_vbe_lengths() -> None:
    with pytest.raises(ValueError, match=re.escape("length_per_key [1, 1] but the lengths give [2, 0]")):
        KeyedJaggedTensor(
            ["a", "b"], T([1, 2]), lengths=T([1, 1, 0]), stride_per_key_per_rank=[[2], [1]], length_per_key=[1, 1]
        )


# --- properties -----------------------------------------------------------------------------------
@st.composite
def vbe_cases(draw: st.DrawFn) -> tuple[KeyedJaggedTensor, dict[str, list[list[int]]]]:
    """A random VBE KJT and, per key, its bags as plain lists."""
    keys = [f"k{i}" for i in range(draw(st.integers(1, 4)))]
    ref: dict[str, list[list[int]]] = {}
    spkpr, lengths, values, next_id = [], [], [], 0
    for key in keys:
        ranks = draw(st.lists(st.integers(0, 3), min_size=1, max_size=3))
        spkpr.append(ranks)
        ref[key] = []
        for _ in range(sum(ranks)):
            n = draw(st.integers(0, 3))
            ref[key].append(list(range(next_id, next_id + n)))
            lengths.append(n)
            values.extend(range(next_id, next_id + n))
            next_id += n
    kjt = KeyedJaggedTensor(
        keys,
        T(values, dtype=torch.int64),
        T(values, dtype=torch.float32),
        T(lengths, dtype=torch.int64),
        stride_per_key_per_rank=spkpr,
    )
    return kjt, ref


def assert_bags(kjt: KeyedJaggedTensor, ref: dict[str, list[list[int]]], keys: list[str]) -> None:
    assert kjt.keys() == keys
    assert kjt.stride_per_key() == [len(ref[k]) for k in keys]
    pos = 0
    for i, key in enumerate(keys):  # bag by bag (keys may repeat after a permute)
        lo, hi = kjt.lengths_offset_per_key()[i], kjt.lengths_offset_per_key()[i + 1]
        assert kjt.lengths()[lo:hi].tolist() == [len(b) for b in ref[key]]
        flat = [x for b in ref[key] for x in b]
        assert kjt.values()[pos : pos + len(flat)].tolist() == flat
        assert kjt.weights()[pos : pos + len(flat)].tolist() == [float(x) for x in flat]
        pos += len(flat)
    assert kjt.offset_per_key()[-1] == pos


@settings(max_examples=60, deadline=None)
@given(case=vbe_cases(), data=st.data())
def test_vbe_lookup_permute_split_concat_match_the_reference(
    case: tuple[KeyedJaggedTensor, dict[str, list[list[int]]]], data: st.DataObject
) -> None:
    kjt, ref = case
    keys = kjt.keys()
    assert_bags(kjt, ref, keys)
    for key, jt in kjt.to_dict().items():
        assert bags(jt) == ref[key] and bags(kjt[key]) == ref[key]
    indices = data.draw(st.lists(st.integers(0, len(keys) - 1), max_size=6))
    assert_bags(kjt.permute(indices), ref, [keys[i] for i in indices])
    cuts = sorted(data.draw(st.lists(st.integers(0, len(keys)), max_size=3)))
    segments = [b - a for a, b in zip([0, *cuts], [*cuts, len(keys)], strict=True)]
    parts = kjt.split(segments)
    start = 0
    for seg, part in zip(segments, parts, strict=True):
        assert part.stride() == kjt.stride()
        assert_bags(part, ref, keys[start : start + seg])
        start += seg
    assert_bags(KeyedJaggedTensor.concat(parts), ref, keys)
