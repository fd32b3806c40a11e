"""Where the reference worker keeps what it builds once per machine.

``$XDG_CACHE_HOME/specctl`` (``~/.cache/specctl`` when unset) holds one
folder per kind: converted models (``models/``), tuned kernel tables
(``kernels/``), trained draft heads (``heads/``) and distillation data
(``distill/``). A module of its own so that the model loader, the kernel
tuner and the head trainer all find it without importing each other.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(kind: str) -> Path:
    """``$XDG_CACHE_HOME/specctl/<kind>`` (not created here)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specctl" / kind
