"""quantize: stream-convert giant MoE checkpoints to compressed-tensors INT4."""

import os
from pathlib import Path

__version__ = "0.1.0"


def cache_root() -> Path:
    """What quantize keeps between runs (baseline eval results, the holds of Hub repos being released):
    QUANTIZE_CACHE, else ~/.cache/quantize."""
    return Path(os.environ.get("QUANTIZE_CACHE", Path.home() / ".cache" / "quantize"))
