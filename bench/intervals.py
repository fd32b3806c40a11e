"""How sure a lockstep's ratios are: a moving-block bootstrap over its rounds.

In a lockstep (``bench.engine``) every live configuration steps once per
round, so configuration k's i-th step ran in round i, beside the others'
i-th steps, under the same load of the machine. A speedup is a ratio of
rates, tokens over seconds summed over a run's steps, and each step's time
is noisy (on the 2-core machine here one CPU step of a 50-150 ms forward
varies by ~10-15 %), so a run of 47 steps carries ~2-3 % of noise in its
rate: at batch 8 a controller that drafted on no step measured 0.971 of
the plain runs of its lockstep. Whether a controller 2 % under the best
static shape is behind or tied needs that noise on the ratio itself.

Resampling rounds, not steps, keeps each round's configurations together,
so what moved them all alike (the machine's load) cancels in every ratio
as it does in the measurement. Rounds are drawn in blocks of consecutive
ones (a step's cost drifts with the context and the rows still live, and
the machine's state lasts longer than a step); the block length is the
cube root of the rounds, the usual rate for a moving-block bootstrap. A
statistic that picks (the best static shape in hindsight) picks again in
every replicate, so the interval carries the luck of the pick too.

Rounds do not hold everything. Each engine also has a speed of its own for
the whole run (where its KV cache and buffers landed in memory, which
caches they share): two plain engines of one lockstep, doing identical
work, differed in rate by 1.8 % RMS over 42 pairs (runs K-P), where the
bootstrap over rounds gave such a pair an interval of 0.3-1.1 % (one
standard deviation). :func:`engine_variance` estimates that per-engine
variance from a run's own identical pairs (what their spread leaves over
the bootstrap's), and ``interval(..., extra_log_var=)`` adds it to a
ratio's replicates: a ratio of two engines carries it twice.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

Series = tuple[np.ndarray, np.ndarray]  # per round: seconds of the step, tokens it emitted (0, 0 after the run ended)


def round_weights(rounds: int, draws: int, rng: np.random.Generator, block: int | None = None) -> np.ndarray:
    """``(draws, rounds)``: how often each round is drawn in each replicate of
    a moving-block bootstrap (blocks of ``block`` consecutive rounds, default
    the cube root of ``rounds``, enough of them to cover ``rounds``).

    >>> w = round_weights(10, 3, np.random.default_rng(0), block=4)
    >>> w.shape, [int(x) for x in w.sum(axis=1)]  # three blocks of 4 per replicate
    ((3, 10), [12, 12, 12])
    """
    if rounds <= 0:
        raise ValueError(f"rounds must be positive, got {rounds}")
    block = max(1, min(rounds, block or round(rounds ** (1 / 3))))
    blocks = -(-rounds // block)
    starts = rng.integers(0, rounds - block + 1, size=(draws, blocks))
    weights = np.zeros((draws, rounds))
    rows = np.repeat(np.arange(draws), blocks)
    for offset in range(block):
        np.add.at(weights, (rows, (starts + offset).ravel()), 1.0)
    return weights


def rates(series: Mapping[str, Series], weights: np.ndarray) -> dict[str, np.ndarray]:
    """Each configuration's tokens per second in each replicate, ``(draws,)``."""
    out, n = {}, weights.shape[1]
    for name, (seconds, tokens) in series.items():
        s, t = _padded(seconds, n), _padded(tokens, n)
        out[name] = (weights @ t) / np.maximum(weights @ s, 1e-12)
    return out


def interval(series: Mapping[str, Series], statistic: Callable[[dict[str, np.ndarray]], np.ndarray],
             draws: int = 2000, level: float = 0.9, seed: int = 0, extra_log_var: float = 0.0) -> tuple[float, float]:
    """The central ``level`` interval of ``statistic`` (rates by name, each
    ``(draws,)`` -> ``(draws,)``) over a moving-block bootstrap of the
    lockstep's rounds; ``extra_log_var``: a variance of the statistic's log
    the rounds do not show (the engines' own speeds, :func:`engine_variance`),
    added to every replicate as normal noise.

    Two configurations that differ only by noise give an interval around 1
    (seeded, so it repeats):

    >>> rng = np.random.default_rng(1)
    >>> steps = {k: (rng.normal(0.1, 0.012, 60), np.ones(60)) for k in ("a", "b")}
    >>> lo, hi = interval(steps, lambda r: r["a"] / r["b"])
    >>> bool(lo < 1.0 < hi), bool(hi - lo < 0.1)
    (True, True)
    """
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    if extra_log_var < 0:
        raise ValueError(f"extra_log_var must be >= 0, got {extra_log_var}")
    rounds = max(len(s) for s, _ in series.values())
    weights = round_weights(rounds, draws, np.random.default_rng(seed))
    values = np.asarray(statistic(rates(series, weights)), dtype=float)
    if extra_log_var:
        values = values * np.exp(np.random.default_rng(seed + 1).normal(0.0, np.sqrt(extra_log_var), values.shape))
    tail = (1.0 - level) / 2.0
    lo, hi = np.quantile(values, [tail, 1.0 - tail])
    return float(lo), float(hi)


def engine_variance(pairs: Sequence[tuple[Series, Series]], draws: int = 2000, seed: int = 0) -> float:
    """Per-engine variance of the log rate that the rounds do not show,
    from ``pairs`` of configurations doing identical work in one lockstep
    each (the plain runs): the mean of each pair's squared log ratio less
    its bootstrap variance, halved (a pair holds two engines), and never
    below 0. A handful of pairs gives a rough figure, better than none.

    >>> rng = np.random.default_rng(2)
    >>> def engine(speed):  # 60 steps of 100 ms at this engine's own speed, 10 % step noise
    ...     return rng.normal(0.1, 0.01, 60) / speed, np.ones(60)
    >>> same = [(engine(1.0), engine(1.0)) for _ in range(40)]
    >>> apart = [(engine(np.exp(rng.normal(0, 0.02))), engine(np.exp(rng.normal(0, 0.02)))) for _ in range(40)]
    >>> round(float(np.sqrt(engine_variance(same))), 3), round(float(np.sqrt(engine_variance(apart))), 3)  # truth 0, 0.02
    (0.0, 0.021)
    """
    if not pairs:
        return 0.0
    excess = []
    for i, (a, b) in enumerate(pairs):
        rates_ab = rates({"a": a, "b": b}, round_weights(max(len(a[0]), len(b[0])), draws,
                                                          np.random.default_rng(seed + i)))
        boot = float(np.var(np.log(rates_ab["a"] / rates_ab["b"])))
        observed = float(np.log((np.sum(a[1]) / np.sum(a[0])) / (np.sum(b[1]) / np.sum(b[0]))))
        excess.append(observed ** 2 - boot)
    return max(0.0, float(np.mean(excess)) / 2.0)


def _padded(values: np.ndarray, n: int) -> np.ndarray:
    v = np.asarray(values, dtype=float)
    return v if len(v) == n else np.concatenate([v, np.zeros(n - len(v))])
