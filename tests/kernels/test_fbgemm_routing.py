"""Weight decay fbgemm would get wrong (issue 23 item 5): ``auto`` routes it to the torch
kernel, ``kernel="fbgemm"`` refuses it. Pure logic: no CUDA needed (a ``cuda`` device
object is only compared, never used)."""

from __future__ import annotations

import pytest
import torch

from lightning_shardrec import FusedOptimConfig
from lightning_shardrec.kernels import KernelBackend, TableSpec, choose_backend
from lightning_shardrec.kernels.fbgemm_kernel import FbgemmBatchedEmbedding, fbgemm_weight_decay_reason

CUDA = torch.device("cuda")


@pytest.mark.parametrize(
    "device,name,decay,routed",
    [
        ("cuda", "sgd", 0.1, True),  # fbgemm's exact_sgd ignores it
        ("cuda", "adagrad", 0.1, True),  # exact_adagrad too
        ("cuda", "adam", 0.1, True),  # its adam decays decoupled, adam means L2
        ("cuda", "adamw", 0.1, False),  # decoupled is what adamw means
        ("cuda", "rowwise_adagrad", 0.1, False),  # L2, as configured
        ("cuda", "sgd", 0.0, False),
        ("cuda", "adam", 0.0, False),
        ("cpu", "adagrad", 0.1, True),  # the CPU kernels ignore it
        ("cpu", "rowwise_adagrad", 0.1, True),
        ("cpu", "sgd", 0.0, False),
    ],
)
def test_weight_decay_predicate(device: str, name: str, decay: float, routed: bool) -> None:
    reason = fbgemm_weight_decay_reason(device, FusedOptimConfig(optimizer=name, weight_decay=decay))
    assert (reason is not None) == routed, reason
    if routed:
        assert "weight_decay" in reason and str(decay) in reason


@pytest.mark.needs_fbgemm
@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam"])
def test_auto_routes_decay_fbgemm_would_drop_to_torch_on_cuda(name: str) -> None:
    optim = FusedOptimConfig(optimizer=name, weight_decay=0.01)
    assert choose_backend("auto", CUDA, optim, [8]) is KernelBackend.TORCH


@pytest.mark.needs_fbgemm
@pytest.mark.parametrize(
    "name,match",
    [
        ("sgd", r"kernel='fbgemm' cannot run tables \['t'\]: fbgemm's CUDA sgd ignores weight_decay \(got 0.01\)"),
        ("adagrad", r"fbgemm's CUDA adagrad ignores weight_decay \(got 0.01\)"),
        ("adam", r"fbgemm's CUDA adam decays decoupled \(as adamw\), not L2 as adam does \(weight_decay=0.01\)"),
    ],
)
def test_forced_fbgemm_refuses_decay_it_would_drop(name: str, match: str) -> None:
    optim = FusedOptimConfig(optimizer=name, weight_decay=0.01)
    with pytest.raises(ValueError, match=match):  # raised before any CUDA call
        FbgemmBatchedEmbedding(
            [TableSpec(name="t", num_embeddings=4, embedding_dim=8)], [0], optim, pooled=True, device=CUDA
        )


@pytest.mark.needs_fbgemm
def test_forced_fbgemm_refuses_decay_on_cpu() -> None:
    optim = FusedOptimConfig(optimizer="adagrad", weight_decay=0.5)
    with pytest.raises(ValueError, match=r"fbgemm's CPU kernels ignore weight_decay \(got 0.5\)"):
        FbgemmBatchedEmbedding([TableSpec(name="t", num_embeddings=4, embedding_dim=8)], [0], optim, pooled=True)
