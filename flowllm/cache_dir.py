"""Where flowllm keeps what it builds once and reuses: converted models, compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def flowllm_cache_dir() -> Path:
    """The flowllm cache: `$FLOWLLM_CACHE`, else `~/.cache/flowllm` (read at call time)."""
    env = os.environ.get("FLOWLLM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "flowllm"
