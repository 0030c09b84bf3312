"""``size_in_bytes()`` of the sparse types: the bytes of the tensors each holds (TorchRec's meaning)."""

from __future__ import annotations

import torch

from lightning_shardrec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor


def test_jagged_tensor_counts_values_weights_and_lengths() -> None:
    values = torch.arange(5, dtype=torch.int64)  # 40 bytes
    weights = torch.ones(5)  # 20 bytes
    lengths = torch.tensor([2, 0, 3], dtype=torch.int32)  # 12 bytes
    jt = JaggedTensor(values, weights, lengths=lengths)
    assert jt.size_in_bytes() == 40 + 20 + 12
    assert JaggedTensor(values, lengths=lengths).size_in_bytes() == 40 + 12


def test_jagged_tensor_counts_offsets_once_held() -> None:
    jt = JaggedTensor(torch.arange(5, dtype=torch.int64), lengths=torch.tensor([2, 0, 3], dtype=torch.int64))
    assert jt.size_in_bytes() == 40 + 24
    jt.offsets()  # now held too: 4 int64 offsets
    assert jt.size_in_bytes() == 40 + 24 + 32


def test_keyed_jagged_tensor_counts_its_tensors() -> None:
    kjt = KeyedJaggedTensor(
        keys=["f1", "f2"],
        values=torch.arange(6, dtype=torch.int32),  # 24 bytes
        weights=torch.ones(6, dtype=torch.float64),  # 48 bytes
        offsets=torch.tensor([0, 2, 3, 5, 6], dtype=torch.int64),  # 40 bytes
    )
    assert kjt.size_in_bytes() == 24 + 48 + 40
    kjt.lengths()  # 4 int64 lengths computed and held
    assert kjt.size_in_bytes() == 24 + 48 + 40 + 32


def test_keyed_tensor_counts_values() -> None:
    kt = KeyedTensor.from_tensor_list(["a", "b"], [torch.zeros(4, 2), torch.zeros(4, 3, dtype=torch.float64)])
    assert kt.values().dtype == torch.float64  # cat promotes
    assert kt.size_in_bytes() == 4 * 5 * 8
    assert KeyedTensor(["a"], [3], torch.zeros(2, 3, dtype=torch.bfloat16)).size_in_bytes() == 2 * 3 * 2
