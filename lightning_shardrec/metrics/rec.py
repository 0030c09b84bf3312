"""Recommendation metrics as torchmetrics ``Metric`` s; states are sums, so a
distributed ``compute()`` (``dist_reduce_fx="sum"``) equals one pass over all ranks' rows.

With predicted click probabilities ``p_i``, labels ``y_i`` and weights ``w_i`` (default 1):

- normalized entropy (He et al. 2014)::

      NE = (sum_i w_i CE(p_i, y_i) / sum_i w_i) / H(q),   q = sum_i w_i y_i / sum_i w_i
      CE(p, y) = -y log(max(p, eta)) - (1 - y) log(max(1 - p, eta))
      H(q) = -q log q - (1 - q) log(1 - q)

  1.0 is as good as always predicting the base rate ``q``; lower is better.
- calibration: ``sum_i w_i p_i / sum_i w_i y_i`` (1.0 is calibrated).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric


def _check(owner: str, preds: Tensor, target: Tensor, weight: Tensor | None) -> Tensor:
    if preds.shape != target.shape:
        raise ValueError(f"{owner}.update: preds {tuple(preds.shape)} and target {tuple(target.shape)} differ in shape")
    if weight is None:
        return torch.ones_like(preds, dtype=torch.float64)
    if weight.shape != preds.shape:
        raise ValueError(f"{owner}.update: weight {tuple(weight.shape)} and preds {tuple(preds.shape)} differ in shape")
    return weight.double()


class NormalizedEntropy(Metric):
    """Normalized entropy of click probabilities ``preds [N]`` against labels ``target [N]``.

    ``eta`` clamps probabilities away from 0 and 1 as TorchRec's NE does.
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False
    cross_entropy_sum: Tensor
    weighted_num_samples: Tensor
    pos_labels: Tensor

    def __init__(self, eta: float = 1e-12, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        if not 0.0 < eta < 0.5:
            raise ValueError(f"NormalizedEntropy: eta must be in (0, 0.5), got {eta!r}")
        self.eta = eta
        for name in ("cross_entropy_sum", "weighted_num_samples", "pos_labels"):
            self.add_state(name, default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, preds: Tensor, target: Tensor, weight: Tensor | None = None) -> None:
        """Add a batch: ``preds`` probabilities in ``[0, 1]``, ``target`` labels in ``[0, 1]``, same shape."""
        w = _check("NormalizedEntropy", preds, target, weight)
        p, y = preds.detach().double(), target.detach().double()
        ce = -y * p.clamp(min=self.eta).log() - (1 - y) * (1 - p).clamp(min=self.eta).log()
        self.cross_entropy_sum += (w * ce).sum()
        self.weighted_num_samples += w.sum()
        self.pos_labels += (w * y).sum()

    def compute(self) -> Tensor:
        """NE as a float64 scalar (``nan`` before any sample, ``inf`` when every label is the same)."""
        n = self.weighted_num_samples
        q = self.pos_labels / n
        base = -q * q.clamp(min=self.eta).log() - (1 - q) * (1 - q).clamp(min=self.eta).log()
        return (self.cross_entropy_sum / n) / base


class Calibration(Metric):
    """``sum(w * preds) / sum(w * target)``: predicted over observed clicks (1.0 is calibrated)."""

    is_differentiable = False
    higher_is_better = None
    full_state_update = False
    weighted_preds: Tensor
    weighted_labels: Tensor

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        for name in ("weighted_preds", "weighted_labels"):
            self.add_state(name, default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, preds: Tensor, target: Tensor, weight: Tensor | None = None) -> None:
        """Add a batch: ``preds`` probabilities ``[N]``, ``target`` labels ``[N]``."""
        w = _check("Calibration", preds, target, weight)
        self.weighted_preds += (w * preds.detach().double()).sum()
        self.weighted_labels += (w * target.detach().double()).sum()

    def compute(self) -> Tensor:
        """Calibration as a float64 scalar (``nan`` before any sample, ``inf`` with no positive label)."""
        return self.weighted_preds / self.weighted_labels
