"""One command that proves the GPU path: ``make gpu-check`` / ``python -m lightning_shardrec.gpu_check``.

On a machine with a GPU it runs in CUDA mode, else in a CPU mode with tiny sizes (CI runs
that one, so the check never rots). Either way it writes ``report.json`` and ``report.md``
to ``$GPU_CHECK_OUT`` (or the folder given, default ``./gpu_check_report``) and exits 1 when
a check fails. Sections: exactness of the collections and every fused optimizer against
plain PyTorch on the device (:mod:`.collections`), the strategy at ``devices=1`` against
no strategy per precision and with the pipeline (:mod:`.trainer`), speed, host syncs per
step and memory (:mod:`.perf`), and what one GPU cannot check. Needs only torch, lightning
and this checkout (no fbgemm, no network); :mod:`.syncs` counts host syncs on either device.
"""

from lightning_shardrec.gpu_check.report import Check, Report, Status
from lightning_shardrec.gpu_check.runner import main, run
from lightning_shardrec.gpu_check.syncs import SyncCount, SyncOps, cuda_syncs

__all__ = ["Check", "Report", "Status", "SyncCount", "SyncOps", "cuda_syncs", "main", "run"]
