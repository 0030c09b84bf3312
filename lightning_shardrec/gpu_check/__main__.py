"""``PYTHONPATH=. GPU_CHECK_OUT=<dir> python -m lightning_shardrec.gpu_check``: see :mod:`.run`."""

import sys

from lightning_shardrec.gpu_check.run import main

sys.exit(main())
