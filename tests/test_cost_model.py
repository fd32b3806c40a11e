"""The controller's step-cost model against the simulator's roofline: the
hardware prior, and the attention term that makes one fit right at every
context length."""

from __future__ import annotations

import numpy as np
import pytest

from controller.cost import CostParams, StepCostModel
from worker.sim.hardware import CostModel

H100_PRIOR = dict(bandwidth_gb_s=3350, peak_tflops=989, weight_bytes=16e9, kv_bytes_per_token=131072, params=8e9)


def test_hardware_prior_prices_compute_like_a_serving_engine():
    """Nominal hints with realistic efficiencies sit near the simulator's achieved
    roofline (within 20 %), so a first plan at a compute-bound batch does not send
    maximal trees; attention flops per pair come from the KV width."""
    truth = CostModel("H100-SXM")
    prior = CostParams.from_hardware(**H100_PRIOR)
    for batch, per_request, ctx in [(1, 1, 500), (8, 1, 8000), (256, 4, 500), (256, 8, 500), (64, 4, 32000)]:
        tokens, kv = batch * per_request, batch * ctx
        pairs = tokens * ctx
        assert prior.verify_ms(tokens, kv, pairs) == pytest.approx(truth.verify_ms(tokens, kv, pairs), rel=0.2)
    with pytest.raises(ValueError, match="flops_efficiency=0"):
        CostParams.from_hardware(**H100_PRIOR, flops_efficiency=0)


def test_fit_with_attention_pairs_prices_nodes_right_at_short_and_long_context():
    """Steps at 500 and 24k tokens of context, memory- and compute-bound (wide
    trees): with the pairs regressor one fit predicts both contexts; a per-token
    slope alone cannot (at 24k a tree's attention flops rival its GEMM flops)."""
    truth = CostModel("H100-SXM", noise_sigma=0.03)
    rng = np.random.default_rng(1)
    with_pairs = StepCostModel(prior=CostParams.from_hardware(**H100_PRIOR))
    tokens_only = StepCostModel(prior=CostParams.from_hardware(**H100_PRIOR))
    for _ in range(4000):
        batch = int(rng.choice([1, 4, 16, 64]))
        per_request = int(rng.choice([1, 2, 4, 8, 16, 32, 64]))
        ctx = float(rng.choice([500, 24000]))
        tokens, kv, pairs = batch * per_request, batch * ctx, batch * per_request * ctx
        ms = truth.noisy(truth.verify_ms(tokens, kv, pairs), rng)
        with_pairs.observe_verify(tokens, kv, ms, pairs)
        tokens_only.observe_verify(tokens, kv, ms)
    fit, crude = with_pairs.refit(), tokens_only.refit()
    errors = []
    for batch, per_request, ctx in [(64, 8, 500), (16, 64, 500), (16, 64, 24000), (64, 32, 24000), (4, 2, 24000)]:
        tokens, kv, pairs = batch * per_request, batch * ctx, batch * per_request * ctx
        exact = truth.verify_ms(tokens, kv, pairs)
        assert fit.verify_ms(tokens, kv, pairs) == pytest.approx(exact, rel=0.05), (batch, per_request, ctx)
        errors.append(abs(crude.verify_ms(tokens, kv) / exact - 1))
    assert max(errors) > 0.1


