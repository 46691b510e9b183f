"""Where kvbridge keeps what it builds once and reuses: converted GGUF models (loader/cache.py)
and compiled CPU kernels (layers/cpu_kernels.py). Imports nothing of kvbridge, so the layers and
the loader can both ask."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """$KVBRIDGE_CACHE_DIR, else ~/.cache/kvbridge."""
    configured = os.environ.get("KVBRIDGE_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "kvbridge"
