"""Drift detectors (controller/drift): parameter checks, the censored cells,
multiple-testing control, and thresholds that keep their false-alarm budget."""

from __future__ import annotations

import numpy as np
import pytest

from controller.models.acceptance import AcceptancePrior, StratumPosterior
from controller.drift import CUSUM, AcceptLengthChiSquare, HistogramChiSquare, MonitorConfig, benjamini_hochberg, holm
from controller.drift.calibration import cusum_threshold, lundberg_exponent
from controller.drift.cells import chain_key, key_bins, outcome_key
from controller.drift.stats import censored_chi2, histogram_chi2, merge_plan


@pytest.mark.parametrize(
    ("make", "name", "value"),
    [
        (lambda: CUSUM(slack=-1.0, threshold=5.0, target=0.0), "slack", "-1.0"),
        (lambda: CUSUM(threshold=0.0, target=0.0), "threshold", "0.0"),
        (lambda: CUSUM(direction="down", ert=0.5), "ert", "0.5"),
        (lambda: AcceptLengthChiSquare(window=5), "window", "5"),
        (lambda: AcceptLengthChiSquare(max_depth=0), "max_depth", "0"),
        (lambda: AcceptLengthChiSquare(alpha=1.5), "alpha", "1.5"),
        (lambda: HistogramChiSquare(n_bins=4, n_baseline=10), "n_baseline", "10"),
        (lambda: HistogramChiSquare(n_bins=4, min_expected=0), "min_expected", "0"),
        (lambda: MonitorConfig(drops=(0.1, 0.0)), "drops", "0.0"),
        (lambda: MonitorConfig(correction="bonferroni"), "correction", "'bonferroni'"),
        (lambda: MonitorConfig(context_edges=(10, 5)), "context_edges", "(10, 5)"),
    ],
)
def test_bad_parameters_are_refused_naming_parameter_and_value(make, name, value) -> None:
    with pytest.raises(ValueError) as err:
        make()
    assert name in str(err.value) and value in str(err.value), str(err.value)


def test_cusum_needs_a_threshold_or_an_ert() -> None:
    with pytest.raises(ValueError, match="threshold"):
        CUSUM(direction="down")


def test_cells_match_the_acceptance_model_censoring() -> None:
    """key_bins counts the same (position, rank) trials as controller.models.acceptance."""
    rng = np.random.default_rng(0)
    depth, width = 5, 3
    posterior = StratumPosterior(depth, width, AcceptancePrior(), 0.0)
    total = np.zeros(2 * depth * width)
    for _ in range(300):
        ranks, cands = [], []
        for _level in range(int(rng.integers(1, depth + 1))):
            offered = int(rng.integers(1, width + 2))  # sometimes more than tracked
            rank = int(rng.integers(0, offered + 1))
            ranks.append(rank)
            cands.append(offered)
            if rank == 0:
                break
        posterior.observe(ranks, cands)
        total += key_bins(outcome_key(sum(r > 0 for r in ranks), depth, ranks, cands), depth, width)
    assert total[: depth * width].tolist() == posterior.succ
    assert total[depth * width:].tolist() == posterior.fail


def test_chain_shorthand_is_the_same_outcome_as_explicit_ranks() -> None:
    assert outcome_key(2, 4) == outcome_key(2, 4, [1, 1, 0], [1, 1, 1]) == chain_key(2, 4)
    assert outcome_key(4, 4) == ((1, 1, 1, 1), (1, 1, 1, 1))


def test_bh_and_holm() -> None:
    p = [0.01, 0.04, 0.03, 0.005, 0.2]
    bh, bh_adj = benjamini_hochberg(p, 0.05)
    ho, ho_adj = holm(p, 0.05)
    assert bh.tolist() == [True, True, True, True, False]
    assert ho.tolist() == [True, False, False, True, False]
    assert (bh >= ho).all()  # BH rejects a superset of Holm
    assert (bh_adj <= ho_adj + 1e-12).all()
    assert benjamini_hochberg([], 0.05)[0].size == 0
    with pytest.raises(ValueError, match="pvalues"):
        holm([0.5, 1.2], 0.05)


def test_bh_under_global_null_rejects_anything_at_most_at_level() -> None:
    rng = np.random.default_rng(1)
    any_rejected = np.mean([benjamini_hochberg(rng.random(8), 0.1)[0].any() for _ in range(4000)])
    assert 0.07 < any_rejected < 0.13


