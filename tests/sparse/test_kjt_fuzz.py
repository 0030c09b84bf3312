"""Fuzz the KeyedJaggedTensor constructors with arbitrary lengths/values/weights/offsets/keys/stride.

Every draw either builds a KJT, and then the KJT is exactly what a plain-Python reference
says the input means (``validate()`` passes; ``to_dict``, ``[key]``, ``split`` and
``permute`` agree with the reference, on the fbgemm and the torch paths; values and
weights may run past the last bag, as in TorchRec), or it raises
``ValueError`` (``ShardRecError``s are ``ValueError``s) with a message. The reference also
decides *whether* the input is valid, so bad input can't slip through. No other
exception type, no crash (negative lengths once aborted the interpreter inside fbgemm's
permute).
"""

from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from lightning_shardrec.sparse import KeyedJaggedTensor, ops

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
INT_DTYPES = [torch.int64, torch.int32, torch.int16, torch.uint8]
INDEX_DTYPES = (torch.int64, torch.int32)


@dataclass
class Case:
    """One drawn input, as plain Python data plus the tensors built from it."""

    keys: list[str]
    lengths: list[int]
    values: list[int]
    weights: list[float] | None
    offsets: list[int] | None  # None: not given
    give_lengths: bool
    stride: int | None
    values_dtype: torch.dtype
    lengths_dtype: torch.dtype
    weights_dtype: torch.dtype
    weights_shape_2d: bool
    ctor: str  # "init" | "from_lengths_sync" | "from_offsets_sync"

    def build(self) -> KeyedJaggedTensor:
        values = torch.tensor(self.values, dtype=torch.int64).to(self.values_dtype)
        lengths = torch.tensor(self.lengths, dtype=torch.int64).to(self.lengths_dtype)
        weights = None
        if self.weights is not None:
            weights = torch.tensor(self.weights, dtype=torch.float32).to(self.weights_dtype)
            if self.weights_shape_2d:
                weights = weights.unsqueeze(1)
        offsets = None if self.offsets is None else torch.tensor(self.offsets, dtype=torch.int64).to(self.lengths_dtype)
        if self.ctor == "from_lengths_sync":
            return KeyedJaggedTensor.from_lengths_sync(self.keys, values, lengths, weights, self.stride)
        if self.ctor == "from_offsets_sync":
            return KeyedJaggedTensor.from_offsets_sync(self.keys, values, offsets, weights, self.stride)  # type: ignore[arg-type]
        return KeyedJaggedTensor(
            self.keys, values, weights, lengths if self.give_lengths else None, offsets, self.stride
        )

    def expected_stride(self) -> int | None:
        """The batch size a valid input implies, or ``None`` when the input is invalid."""
        uses_lengths = self.ctor == "from_lengths_sync" or (self.ctor == "init" and self.give_lengths)
        # empty lengths/offsets of any dtype are accepted (as TorchRec's torch.tensor([]))
        if uses_lengths and self.lengths_dtype not in INDEX_DTYPES and self.lengths:
            return None
        if self.offsets is not None and self.lengths_dtype not in INDEX_DTYPES and self.offsets:
            return None
        if len(set(self.keys)) != len(self.keys):
            return None
        lengths = self.effective_lengths()
        # values (and weights) may run longer than the bags: the tail is ignored
        if lengths is None or any(n < 0 for n in lengths) or sum(lengths) > len(self.values):
            return None
        if self.weights is not None and (self.weights_shape_2d or len(self.weights) < sum(lengths)):
            return None
        if self.offsets is not None and lengths != self.lengths_from_offsets():
            return None
        if self.offsets is not None and self.offsets[0] != 0:
            return None
        k, n = len(self.keys), len(lengths)
        if self.stride is not None:
            return self.stride if self.stride >= 0 and self.stride * k == n else None
        if k == 0:
            return 0 if n == 0 else None
        return n // k if n % k == 0 else None

    def effective_lengths(self) -> list[int] | None:
        """The lengths the constructor sees: given ones, else those of the offsets."""
        uses_lengths = self.ctor == "from_lengths_sync" or (self.ctor == "init" and self.give_lengths)
        if uses_lengths:
            return list(self.lengths)
        return self.lengths_from_offsets()

    def lengths_from_offsets(self) -> list[int] | None:
        if self.offsets is None or len(self.offsets) == 0:
            return None
        return [b - a for a, b in zip(self.offsets, self.offsets[1:], strict=False)]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """Mostly near-valid inputs with one or two things wrong, sometimes garbage."""
    keys = draw(st.lists(st.sampled_from(["a", "b", "c", "d", "user"]), max_size=4))
    stride = draw(st.integers(0, 4))
    n_bags = len(keys) * stride
    if draw(st.booleans()):  # right count of non-negative lengths
        lengths = draw(st.lists(st.integers(0, 4), min_size=n_bags, max_size=n_bags))
    else:
        lengths = draw(st.lists(st.integers(-3, 5), max_size=12))
    total = sum(lengths)
    n_values = total if draw(st.integers(0, 3)) and total >= 0 else draw(st.integers(0, 20))
    values = draw(st.lists(st.integers(0, 120), min_size=n_values, max_size=n_values))
    weights = None
    if draw(st.booleans()):
        n_w = n_values if draw(st.integers(0, 3)) else draw(st.integers(0, 20))
        weights = draw(st.lists(st.floats(-2, 2, width=16), min_size=n_w, max_size=n_w))
    ctor = draw(st.sampled_from(["init", "from_lengths_sync", "from_offsets_sync"]))
    offsets: list[int] | None = None
    give_lengths = True
    if ctor == "from_offsets_sync" or (ctor == "init" and draw(st.booleans())):
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        mutation = draw(st.sampled_from(["none", "none", "shift", "poke", "drop"]))
        if mutation == "shift":
            offsets = [o + draw(st.integers(1, 3)) for o in offsets]
        elif mutation == "poke":
            i = draw(st.integers(0, len(offsets) - 1))
            offsets[i] += draw(st.sampled_from([-2, -1, 1, 2]))
        elif mutation == "drop" and len(offsets) > 1:
            offsets = offsets[:-1]
        give_lengths = ctor == "init" and draw(st.booleans())
    given_stride = draw(st.one_of(st.none(), st.just(stride), st.integers(-1, 5)))
    return Case(
        keys=keys,
        lengths=lengths,
        values=values,
        weights=weights,
        offsets=offsets,
        give_lengths=give_lengths,
        stride=given_stride,
        values_dtype=draw(st.sampled_from([*INT_DTYPES, torch.int64, torch.int64, torch.float32])),
        lengths_dtype=draw(st.sampled_from([torch.int64, torch.int64, torch.int32, torch.int16])),
        weights_dtype=draw(st.sampled_from([torch.float32, torch.float32, torch.float16, torch.bfloat16, torch.int64])),
        weights_shape_2d=draw(st.integers(0, 9)) == 0,
        ctor=ctor,
    )


