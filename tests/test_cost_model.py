"""The controller's step-cost model against the simulator's roofline: the
hardware prior, and the attention term that makes one fit right at every
context length."""

from __future__ import annotations

import copy
import math

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.models.cost import CostParams, StepCostModel
from tests.support import TRUTH
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


def test_kv_reads_add_to_compute_at_compute_bound_batches():
    """A GPU whose attention reads the KV cache after the GEMMs (the measured H200): at compute-bound
    batches the step costs GEMMs plus KV reads, not the larger of the two. The fit finds the compute
    plane's KV slope, and the cost of 4 tokens per request over one at batch 64 and 8k context (what
    the policy's decisions turn on) comes out as the truth has it; without the term it cannot."""
    def truth(n, kv):
        return max(6.0 + 3e-5 * kv, 5.0 + 0.03 * n + 2.9e-5 * kv)

    shapes = [(b, q, c) for b in (1, 4, 16, 64, 256) for q in (1, 2, 4, 8) for c in (1024, 8192)]
    model = StepCostModel(prior=CostParams(mem_ms=6.0))
    for _ in range(5):
        for b, q, c in shapes:
            model.observe_verify(b * q, b * c, truth(b * q, b * c), b * q * c)
    fit = model.refit()
    assert fit.compute_ms_per_kv_token == pytest.approx(2.9e-5, rel=0.1)

    def ratio(p, b, q, c):
        return p.verify_ms(b * q, b * c, b * q * c) / p.verify_ms(b, b * c, b * c)

    for b, q, c in ((64, 4, 8192), (256, 2, 1024), (256, 8, 8192)):
        assert ratio(fit, b, q, c) == pytest.approx(truth(b * q, b * c) / truth(b, b * c), rel=0.03)
    # The form without the term (the compute plane blind to KV) misses the same ratio by far more.
    blind = replace(fit, compute_ms_per_kv_token=0.0)
    assert abs(ratio(blind, 64, 4, 8192) / (truth(256, 64 * 8192) / truth(64, 64 * 8192)) - 1) > 0.1


def test_calibration_is_scaled_by_the_shapes_live_steps_ran():
    """A calibration grid of 1..16 tokens per request at 1k and 8k context, and live steps at shapes the
    grid never ran (15 requests of 6 tokens at 4k context) but in the same batch-token segments. Where
    live and calibration agree the scale stays 1; 25 % slower live steps scale it to 1.25. (Compared
    per batch-token segment, the 96-token cell of 96 plain requests at 1k against 15 x 6 tokens at 4k,
    a calibration that matched exactly scaled itself to 0.6-0.7.)"""
    def truth(b, q, c):
        return max(6.0 + 3e-5 * b * c, 5.0 + 0.03 * b * q + 2.9e-5 * b * c)

    grid = [(b * q, b * c, b * q * c, truth(b, q, c), 5) for b in (1, 4, 16, 32, 64, 96) for q in (1, 2, 4, 8, 16)
            for c in (1024, 8192)]
    for slower in (1.0, 1.25):
        model = StepCostModel(prior=CostParams(mem_ms=6.0))
        model.calibrate(grid)
        for _ in range(200):
            model.observe_verify(90, 15 * 4096, slower * truth(15, 6, 4096), 90 * 4096)
            model.observe_verify(50, 10 * 4000, slower * truth(10, 5, 4000), 50 * 4000)
        model.refit()
        assert model.calibration_scale == pytest.approx(slower, rel=0.03)


def test_a_cpu_where_every_token_costs_is_not_fitted_as_one_flat_memory_plane():
    """The EAGLE worker's verify cells of a real benchmark run on an Intel Xeon (live cells and the scaled
    start-up calibration, as ``StepCostModel.refit`` hands them over; tests/data). There a plain step costs
    ~77 ms at batch 1 and each further token ~+5 ms. Alternating assignment started only from "all memory",
    the median split and the prior settled on a flat 102.5 ms memory plane for 1-8 tokens, so trees looked
    free; the start with every point on the compute plane finds the lower-error fit, which follows the
    live medians (77 / 88 / 109 / 126 ms for 1 / 3 / 5 / 8 tokens)."""
    import json
    from pathlib import Path

    from controller.models.cost import fit_max_planes

    cells = json.loads((Path(__file__).parent / "data" / "eagle_xeon_verify_cells.json").read_text())
    arrays = {k: np.array(cells[k], dtype=float) for k in
              ("batch_tokens", "kv_tokens", "verify_ms", "weights", "attn_pairs")}
    params = fit_max_planes(arrays["batch_tokens"], arrays["kv_tokens"], arrays["verify_ms"], arrays["weights"],
                            CostParams(**cells["prior"]), cells["prior_weight"], attn_pairs=arrays["attn_pairs"])
    price = {t: float(params.verify_ms(t, 200.0, t * 200.0)) for t in (1, 3, 5, 8)}
    for tokens, live_median in {1: 77.1, 3: 88.2, 5: 109.0, 8: 126.3}.items():
        assert price[tokens] == pytest.approx(live_median, rel=0.12), price
    assert price[5] - price[1] > 20.0  # four more tokens are not free here


