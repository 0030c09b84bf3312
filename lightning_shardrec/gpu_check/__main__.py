"""``PYTHONPATH=. GPU_CHECK_OUT=<dir> python -m lightning_shardrec.gpu_check``: see :mod:`.runner`."""

import sys

from lightning_shardrec.gpu_check.runner import main

sys.exit(main())