def reference_bags(case: Case, stride: int) -> dict[str, tuple[list[list[int]], list[list[float]] | None]]:
    """Per key: its bags of ids (and of weights), from plain lists."""
    lengths = case.effective_lengths()
    assert lengths is not None
    out: dict[str, tuple[list[list[int]], list[list[float]] | None]] = {}
    pos = 0
    dtype_max = {torch.uint8: 255, torch.int16: 2**15 - 1}.get(case.values_dtype)
    for i, key in enumerate(case.keys):
        bags, wbags = [], []
        for n in lengths[i * stride : (i + 1) * stride]:
            ids = case.values[pos : pos + n]
            assert dtype_max is None or max(ids, default=0) <= dtype_max
            bags.append(ids)
            if case.weights is not None:
                wbags.append(case.weights[pos : pos + n])
            pos += n
        out[key] = (bags, wbags if case.weights is not None else None)
    return out


def assert_matches(kjt: KeyedJaggedTensor, ref: dict, keys: list[str]) -> None:
    """``kjt`` holds exactly the reference bags of ``keys``, in order, via ``to_dict`` and ``[key]``."""
    assert kjt.keys() == keys
    as_dict = kjt.to_dict()
    assert list(as_dict) == keys
    for key in keys:
        bags, wbags = ref[key]
        for jt in (as_dict[key], kjt[key]):
            assert [b.tolist() for b in jt.to_dense()] == bags
            if wbags is not None:
                got = [w.float().tolist() for w in jt.to_dense_weights()]  # type: ignore[union-attr]
                want = [torch.tensor(w, dtype=kjt.weights().dtype).float().tolist() for w in wbags]
                assert got == want
    assert kjt.length_per_key() == [sum(len(b) for b in ref[k][0]) for k in keys]
    lengths = kjt.lengths().tolist()
    assert kjt.offsets().tolist() == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    assert kjt.offset_per_key()[-1] <= kjt.values().numel()


