"""NormalizedEntropy and Calibration against numpy reference formulas, and under distributed sync."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_shardrec.metrics import Calibration, NormalizedEntropy
from lightning_shardrec.testing import run_ranks

RNG = np.random.default_rng(7)
PREDS = RNG.uniform(0.01, 0.99, 200).astype(np.float32).astype(np.float64)
LABELS = (RNG.uniform(size=200) < 0.3).astype(np.float64)
WEIGHTS = RNG.uniform(0.5, 2.0, 200).astype(np.float32).astype(np.float64)  # exact in float32


def ne_reference(p: np.ndarray, y: np.ndarray, w: np.ndarray | None = None) -> float:
    """sklearn-style log loss over the entropy of the base rate."""
    w = np.ones_like(p) if w is None else w
    log_loss = -np.sum(w * (y * np.log(p) + (1 - y) * np.log(1 - p))) / np.sum(w)
    q = np.sum(w * y) / np.sum(w)
    return log_loss / -(q * np.log(q) + (1 - q) * np.log(1 - q))


def calibration_reference(p: np.ndarray, y: np.ndarray, w: np.ndarray | None = None) -> float:
    w = np.ones_like(p) if w is None else w
    return float(np.sum(w * p) / np.sum(w * y))


def t(x: np.ndarray) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


@pytest.mark.parametrize("weighted", [False, True])
def test_ne_and_calibration_match_reference(weighted):
    w = WEIGHTS if weighted else None
    ne, cal = NormalizedEntropy(), Calibration()
    for chunk in np.array_split(np.arange(200), 3):  # batches accumulate
        kw = {"weight": t(w[chunk])} if weighted else {}
        ne.update(t(PREDS[chunk]), t(LABELS[chunk]), **kw)
        cal.update(t(PREDS[chunk]), t(LABELS[chunk]), **kw)
    assert ne.compute().item() == pytest.approx(ne_reference(PREDS, LABELS, w), rel=1e-9)
    assert cal.compute().item() == pytest.approx(calibration_reference(PREDS, LABELS, w), rel=1e-9)


def test_ne_of_base_rate_is_one_and_clamps_extremes():
    ne = NormalizedEntropy()
    y = torch.tensor([1.0, 0.0, 0.0, 0.0])
    ne.update(torch.full((4,), 0.25), y)
    assert ne.compute().item() == pytest.approx(1.0)
    ne.reset()
    ne.update(torch.tensor([0.0, 1.0]), torch.tensor([1.0, 0.0]))  # confidently wrong: finite thanks to eta
    assert np.isfinite(ne.compute().item()) and ne.compute().item() > 10


def test_metric_input_errors():
    with pytest.raises(ValueError, match=r"NormalizedEntropy.update: preds \(3,\) and target \(2,\) differ in shape"):
        NormalizedEntropy().update(torch.zeros(3), torch.zeros(2))
    with pytest.raises(ValueError, match=r"Calibration.update: weight \(2,\) and preds \(3,\) differ in shape"):
        Calibration().update(torch.zeros(3), torch.zeros(3), torch.ones(2))
    with pytest.raises(ValueError, match=r"NormalizedEntropy: eta must be in \(0, 0.5\), got 0.7"):
        NormalizedEntropy(eta=0.7)


def _sync(rank, world):
    ne, cal = NormalizedEntropy(), Calibration()
    rows = np.array_split(np.arange(200), world)[rank]  # uneven halves on purpose
    ne.update(t(PREDS[rows]), t(LABELS[rows]), t(WEIGHTS[rows]))
    cal.update(t(PREDS[rows]), t(LABELS[rows]), t(WEIGHTS[rows]))
    return ne.compute().item(), cal.compute().item()


def test_distributed_compute_equals_one_pass():
    for ne, cal in run_ranks(_sync, 3):
        assert ne == pytest.approx(ne_reference(PREDS, LABELS, WEIGHTS), rel=1e-9)
        assert cal == pytest.approx(calibration_reference(PREDS, LABELS, WEIGHTS), rel=1e-9)