def test_compute_curve_follows_a_kernel_staircase_and_never_falls():
    """The reference worker's CPU with tuned kernels (measured, batch 1): a forward
    over 1–6 tokens costs the same, the 7th adds ~40 %, then it climbs. One slope
    through those steps misprices the flat part by tens of percent; the curve
    fits every token count, is non-decreasing, and continues past the data at
    the last slope."""
    def truth(n):
        return 56.0 + np.where(n >= 7, 22.0, 0.0) + 2.5 * np.maximum(n - 8, 0)

    rng = np.random.default_rng(0)
    model = StepCostModel(prior=CostParams())
    for _ in range(3000):
        n = int(rng.integers(1, 41))
        model.observe_verify(n, 300 * max(1, n // 9), float(truth(np.float64(n)) * rng.normal(1.0, 0.02)))
    fit = model.refit()
    n = np.arange(1, 41, dtype=float)
    pred = fit.verify_ms(n, 300.0)
    steps = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 28, 32, 40]
    for k in steps:
        assert pred[k - 1] == pytest.approx(float(truth(np.float64(k))), rel=0.04), k
    assert np.all(np.diff(fit.verify_ms(np.arange(1, 200, dtype=float), 300.0)) >= -1e-9)
    assert fit.compute_ms_per_token == pytest.approx(2.5, rel=0.2)
    far = fit.verify_ms(np.array([80.0, 120.0]), 300.0)
    assert far[1] - far[0] == pytest.approx(40 * fit.compute_ms_per_token, rel=1e-6)
    # the same points through a single slope (what the cost model was before the curve)
    linear = [(truth(np.float64(k)), k) for k in steps]
    slope, intercept = np.polyfit([k for _, k in linear], [t for t, _ in linear], 1)
    worst = max(abs((intercept + slope * k) / t - 1) for t, k in linear)
    assert worst > 0.15


def test_past_the_data_the_curve_climbs_at_least_at_the_mean_slope():
    """A worker seen only at batch 1 (1–9 tokens), whose last few steps happen to
    be fast: the fitted curve must not extrapolate that flat last segment to
    batch 4's 20–40 tokens (a controller once planned maximal trees there)."""
    rng = np.random.default_rng(4)
    model = StepCostModel(prior=CostParams())
    for _ in range(400):
        n = int(rng.integers(1, 9))
        model.observe_verify(n, 300, 60.0 + (20.0 if n >= 7 else 0.0) + rng.normal(0, 1.0))
    for _ in range(5):
        model.observe_verify(9, 300, 79.0)  # a sparse, slightly fast last segment
    fit = model.refit()
    mean_slope = (fit.verify_ms(9.0, 300.0) - fit.verify_ms(1.0, 300.0)) / 8
    assert mean_slope > 1.5
    assert fit.verify_ms(40.0, 300.0) - fit.verify_ms(9.0, 300.0) >= 0.95 * 31 * mean_slope


def test_the_fit_is_sure_where_it_has_data_and_one_rmse_wide_where_it_interpolates():
    """A worker seen at 4 and 20 batch tokens, never in between: the price at 12
    is interpolated and carries the whole RMSE; at 4 and 20 the standard error
    shrinks with the observations behind it. Exact parameters carry none."""
    rng = np.random.default_rng(7)
    model = StepCostModel(prior=CostParams())
    for _ in range(400):
        model.observe_verify(4, 300, 67.0 + rng.normal(0, 5.0))
    for _ in range(25):
        model.observe_verify(20, 300, 118.0 + rng.normal(0, 5.0))
    fit = model.refit()
    assert fit.verify_rmse_ms == pytest.approx(model.rmse_ms) and 3.0 < model.rmse_ms < 8.0
    assert fit.verify_sd_ms(12) == pytest.approx(model.rmse_ms)
    assert fit.verify_sd_ms(4) == pytest.approx(model.rmse_ms / np.sqrt(401), rel=1e-6)
    assert fit.verify_sd_ms(20) == pytest.approx(model.rmse_ms / np.sqrt(26), rel=1e-6)
    assert list(fit.verify_sd_ms(np.array([4.0, 12.0]))) == [fit.verify_sd_ms(4), fit.verify_sd_ms(12)]
    assert CostParams(mem_ms=5.0).verify_sd_ms(12) == 0.0


def test_calibration_gives_the_shape_and_live_steps_the_level():
    """Calibrated on a quiet machine (60 ms up to 6 tokens, 72 from the 7th),
    then run 20 % slower. Live steps only ever run 1, 3 and 5 tokens. Mixed
    unscaled the curve would stay flat from 5 tokens (72 live) to 7 (72
    calibrated); scaled, 7 tokens costs 20 % above 6, as the machine does."""
    def quiet(tokens: int) -> float:
        return 60.0 if tokens <= 6 else 72.0 + 2.0 * (tokens - 7)

    rng = np.random.default_rng(3)
    model = StepCostModel(prior=CostParams())
    model.calibrate([(n, 150, 150 * n, quiet(n), 3) for n in range(1, 13)])
    cold = model.refit()
    # Three observations a shape: the smoothness pull rounds the step a little.
    assert 1.12 < cold.verify_ms(7, 150, 1050) / cold.verify_ms(6, 150, 900) <= 1.2
    for _ in range(300):
        n = int(rng.choice([1, 3, 5]))
        model.observe_verify(n, 100, 1.2 * quiet(n) * rng.normal(1.0, 0.02), 100 * n)
    fit = model.refit()
    assert model.calibration_scale == pytest.approx(1.2, rel=0.02)
    assert fit.verify_ms(6, 150, 900) == pytest.approx(72.0, rel=0.04)
    assert fit.verify_ms(7, 150, 1050) == pytest.approx(1.2 * 72.0, rel=0.04)
    assert fit.verify_ms(12, 150, 1800) == pytest.approx(1.2 * quiet(12), rel=0.03)
    with pytest.raises(ValueError, match=r"sample 1: \(1.0, 10.0, 10.0, 0.0, 1.0\) needs .*verify_ms > 0"):
        model.calibrate([(2, 10, 20, 60.0, 1), (1, 10, 10, 0.0, 1)])
    assert model.calibration_samples == 12  # the refused samples replaced nothing
    assert model.refit().verify_ms(7, 150, 1050) == pytest.approx(fit.verify_ms(7, 150, 1050))


def test_a_cpu_where_every_token_costs_is_not_fitted_as_one_flat_memory_plane():
    """The EAGLE worker's verify cells of a real benchmark run on an Intel Xeon (live cells and the scaled
    start-up calibration, as ``StepCostModel.refit`` hands them over; tests/data). There a plain step costs
    ~77 ms at batch 1 and each further token ~+5 ms. Alternating assignment started only from "all memory",
    the median split and the prior settled on a flat 102.5 ms memory plane for 1-8 tokens, so trees looked
    free; the start with every point on the compute plane finds the lower-error fit, which follows the
    live medians (77 / 88 / 109 / 126 ms for 1 / 3 / 5 / 8 tokens)."""
    import json
    from pathlib import Path

    from controller.cost import fit_max_planes

    cells = json.loads((Path(__file__).parent / "data" / "eagle_xeon_verify_cells.json").read_text())
    arrays = {k: np.array(cells[k], dtype=float) for k in
              ("batch_tokens", "kv_tokens", "verify_ms", "weights", "attn_pairs")}
    params = fit_max_planes(arrays["batch_tokens"], arrays["kv_tokens"], arrays["verify_ms"], arrays["weights"],
                            CostParams(**cells["prior"]), cells["prior_weight"], attn_pairs=arrays["attn_pairs"])
    price = {t: float(params.verify_ms(t, 200.0, t * 200.0)) for t in (1, 3, 5, 8)}
    for tokens, live_median in {1: 77.1, 3: 88.2, 5: 109.0, 8: 126.3}.items():
        assert price[tokens] == pytest.approx(live_median, rel=0.12), price
    assert price[5] - price[1] > 20.0  # four more tokens are not free here
