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