# ---------------------------------------------------------------- robustness (issue #25 item 6)

TERMS = ("mem_ms", "mem_ms_per_kv_token", "compute_ms", "compute_ms_per_token", "compute_ms_per_pair",
         "compute_ms_per_kv_token",
         "draft_fixed_ms", "draft_ms_per_level", "draft_ms_per_node", "draft_ms_per_level_kv_token",
         "catch_up_ms_per_token")
CONTEXTS = (300, 1000, 4000, 16000)
# Every (batch tokens, KV tokens, pairs) the steady stream below runs: batch 1-8, 1-5 tokens a request.
SEEN = np.array([(b * per, b * ctx, b * per * ctx) for b in range(1, 9) for per in range(1, 6) for ctx in CONTEXTS],
                dtype=float).T


def assert_sane(params: CostParams) -> None:
    """No fitted term negative (or not finite); the curve never falls."""
    for name in TERMS:
        value = getattr(params, name)
        assert math.isfinite(value) and value >= 0, (name, value)
    rise = np.asarray(params.compute_rise_ms)
    assert np.all(np.isfinite(rise)) and np.all(rise >= 0) and np.all(np.diff(rise) >= 0)


@pytest.fixture(scope="module")
def steady() -> StepCostModel:
    """3,000 steps at batch 1-8 over four context lengths, timed by ``TRUTH`` with 2 % noise."""
    rng = np.random.default_rng(11)
    model = StepCostModel(prior=CostParams.from_hardware(**H100_PRIOR))
    for _ in range(3000):
        batch, per, ctx = int(rng.integers(1, 9)), int(rng.integers(1, 6)), float(rng.choice(CONTEXTS))
        tokens, kv = batch * per, batch * ctx
        model.observe_verify(tokens, kv, TRUTH.verify_ms(tokens, kv) * rng.normal(1.0, 0.02), tokens * ctx)
    model.refit()
    return model


@pytest.mark.parametrize("tokens, kv, pairs, verify_ms", [
    (60_000, 6e7, 6e7, 1e5),  # the integrator's batch of 60,000 tokens, 100 s (least squares: +81 %)
    (60_000, 6e7, 6e7, "1000x"),  # the same at 1,000x its cost (+1,474 %)
    (256, 2e3, 5.12e5, 1e5),  # 256 tokens in 100 s, just past the data (+149 %)
    (24, 1.28e5, 3.84e5, "1000x"),  # 1,000x the cost at a shape seen before (its cell: 44 steps; +509 %)
    (8, 4e3, 8e3, "1000x"),  # (48 steps; +59 %)
    (1, 300, 300, "1000x"),  # plain decoding (17 steps; +39 %)
    (1, 1e9, 1e9, 1e5),  # KV 8,000x past the rest: it tilted the memory plane (+12 %)
    (8, 1e6, 8e6, 1e4),  # KV 8x past the rest, 10 s (+3,166 %)
])
def test_one_absurd_step_leaves_the_prices_of_the_shapes_seen(steady, tokens, kv, pairs, verify_ms) -> None:
    """After a steady stream, one absurd step report (a batch far past the data,
    or a time 1,000x the truth at a shape seen many times) moves the fitted
    price of no shape seen by more than 2 % or 0.1 ms, leaves every term
    non-negative, and does not inflate the RMSE (the standard error every
    price carries). Plain least squares moved them by the percentages noted."""
    model = copy.deepcopy(steady)
    model.observe_verify(tokens, kv, 1000 * TRUTH.verify_ms(tokens, kv) if verify_ms == "1000x" else verify_ms,
                         pairs)
    fit = model.refit()
    before, after = steady.params.verify_ms(*SEEN), fit.verify_ms(*SEEN)
    moved = np.abs(after - before)
    assert np.all((moved <= 0.1) | (moved <= 0.02 * before)), float(np.max(moved / before))
    assert_sane(fit)
    assert model.rmse_ms < 1.2 * steady.rmse_ms


def test_a_real_step_past_the_data_is_still_learned_at_once(steady) -> None:
    """The rule judges a step by how well the rest knows its shape: one
    compute-bound step at 2,048 tokens (far past batch 8, where the memory
    plane alone would say 12 ms) is priced at what it took, as before."""
    model = copy.deepcopy(steady)
    model.observe_verify(2048, 256 * 300, TRUTH.verify_ms(2048, 256 * 300), 2048 * 300)
    fit = model.refit()
    assert fit.verify_ms(2048, 256 * 300, 2048 * 300) == pytest.approx(TRUTH.verify_ms(2048, 256 * 300), rel=0.02)
    assert np.allclose(fit.verify_ms(*SEEN), steady.params.verify_ms(*SEEN), rtol=0.02)