def test_lundberg_exponent_of_llr_increments_is_one() -> None:
    rng = np.random.default_rng(2)
    p, q = 0.8, 0.72  # baseline and "10 % drop" Bernoulli
    y = rng.random(100_000) < p
    llr = np.where(y, np.log(q / p), np.log((1 - q) / (1 - p)))
    assert lundberg_exponent(llr) == pytest.approx(1.0, abs=0.05)
    assert lundberg_exponent(np.abs(llr)) is None  # never drifts down: no root


def test_cusum_threshold_keeps_its_expected_run_time() -> None:
    """Calibrate on bootstrap paths, then count alarms on fresh no-drift data."""
    rng = np.random.default_rng(3)
    ert = 2000.0
    cusum = CUSUM(direction="down", slack=0.5, ert=ert, n_baseline=20_000, seed=1)
    cusum.fit(rng.normal(0.0, 1.0, 20_000))
    stream = rng.normal(0.0, 1.0, 200_000)
    alarms = sum(cusum.update(x).drift_detected for x in stream)
    assert 0.6 < alarms / (stream.size / ert) < 1.6, alarms  # 100 expected


def test_cusum_two_sided_sees_both_directions() -> None:
    rng = np.random.default_rng(4)
    cusum = CUSUM(direction="both", target=0.0, slack=0.5, threshold=6.0)
    up = [i for i, x in enumerate(rng.normal(1.0, 1.0, 200)) if cusum.update(x).drift_detected]
    cusum.reset()
    down = [i for i, x in enumerate(rng.normal(-1.0, 1.0, 200)) if cusum.update(x).drift_detected]
    assert up and down and up[0] < 40 and down[0] < 40


def test_accept_length_chi2_is_calibrated_under_depth_mix_changes() -> None:
    """p-values stay uniform when only the depth drafted moves (censoring, not drift)."""
    rng = np.random.default_rng(5)
    alpha = 0.8 * 0.97 ** np.arange(6)

    def outcomes(n: int, depths: list[int]) -> list[tuple[int, int]]:
        d = rng.choice(depths, size=n)
        ok = rng.random((n, 6)) < alpha
        ok &= np.arange(6)[None, :] < d[:, None]
        return list(zip(np.cumprod(ok, axis=1).sum(axis=1).tolist(), d.tolist()))

    det = AcceptLengthChiSquare(max_depth=6, n_baseline=3000, window=300, n_bootstrap=1024, seed=0)
    det.fit(outcomes(3000, [5, 6]))
    a, nu = det.null_scale
    assert 0.7 < a * nu < 1.4  # close to the asymptotic chi-square
    pvals = []
    for x in outcomes(300 * 150, [2, 3]):
        det.update(x)
        if det.tested:
            pvals.append(det.p_value)
    pvals = np.array(pvals)
    assert len(pvals) == 150
    assert 0.02 < np.mean(pvals < 0.1) < 0.2, np.mean(pvals < 0.1)
    assert pvals.min() > 1e-3


def test_histogram_chi2_merges_sparse_bins_and_sees_a_spread_change() -> None:
    probs = np.array([0.4, 0.3, 0.2, 0.06, 0.03, 0.01])
    groups = merge_plan(probs, window=100, n_baseline=1000)
    assert groups.tolist() == [0, 1, 2, 3, 3, 3]
    stat, df = histogram_chi2(probs * 1000, probs * 100, groups)
    assert float(stat) == pytest.approx(0.0) and int(df) == 3
    rng = np.random.default_rng(6)
    det = HistogramChiSquare(n_bins=6, n_baseline=2000, window=200, ert=100_000, n_bootstrap=512)
    for x in rng.choice(6, size=6000, p=probs):
        assert not det.update(int(x)).drift_detected
    wide = np.array([0.55, 0.1, 0.05, 0.1, 0.1, 0.1])  # a different spread
    assert any(det.update(int(x)).drift_detected for x in rng.choice(6, size=600, p=wide))


def test_censored_chi2_drops_sparse_cells() -> None:
    base = np.array([500.0, 3.0, 100.0, 1.0])  # cell 2 has 4 trials
    win = np.array([50.0, 0.0, 10.0, 1.0])
    stat, kept = censored_chi2(base, win)
    assert int(kept) == 1


def test_cusum_threshold_refuses_a_score_that_never_rises() -> None:
    with pytest.raises(ValueError, match="never drift upwards"):
        cusum_threshold(-np.ones((32, 100)), ert=1000)
