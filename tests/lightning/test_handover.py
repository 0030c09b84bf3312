"""The pipeline's stream hand-over reaches every tensor of a batch, custom batch types included."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch

from lightning_shardrec import KeyedJaggedTensor
from lightning_shardrec.lightning.training.handover import hand_over, tensors_in


def kjt() -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([1, 2, 0]), torch.tensor([1, 2]))


class Custom:
    """A batch type with its own ``.to()``: Lightning moves it through that, not apply_to_collection."""

    def __init__(self, dense: torch.Tensor, sparse: KeyedJaggedTensor, meta: dict) -> None:
        self.dense, self.sparse, self.meta, self.name = dense, sparse, meta, "batch"

    def to(self, device: torch.device, non_blocking: bool = False) -> Custom:
        return Custom(
            self.dense.to(device, non_blocking=non_blocking),
            self.sparse.to(device, non_blocking=non_blocking),
            {k: v.to(device, non_blocking=non_blocking) for k, v in self.meta.items()},
        )


class Slotted:
    __slots__ = ("x", "y")

    def __init__(self, x, y) -> None:
        self.x, self.y = x, y


@dataclass
class Holder:
    inner: object
    label: torch.Tensor


Pair = namedtuple("Pair", ["a", "b"])


def test_tensors_in_finds_every_tensor_once():
    dense, w, label, a, s = (torch.full((2,), float(i)) for i in range(5))
    sparse = kjt()
    custom = Custom(dense, sparse, {"w": w, "n": 3})
    batch = Holder(inner=[custom, Pair(a, Slotted(s, custom)), {"again": dense}, "text"], label=label)
    found = list(tensors_in(batch))
    assert len(found) == 6
    assert {id(t) for t in found} == {id(t) for t in (dense, w, label, a, s, sparse)}


def test_tensors_in_skips_classes_functions_modules_and_cycles():
    class Node:
        pass

    node = Node()
    t = torch.ones(1)
    node.self, node.cls, node.fn, node.module, node.t = node, Node, len, torch.nn.Linear(1, 1), t
    assert [id(x) for x in tensors_in(node)] == [id(t)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (stream-ordered allocation)")
def test_hand_over_keeps_a_custom_batch_alive_for_the_compute_stream():
    """Memory of a batch copied on the side stream is not reused while the compute stream may read it."""
    device = torch.device("cuda")
    side = torch.cuda.Stream(device)
    n = 1 << 20
    with torch.cuda.stream(side):
        moved = Custom(torch.ones(n), kjt(), {"w": torch.ones(n)}).to(device, non_blocking=True)
    hand_over(moved, side)
    torch.cuda._sleep(200_000_000)  # the compute stream is busy "reading" the batch
    ptrs = {moved.dense.data_ptr(), moved.meta["w"].data_ptr()}
    del moved
    with torch.cuda.stream(side):
        fresh = [torch.empty(n, device=device) for _ in range(2)]
    assert ptrs.isdisjoint({t.data_ptr() for t in fresh})
    torch.cuda.synchronize()
