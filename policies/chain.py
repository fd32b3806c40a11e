"""Expected accepted length of a chain draft, shared by the controller and the simulator.

Position ``k`` of a chain is reached only if every position before it was
accepted, so with per-position conditional acceptance ``α_k``

    E[τ | chain of depth d] = Σ_{k≤d} Π_{j≤k} α_j

(docs/design.md §3; ``τ`` counts accepted draft tokens, the bonus token excluded).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def expected_chain_accepted(alpha: Sequence[float] | np.ndarray, depth: int | None = None) -> float:
    """``E[τ | d] = Σ_{k≤d} Π_{j≤k} α_j``; ``depth`` None: the whole of ``alpha``.

    >>> round(expected_chain_accepted([0.8, 0.8, 0.8]), 3)
    1.952
    >>> round(expected_chain_accepted([0.5, 0.5, 0.5], depth=2), 3)
    0.75
    """
    return float(np.cumprod(np.asarray(alpha, dtype=np.float64)[:depth]).sum())
