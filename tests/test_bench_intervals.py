"""bench.intervals: the moving-block bootstrap over a lockstep's rounds, and the
engine benchmark's intervals on its controller ratios."""

import numpy as np
import pytest

from bench.engine import _ratio_interval
from bench.intervals import interval, round_weights


def lockstep(rng, rates: dict[str, float], rounds: int = 60, noise: float = 0.12, load: float = 0.2):
    """A simulated lockstep: one token a step, each step ``1 / rate`` seconds times the round's
    machine load (shared by every configuration) and the step's own noise."""
    shared = np.exp(rng.normal(0.0, load, rounds))
    return {name: (shared * np.exp(rng.normal(0.0, noise, rounds)) / rate, np.ones(rounds))
            for name, rate in rates.items()}


def test_blocks_are_consecutive_rounds_covering_the_run():
    w = round_weights(47, 500, np.random.default_rng(0))  # block of round(47^(1/3)) = 4 rounds, 12 blocks
    assert w.shape == (500, 47) and set(w.sum(axis=1)) == {48.0}
    assert w.mean() == pytest.approx(48 / 47, rel=0.1)  # every round drawn about as often
    with pytest.raises(ValueError, match="rounds must be positive, got 0"):
        round_weights(0, 10, np.random.default_rng(0))
    with pytest.raises(ValueError, match="level must lie in"):
        interval({"a": (np.ones(3), np.ones(3))}, lambda r: r["a"], level=1.5)


def test_the_interval_covers_a_tie_about_as_often_as_it_says():
    covered = 0
    for seed in range(200):
        steps = lockstep(np.random.default_rng(seed), {"a": 10.0, "b": 10.0})
        lo, hi = interval(steps, lambda r: r["a"] / r["b"], draws=400, seed=seed)
        covered += lo <= 1.0 <= hi
    assert 0.8 <= covered / 200 <= 0.98


def test_the_machines_load_cancels_in_a_ratio():
    # Load moving every configuration by 20 % a round; their own noise 2 %: the ratio stays narrow.
    steps = lockstep(np.random.default_rng(3), {"a": 10.0, "b": 10.0}, noise=0.02, load=0.2)
    lo, hi = interval(steps, lambda r: r["a"] / r["b"])
    assert hi - lo < 0.02
    alone = interval(steps, lambda r: r["a"] / 10.0)  # one rate on its own carries the load
    assert alone[1] - alone[0] > 0.05


def series(rng, controller: float, statics: dict[str, float], rounds: int = 60, prefix: str = ""):
    rates = {("none", prefix + "plain", 4): 10.0, ("none", prefix + "plain-repeat", 4): 10.0,
             ("ngram", prefix + "goodput-warm", 4): 10.0 * controller,
             **{("ngram", prefix + name, 4): 10.0 * s for name, s in statics.items()}}
    return {k: v for k, v in zip(rates, lockstep(rng, dict(zip(map(str, rates), rates.values())), rounds).values())}


def test_a_controller_behind_the_best_shape_is_told_from_a_tie():
    rng = np.random.default_rng(7)
    behind = series(rng, 1.00, {"static-d1": 1.12, "static-d2": 1.05})  # 11 % behind the better shape
    lo, hi = _ratio_interval(behind, "ngram", 4, "goodput-warm", ["static-d1", "static-d2"])
    assert hi < 1.0 and lo < 1.0 / 1.12 < hi
    tied = series(rng, 1.10, {"static-d1": 1.10, "static-d2": 1.05})
    lo, hi = _ratio_interval(tied, "ngram", 4, "goodput-warm", ["static-d1", "static-d2"])
    assert lo < 1.0 < hi
    # Where every static shape loses to plain the controller is held to plain.
    off = series(rng, 1.00, {"static-d1": 0.8}, prefix="confirm-")
    lo, hi = _ratio_interval(off, "ngram", 4, "confirm-goodput-warm", ["confirm-static-d1"], "confirm-")
    assert lo < 1.0 < hi
    assert _ratio_interval(off, "ngram", 4, "goodput-warm", ["static-d1"]) is None  # not in this lockstep


def test_picking_the_best_of_many_noisy_shapes_widens_the_interval_downwards():
    # Seven shapes as fast as the controller: the hindsight best is lucky, and the interval knows it.
    rng = np.random.default_rng(11)
    shapes = {f"static-{i}": 1.1 for i in range(7)}
    data = series(rng, 1.1, shapes, rounds=50)
    lo_many, hi_many = _ratio_interval(data, "ngram", 4, "goodput-warm", list(shapes))
    lo_one, hi_one = _ratio_interval(data, "ngram", 4, "goodput-warm", ["static-0"])
    assert (lo_many + hi_many) / 2 < (lo_one + hi_one) / 2


def test_the_engines_own_speeds_are_estimated_from_identical_pairs_and_widen_the_interval():
    from bench.intervals import engine_variance

    def engines(rng, n, sd):  # each engine its own speed for the whole run, 10 % step noise on top
        return {k: (rng.normal(0.1, 0.01, 50) / np.exp(rng.normal(0.0, sd)), np.ones(50)) for k in range(n)}

    rng = np.random.default_rng(5)
    pairs = [tuple(engines(rng, 2, 0.02).values()) for _ in range(60)]
    assert np.sqrt(engine_variance(pairs)) == pytest.approx(0.02, abs=0.006)
    assert engine_variance([tuple(engines(rng, 2, 0.0).values()) for _ in range(60)]) < 0.01 ** 2  # 60 pairs: rough
    assert engine_variance([]) == 0.0
    narrow = wide = 0
    for seed in range(150):
        steps = engines(np.random.default_rng(100 + seed), 2, 0.02)
        lo, hi = interval(steps, lambda r: r[0] / r[1], draws=400, seed=seed)
        narrow += lo <= 1.0 <= hi
        lo, hi = interval(steps, lambda r: r[0] / r[1], draws=400, seed=seed, extra_log_var=2 * 0.02 ** 2)
        wide += lo <= 1.0 <= hi
    assert narrow / 150 < 0.75 and 0.82 <= wide / 150 <= 0.98  # the rounds alone miss the engines' speeds
    with pytest.raises(ValueError, match="extra_log_var must be >= 0, got -1"):
        interval(steps, lambda r: r[0] / r[1], extra_log_var=-1)
