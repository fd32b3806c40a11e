"""Accept-length outcomes as censored per-position trials ("cells").

One request-step's outcome is the accepted length ``τ`` (draft tokens
accepted, bonus excluded) at the depth ``d`` and tree shape the policy chose.
Its histogram cannot be compared across steps drafted at different depths:
a step of depth 2 can never show ``τ = 5``, so a batch-size shift that makes
the policy draft shallower would look like drift. The outcome is therefore
read as the sequence of trials it is made of — the same stick-breaking cells
the acceptance model uses (``controller.models.acceptance``): at each level reached,
ranks ``1..r`` of the offered candidates were tried in order of draft
confidence until one was accepted (or all failed). A cell ``(k, r)`` is "the
rank-``r`` candidate at position ``k``"; its success probability ``s[k, r]``
does not depend on the depth or width drafted, only on the stratum. For a
chain of fixed depth the cells are exactly the accept-length histogram
written as a chain of conditional binomials (``P(τ = k) = Π_{j≤k} s_j (1 −
s_{k+1})``), so testing the cells tests the whole histogram, while steps
truncated at other depths simply contribute fewer trials.

An outcome is keyed by ``(accepted_rank, level_candidates)`` tuples (the
wire format of ``RequestStep``); :func:`outcome_key` builds the key from the
chain shorthand too. :func:`key_trials` turns a key into the cells it
succeeded and failed in (the censoring rule, for this module and the
acceptance model alike); :func:`key_bins` into a vector of ``2 × depth ×
width`` counts: successes then failures per cell.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import numpy as np

OutcomeKey = tuple[tuple[int, ...], tuple[int, ...]]


@lru_cache(maxsize=4096)
def chain_key(accepted: int, depth: int) -> OutcomeKey:
    """Key of a chain step: ``accepted`` ones then a rejection (if depth left).

    >>> chain_key(2, 4)
    ((1, 1, 0), (1, 1, 1))
    >>> chain_key(3, 3)
    ((1, 1, 1), (1, 1, 1))
    """
    reached = min(accepted + 1, depth)
    return (1,) * accepted + (0,) * (reached - accepted), (1,) * reached


def outcome_key(
    accepted: int, depth: int, accepted_rank: Sequence[int] = (), level_candidates: Sequence[int] = ()
) -> OutcomeKey:
    """Canonical key of one request-step (chain shorthand when ranks are absent).

    >>> outcome_key(1, 3)
    ((1, 0), (1, 1))
    >>> outcome_key(1, 3, [2, 0], [3, 2])
    ((2, 0), (3, 2))
    """
    if not accepted_rank:
        return chain_key(int(accepted), int(depth))
    return tuple(int(r) for r in accepted_rank), tuple(int(c) for c in level_candidates)


def key_accepted(key: OutcomeKey) -> int:
    """``τ`` of an outcome: the number of levels where a candidate was accepted.

    >>> key_accepted(((2, 1, 0), (3, 2, 2)))
    2
    """
    return sum(1 for r in key[0] if r > 0)


@lru_cache(maxsize=65536)
def key_trials(key: OutcomeKey, max_depth: int, max_width: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The censored trials of one outcome: cells that succeeded, cells that failed.

    The one place the rule lives (the acceptance model's posteriors and the
    drift detectors both count with it). Cell ``(k, r)`` (0-based) is index
    ``k * max_width + r``. At each level reached, ranks before the accepted
    one were offered and refused and the accepted one succeeded; at a level
    where nothing was accepted every offered rank failed. Ranks after the
    accepted one were never tested and stay untouched (censored), as do
    levels past the rejection, levels past ``max_depth`` and ranks past
    ``max_width``. Each cell appears at most once.

    >>> key_trials(((2, 0), (3, 2)), max_depth=2, max_width=3)
    ((1,), (0, 3, 4))
    >>> key_trials(chain_key(2, 4), max_depth=4, max_width=1)  # a chain: τ successes, then one failure
    ((0, 1), (2,))
    """
    won: list[int] = []
    lost: list[int] = []
    ranks, offered = key
    for level, (rank, n_offered) in enumerate(zip(ranks, offered)):
        if level >= max_depth:
            break
        base = level * max_width
        tested = min(n_offered, max_width) if rank == 0 else min(rank, max_width)
        for r in range(tested):
            (won if r + 1 == rank else lost).append(base + r)
    return tuple(won), tuple(lost)


@lru_cache(maxsize=65536)
def key_bins(key: OutcomeKey, max_depth: int, max_width: int) -> np.ndarray:
    """Trials of one outcome (:func:`key_trials`) as ``[2 * max_depth * max_width]``
    counts: successes, then failures; cell ``(k, r)`` at ``k * max_width + r``.

    >>> key_bins(((2, 0), (3, 2)), max_depth=2, max_width=3).reshape(2, 2, 3).tolist()
    [[[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]], [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]]
    """
    cells = max_depth * max_width
    out = np.zeros(2 * cells)
    won, lost = key_trials(key, max_depth, max_width)
    for cell in won:
        out[cell] += 1.0
    for cell in lost:
        out[cells + cell] += 1.0
    out.setflags(write=False)
    return out


def keys_matrix(keys: Sequence[OutcomeKey], max_depth: int, max_width: int) -> np.ndarray:
    """Stack :func:`key_bins` of several keys: ``[len(keys), 2 * cells]``."""
    if not keys:
        return np.zeros((0, 2 * max_depth * max_width))
    return np.stack([key_bins(k, max_depth, max_width) for k in keys])


def sticks(bins: np.ndarray, max_depth: int, max_width: int, prior: float = 0.5) -> np.ndarray:
    """Stick estimates ``s[k, r]`` from summed bins (``[..., 2 * cells]`` → ``[..., depth, width]``).

    A symmetric Beta(``prior``, ``prior``) keeps untested cells at 0.5.

    >>> sticks(np.array([3.0, 1.0, 1.0, 3.0]), 2, 1).round(3).tolist()
    [[0.7], [0.3]]
    """
    cells = max_depth * max_width
    succ = bins[..., :cells]
    fail = bins[..., cells:]
    s = (succ + prior) / (succ + fail + 2 * prior)
    return s.reshape(bins.shape[:-1] + (max_depth, max_width))


def trials(bins: np.ndarray) -> np.ndarray:
    """Trials per cell (successes + failures): ``[..., cells]``."""
    cells = bins.shape[-1] // 2
    return bins[..., :cells] + bins[..., cells:]


def tau_histogram(keys_counts: dict[OutcomeKey, int] | Sequence[tuple[OutcomeKey, int]], max_depth: int) -> list[int]:
    """Histogram of ``τ`` (``max_depth + 1`` bins) from outcome counts.

    >>> tau_histogram({chain_key(0, 2): 3, chain_key(2, 2): 1}, 2)
    [3, 0, 1]
    """
    hist = [0] * (max_depth + 1)
    items = keys_counts.items() if isinstance(keys_counts, dict) else keys_counts
    for key, n in items:
        hist[min(key_accepted(key), max_depth)] += int(n)
    return hist
