"""Models on embedding collections: ``DLRM``, ``DCNv2`` (plain ``nn.Module`` s) and ``DLRMTask`` (Lightning)."""

from lightning_shardrec.models.dcn import CrossNet, DCNv2
from lightning_shardrec.models.dlrm import DLRM, INTERACTIONS, DLRMTrain
from lightning_shardrec.models.task import ARCHS, OPTIMIZERS, DLRMTask, table_configs

__all__ = ["ARCHS", "CrossNet", "DCNv2", "DLRM", "DLRMTask", "DLRMTrain", "INTERACTIONS", "OPTIMIZERS", "table_configs"]
