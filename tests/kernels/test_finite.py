"""FiniteGuard: a NaN/inf on its way into (or out of) a fused update is caught, naming the table."""

from __future__ import annotations

import pytest
import torch

from lightning_shardrec import FusedOptimConfig, KeyedJaggedTensor
from lightning_shardrec._fbgemm import fbgemm_available
from lightning_shardrec.errors import NonFiniteError
from lightning_shardrec.kernels import TableSpec, make_kernel
from lightning_shardrec.kernels.finite import FiniteGuard, check_loss

BACKENDS = ["torch"] + (["fbgemm"] if fbgemm_available() else [])
SPECS = [
    TableSpec(name="users", num_embeddings=10, embedding_dim=4),
    TableSpec(name="items", num_embeddings=6, embedding_dim=4),
]


def setup(backend, pooled=True, optimizer="sgd", lr=0.1):
    kernel = make_kernel(
        SPECS, [0, 1], FusedOptimConfig(optimizer=optimizer, lr=lr), pooled=pooled, device="cpu", kernel=backend
    )
    for w in kernel.split_weights():
        torch.nn.init.uniform_(w, -0.5, 0.5)
    kjt = KeyedJaggedTensor(["u", "i"], torch.tensor([1, 2, 3, 0, 5]), lengths=torch.tensor([2, 1, 1, 1]))
    return kernel, kjt, FiniteGuard([kernel])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pooled", [True, False])
def test_nan_gradient_names_the_table_and_leaves_it_untouched(backend, pooled):
    kernel, kjt, guard = setup(backend, pooled)
    before = [w.clone() for w in kernel.split_weights()]
    out = kernel(kjt)
    grad = torch.ones_like(out)
    if pooled:
        grad[1, 4:] = float("nan")  # sample 1, feature 'i' -> table 'items'
    else:
        grad[4] = float("nan")  # the last id belongs to feature 'i'
    with pytest.raises(NonFiniteError, match=r"table 'items' \(feature 'i'\).*holds nan.*not updated"):
        out.backward(grad)
    for w, b in zip(kernel.split_weights(), before, strict=True):
        assert torch.equal(w, b)
    guard.remove()


@pytest.mark.parametrize("backend", BACKENDS)
def test_overflowing_update_is_caught_after_backward(backend):
    kernel, kjt, guard = setup(backend, lr=1e38)
    out = kernel(kjt)
    out.backward(torch.full_like(out, 1e10))  # finite gradient, the sgd step overflows
    match = r"table 'users' \(feature 'u'\): row \d+ is non-finite after its fused sgd"
    with pytest.raises(NonFiniteError, match=match):
        guard.check_rows()


@pytest.mark.parametrize("backend", BACKENDS)
def test_finite_training_passes_and_guard_removes_cleanly(backend):
    kernel, kjt, guard = setup(backend, optimizer="adagrad")
    for _ in range(3):
        out = kernel(kjt)
        out.sum().backward()
        guard.check_rows()
    with torch.no_grad():
        kernel(kjt)  # no grad: nothing recorded
    assert guard._batches == []
    guard.remove()
    out = kernel(kjt)
    out.backward(torch.full_like(out, float("nan")))  # unguarded: no check any more
    assert not torch.isfinite(kernel.split_weights()[0]).all()


def test_check_loss():
    check_loss(torch.tensor(0.5), 3)
    with pytest.raises(NonFiniteError, match="the loss is nan at step 3"):
        check_loss(torch.tensor(float("nan")), 3)
