"""Recommendation metrics (torchmetrics): normalized entropy and calibration; AUROC is torchmetrics'."""

from lightning_shardrec.metrics.rec import Calibration, NormalizedEntropy

__all__ = ["Calibration", "NormalizedEntropy"]
