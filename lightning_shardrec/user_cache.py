"""Where lightning_shardrec keeps per-machine files: kernel timings, compiled helpers."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/lightning_shardrec``, else ``~/.cache/lightning_shardrec`` (not created here)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lightning_shardrec"