@pytest.mark.parametrize("use_fbgemm", [True, False], ids=["fbgemm", "torch"])
@SETTINGS
@given(case=cases(), data=st.data())
def test_kjt_is_valid_and_agrees_with_reference_or_raises_value_error(
    case: Case, data: st.DataObject, use_fbgemm: bool
) -> None:
    """Built KJTs match the reference on both op paths; everything else is a ``ValueError``."""
    if use_fbgemm:
        check_case(case, data)
    else:
        with mock.patch.object(ops, "_fbgemm_for", lambda t: False):
            check_case(case, data)


def check_case(case: Case, data: st.DataObject) -> None:
    """Build ``case``; compare the KJT and its ops with the reference, or expect a ``ValueError``."""
    want_stride = case.expected_stride()
    try:
        kjt = case.build()
    except ValueError as e:
        assert str(e), "a ValueError without a message"
        assert want_stride is None, f"valid input rejected: {e}"
        event("rejected")
        return
    assert want_stride is not None, f"invalid input accepted: {case}"
    event("built")
    assert kjt.stride() == want_stride
    kjt.validate()
    ref = reference_bags(case, want_stride)
    assert_matches(kjt, ref, case.keys)

    k = len(case.keys)
    cuts = sorted(data.draw(st.lists(st.integers(0, k), max_size=3)))
    segments = [b - a for a, b in zip([0, *cuts], [*cuts, k], strict=True)]
    start = 0
    for seg, part in zip(segments, kjt.split(segments), strict=True):
        assert part.stride() == want_stride
        assert_matches(part, ref, case.keys[start : start + seg])
        start += seg

    if k:
        indices = data.draw(st.lists(st.integers(0, k - 1), max_size=5))
        permuted = kjt.permute(indices)
        if len(set(indices)) == len(indices):
            assert_matches(permuted, ref, [case.keys[i] for i in indices])
        else:  # repeated keys: compare bag by bag (to_dict would fold the repeats)
            lengths = permuted.lengths().view(len(indices), want_stride) if want_stride else None
            pos = 0
            for j, i in enumerate(indices):
                bags = ref[case.keys[i]][0]
                if lengths is not None:
                    assert lengths[j].tolist() == [len(b) for b in bags]
                n = sum(len(b) for b in bags)
                assert permuted.values()[pos : pos + n].tolist() == [x for b in bags for x in b]
                pos += n
            assert pos == permuted.values().numel()


@SETTINGS
@given(lengths=st.lists(st.integers(-3, 3), min_size=1, max_size=8), at=st.integers(0, 7))
def test_validate_catches_in_place_corruption(lengths: list[int], at: int) -> None:
    """Lengths edited in place after construction: ``validate()`` raises, naming the key, iff one is negative."""
    good = [abs(n) for n in lengths]
    kjt = KeyedJaggedTensor(["x"], torch.zeros(sum(good), dtype=torch.int64), lengths=torch.tensor(good))
    i = at % len(good)
    kjt.lengths()[i] = lengths[i]
    if lengths[i] >= 0:
        kjt.validate()
        return
    with pytest.raises(ValueError, match=rf"negative length {lengths[i]} at key 'x' \(bag {i} of {len(good)}\)"):
        kjt.validate()
