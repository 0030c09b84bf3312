"""``torch.fx.symbolic_trace(JaggedTensor.from_dense_lengths)`` as TorchRec's test_jagged_tensor.py traces it: the
optional weights are one graph node, so the traced function takes them or leaves them out (issue 43)."""

from __future__ import annotations

import torch

from lightning_shardrec.sparse.jagged_tensor import JaggedTensor


def test_a_traced_from_dense_lengths_equals_eager_with_and_without_weights() -> None:
    gm = torch.fx.symbolic_trace(JaggedTensor.from_dense_lengths)
    values, lengths = torch.arange(12.0).view(4, 3), torch.IntTensor([1, 0, 2, 3])
    plain = gm(values=values, lengths=lengths)
    assert plain.values().tolist() == [0.0, 6.0, 7.0, 9.0, 10.0, 11.0] and plain.weights_or_none() is None
    assert torch.equal(plain.lengths(), lengths)
    weighted = gm(values=values, lengths=lengths, weights=values * 2)
    eager = JaggedTensor.from_dense_lengths(values, lengths, values * 2)
    assert torch.equal(weighted.values(), eager.values()) and torch.equal(weighted.weights(), eager.weights())
    assert weighted.weights().tolist() == [0.0, 12.0, 14.0, 18.0, 20.0, 22.0]
