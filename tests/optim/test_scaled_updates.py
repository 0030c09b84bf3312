"""``ScaledTableUpdates`` with a real ``GradScaler`` (CPU), on both kernel backends."""

from __future__ import annotations

import pytest
import torch

from lightning_shardrec import FusedOptimConfig, KeyedJaggedTensor
from lightning_shardrec._fbgemm import fbgemm_available
from lightning_shardrec.kernels import TableSpec, make_kernel
from lightning_shardrec.lightning.training.precision import poison_one_grad
from lightning_shardrec.optim import ScaledTableUpdates

BACKENDS = ["torch"] + (["fbgemm"] if fbgemm_available() else [])
SPECS = [TableSpec(name="t", num_embeddings=9, embedding_dim=4)]
KJT = KeyedJaggedTensor(["f"], torch.tensor([1, 2, 2, 8, 0]), None, torch.tensor([2, 0, 3]))


def kernel(backend: str):
    k = make_kernel(SPECS, [0], FusedOptimConfig(optimizer="sgd", lr=0.5), pooled=True, device="cpu", kernel=backend)
    k.load_weights([torch.arange(36.0).view(9, 4) / 36])
    return k


@pytest.mark.parametrize("backend", BACKENDS)
def test_deferred_update_is_the_unscaled_update(backend: str) -> None:
    plain, scaled = kernel(backend), kernel(backend)
    (plain(KJT) * torch.arange(12.0).view(3, 4)).sum().backward()
    updates = ScaledTableUpdates([scaled])
    (scaled(KJT) * torch.arange(12.0).view(3, 4)).sum().mul(2.0**16).backward()
    torch.testing.assert_close(scaled.split_weights()[0], torch.arange(36.0).view(9, 4) / 36)  # not yet
    assert updates.pending == 1 and float(updates.found_inf()) == 0.0
    updates.apply(2.0**16)
    torch.testing.assert_close(scaled.split_weights()[0], plain.split_weights()[0], rtol=0, atol=0)
    assert updates.pending == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_overflow_is_found_and_discarded(backend: str) -> None:
    k = kernel(backend)
    before = k.split_weights()[0].clone()
    updates = ScaledTableUpdates([k])
    k(KJT).sum().mul(float("inf")).backward()
    assert float(updates.found_inf()) == 1.0
    updates.discard()
    assert updates.skipped_steps == 1 and torch.equal(k.split_weights()[0], before)
    updates.detach()
    k(KJT).sum().backward()  # detached: updates in backward again
    assert not torch.equal(k.split_weights()[0], before)


def test_poisoned_dense_grad_makes_the_scaler_skip_and_back_off() -> None:
    layer = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = layer.weight.detach().clone()
    scaler.scale(layer(torch.ones(2, 3)).sum()).backward()
    assert poison_one_grad(opt, torch.tensor(1.0))
    scaler.step(opt)
    scaler.update()
    assert torch.equal(layer.weight, before) and scaler.get_scale() == 512.0
    assert not poison_one_grad(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1), torch.tensor(1.0))