def test_a_lone_huge_batch_never_makes_the_compute_intercept_negative() -> None:
    """Issue #25 item 6: a single report of 60,000 batch tokens (every batch past
    the last knot) left no active curve segment; the intercept was anchored
    there and the prior's curve (0.04 ms a token) subtracted: -2,414 ms. Data
    only at one token likewise keeps the prior's curve under a fitted,
    non-negative intercept."""
    prior = CostParams.from_hardware(**H100_PRIOR)
    model = StepCostModel(prior=prior)
    model.observe_verify(60_000, 1000, 10.0, 6e7)
    fit = model.refit()
    assert_sane(fit)
    assert fit.verify_ms(60_000, 1000, 6e7) == pytest.approx(10.0, rel=0.5)
    plain = StepCostModel(prior=CostParams(mem_ms=50.0, compute_ms=1.0, compute_ms_per_token=2.0))
    for ms in (0.5, 0.6, 0.4):
        plain.observe_verify(1, 100, ms)
    assert_sane(plain.refit())


def test_reports_that_are_not_times_are_dropped() -> None:
    """NaN, infinite or negative times (and counts) never reach the sketches:
    one would poison its cell (or the draft normal equations) for good."""
    model = StepCostModel(prior=CostParams())
    for i in range(50):
        model.observe_step(4, 1000, 3, 3, 3000, 1.5, 20.0)
    model.observe_step(4, 1000, 3, 3, 3000, float("nan"), float("nan"))
    model.observe_step(4, float("inf"), 3, 3, 3000, -1.0, 20.0)
    model.observe_verify(4, 1000, -5.0)
    model.observe_catch_up(10, float("nan"))
    model.observe_catch_up(10, -1.0)
    fit = model.refit()
    assert_sane(fit)
    assert model.samples == 50 and fit.catch_up_ms_per_token == 0.0
    assert fit.verify_ms(4, 1000) == pytest.approx(20.0, rel=1e-3)
    assert fit.draft_ms(3, 3) == pytest.approx(1.5, rel=1e-3)


OBSERVATION = st.tuples(
    st.one_of(st.integers(1, 64), st.integers(1, 70_000), st.sampled_from([1, 8, 16_384, 32_768, 60_000])),
    st.one_of(st.just(0.0), st.floats(0, 2e5), st.floats(0, 1e9)),  # KV tokens
    st.floats(0, 1e12),  # attention pairs
    st.one_of(st.floats(0, 100), st.floats(0, 1e6), st.sampled_from([0.0, 1e-3, 1e5])),  # verify ms
)


@settings(max_examples=300, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(observations=st.lists(OBSERVATION, min_size=1, max_size=25),
       drafts=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 64), st.floats(0, 1e8), st.floats(0, 1e3)),
                       max_size=10),
       catch_ups=st.lists(st.tuples(st.integers(1, 500), st.floats(0, 1e3)), max_size=4),
       calibration=st.lists(st.tuples(st.integers(1, 4096), st.floats(0, 1e6), st.floats(0, 1e9),
                                      st.floats(0.01, 1e4), st.floats(0.5, 10)), max_size=5),
       hardware_prior=st.booleans(), repeat=st.integers(1, 4))
def test_no_observations_ever_fit_a_negative_term(observations, drafts, catch_ups, calibration, hardware_prior,
                                                 repeat) -> None:
    """Any set of verify, draft and catch-up reports (each seen up to four
    times) and start-up calibration fits parameters with every term
    non-negative and finite, a curve that never falls and prices that are
    never negative."""
    model = StepCostModel(prior=CostParams.from_hardware(**H100_PRIOR) if hardware_prior else CostParams())
    model.calibrate(calibration)
    for _ in range(repeat):
        for tokens, kv, pairs, ms in observations:
            model.observe_verify(tokens, kv, ms, pairs)
        for depth, nodes, level_kv, ms in drafts:
            model.observe_draft(depth, nodes, level_kv, ms)
        for tokens, ms in catch_ups:
            model.observe_catch_up(tokens, ms)
    fit = model.refit()
    assert_sane(fit)
    tokens = np.array([1.0, 7.0, 40.0, 300.0, 5000.0, 60_000.0, 1e6])
    assert np.all(fit.verify_ms(tokens, 1e4, tokens * 1e3) >= 0)
    assert np.all(fit.verify_sd_ms(tokens) >= 0) and fit.draft_ms(4, 8, level_kv_tokens=1e5) >= 0
