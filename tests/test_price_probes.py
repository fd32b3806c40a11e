"""Price probes (issue #28, n-gram at batch 4 in runs K, L, M): a shape the
start-up calibration prices too dear is never run by the mean decisions, so
nothing measures it; the controller runs it now and then until live steps
price it.

The world of these tests is the reference worker's at batch 4 on two CPU
cores, reduced to numbers: a padded forward costs 70 ms up to 6 tokens and
2.5 ms per token past that, so a depth-1 chain for four requests (8 tokens)
costs 1.07x a plain step. The start-up calibration, timed on a quiet machine
at short context, is 20 % faster everywhere (the scale fixes that) and
rises 6 ms a token past 6 (the scale cannot fix that): it says 1.17x. With a
first-position acceptance of 0.12 the chain brings 1.12x the tokens: a 4.6 %
gain at the true price, a loss at the calibration's.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from controller.models.cost import CALIBRATION_ERROR_PRIOR, CostParams, StepCostModel
from policies.allocation import UnmeasuredDoubt
from policies.goodput import GoodputConfig, GoodputPolicy
from policies.base import Observation
from policies.table import Decision
from tests.test_engine_cells import CONTEXT, padded_observation
from tests.test_goodput_classes import with_classes

BATCH = 4
ACTIVE = {f"req-{i}": CONTEXT for i in range(BATCH)}
Q = np.array([[0.12]])


def true_ms(tokens: float) -> float:
    return 70.0 + 2.5 * max(tokens - 6.0, 0.0)


def calibration_ms(tokens: float) -> float:
    return 0.8 * (70.0 + 6.0 * max(tokens - 6.0, 0.0))


def calibrated_model(repeats: int = 5, calibration_context: int = 200) -> StepCostModel:
    """A cost model holding the calibration (batch 1 and 4, 0-5 nodes) and 300 live plain steps at batch 4."""
    model = StepCostModel()
    model.calibrate([(b * (1 + n), b * calibration_context, b * (1 + n) * calibration_context,
                      calibration_ms(b * (1 + n)), repeats) for b in (1, BATCH) for n in range(6)])
    rng = np.random.default_rng(0)
    for _ in range(300):
        model.observe_verify(BATCH, BATCH * CONTEXT, true_ms(BATCH) * rng.normal(1.0, 0.02), BATCH * CONTEXT)
    return model


def observe(fit: CostParams, classes: bool = False) -> Observation:
    """The batch of four as the policy sees it; ``classes``: two classes of equal weight, two requests each."""
    obs = padded_observation(fit, Q, float(BATCH), active=ACTIVE)
    if classes:
        obs = with_classes(obs, {"interactive": {}, "batch": {}}, "batch", {"interactive": 0.5, "batch": 0.5},
                           active_classes={rid: ("interactive", "batch")[i % 2] for i, rid in enumerate(ACTIVE)})
    return obs


def run_loop(policy: GoodputPolicy, decisions: int, seed: int = 0,
             classes: bool = False) -> tuple[list[Decision], list[str], StepCostModel]:
    """The controller's loop at batch 4: refit, decide, and four steps of what the batch was told
    (a probe's override, else the table's cell), each reported at its true cost."""
    model = calibrated_model()
    rng = np.random.default_rng(seed)
    ran, reasons = [], []
    for i in range(decisions):
        plan, _ = policy.decide((seed, i), observe(model.refit(), classes))
        table = plan.table_for("interactive") if classes else plan.table  # req-0's class
        decision = plan.overrides.get("req-0", table.lookup(BATCH, CONTEXT))
        ran.append(decision)
        reasons.append(plan.reasons.get("req-0", ""))
        tokens = BATCH * (1 + decision.max_nodes)
        for _ in range(4):
            model.observe_verify(tokens, BATCH * CONTEXT, true_ms(tokens) * rng.normal(1.0, 0.02), tokens * CONTEXT)
    return ran, reasons, model


def test_repeating_a_calibration_does_not_make_its_shapes_known():
    """A segment the calibration alone covers stays about ``calibration_error`` unsure at any repeat count
    (the samples' noise shrinks, their systematic error does not); its live steps are counted apart."""
    few, many = calibrated_model(repeats=5).refit(), calibrated_model(repeats=500).refit()
    assert few.verify_live_steps(8.0) == 0 and few.verify_live_steps(BATCH) > 250
    for fit in (few, many):
        floor = 0.5 * fit.calibration_error * fit.verify_ms(8.0, BATCH * CONTEXT)
        assert fit.verify_sd_ms(8.0) > floor > 0
    # Without the systematic error the same samples would count as 500 live steps each.
    assert many.verify_sd_ms(8.0) > 5 * replace(many, calibration_error=0.0).verify_sd_ms(8.0)
    # Exact parameters (a prior, a simulator's truth) have nothing left to measure.
    assert CostParams(mem_ms=5.0).verify_live_steps(8.0) == float("inf")


def test_the_calibration_error_is_what_the_scaled_calibration_misses_live_cells_by():
    """Live cells across the calibrated range: a calibration right up to its level is trusted more than
    the prior says; one whose slope is off by 2.4x, less."""
    def error(calibration) -> float:
        model = StepCostModel()
        model.calibrate([(n, BATCH * 128, n * 128, calibration(n), 5) for n in range(BATCH, 29, 2)])
        rng = np.random.default_rng(1)
        for n in range(BATCH, 29, 2):
            for _ in range(80):
                model.observe_verify(n, BATCH * 128, true_ms(n) * rng.normal(1.0, 0.01), n * 128)
        model.refit()
        return model.calibration_error

    right, wrong = error(lambda n: 0.8 * true_ms(n)), error(calibration_ms)
    assert right < 0.6 * CALIBRATION_ERROR_PRIOR < 2 * CALIBRATION_ERROR_PRIOR < wrong


def test_an_optimistic_price_probes_only_shapes_without_live_steps():
    """The probe's prices: the fit's doubt where fewer than ``min_steps`` live steps ran, none elsewhere."""
    fit = calibrated_model().refit()
    doubt = UnmeasuredDoubt(fit, min_steps=16)
    assert doubt.verify_sd_ms(BATCH) == 0.0 and doubt.verify_sd_ms(8.0) == fit.verify_sd_ms(8.0) > 0
    assert doubt.verify_ms(8.0, 1200, 2400) == fit.verify_ms(8.0, 1200, 2400)


def test_price_probes_measure_the_shape_and_the_mean_decision_follows():
    """Without price probes the chain is never run and the table stays off at batch 4 for good; with
    them, a share of the decisions runs it, live steps price it at 1.07x and the table turns it on,
    after which the probes stop (the shape is measured)."""
    never = GoodputPolicy(GoodputConfig(probe_fraction=0.0, price_probe_fraction=0.0))
    ran, _, _ = run_loop(never, 40)
    assert set(ran) == {Decision.off()}

    probing = GoodputPolicy(GoodputConfig(probe_fraction=0.0))
    ran, reasons, model = run_loop(probing, 40)
    probes = [i for i, r in enumerate(reasons) if r == "price-probe"]
    assert probes and all(ran[i] == Decision.chain(1) for i in probes)
    settled = probing.decide((0, 99), padded_observation(model.refit(), Q, float(BATCH), active=ACTIVE))[0]
    assert settled.table.lookup(BATCH, CONTEXT) == Decision.chain(1)
    assert not settled.overrides
    assert ran[-10:] == [Decision.chain(1)] * 10 and len(probes) <= 12
    fit = model.refit()
    assert fit.verify_live_steps(8.0) >= GoodputConfig().price_probe_steps
    assert abs(fit.verify_ms(8.0, BATCH * CONTEXT, 8 * CONTEXT) / true_ms(8.0) - 1.0) < 0.02


def test_with_request_classes_the_price_probe_is_the_batchs_too():
    """Two classes sharing the batch: the same world, the same outcome through the class solver (whose
    caution, like the single-class one, could only turn drafting off before a negative draw priced it)."""
    never = GoodputPolicy(GoodputConfig(probe_fraction=0.0, price_probe_fraction=0.0))
    assert set(run_loop(never, 30, classes=True)[0]) == {Decision.off()}
    ran, reasons, _ = run_loop(GoodputPolicy(GoodputConfig(probe_fraction=0.0)), 30, classes=True)
    assert "price-probe" in reasons and ran[-10:] == [Decision.chain(1)] * 10


def test_no_price_probe_where_the_shape_costs_what_the_calibration_says():
    """The same world with the calibration right about 8 tokens (dear: 1.17x): a probe runs the chain
    until its live steps price it (here the first one's four steps do: the fit meets live steps within
    2 %), then the table stays off and no probe follows."""
    global true_ms
    kept = true_ms
    true_ms = lambda tokens: calibration_ms(tokens) / 0.8  # noqa: E731 - the world where the calibration is right
    try:
        ran, reasons, model = run_loop(GoodputPolicy(GoodputConfig(probe_fraction=0.0)), 60)
    finally:
        true_ms = kept
    assert "price-probe" in reasons
    last = max(i for i, r in enumerate(reasons) if r == "price-probe")
    assert last < 40 and set(ran[last + 1:]) == {Decision.off()}
    fit = model.refit()
    assert fit.verify_live_steps(8.0) > 0
    assert abs(fit.verify_ms(8.0, BATCH * CONTEXT, 8 * CONTEXT) / (calibration_ms(8.0) / 0.8) - 1.0) < 0.02
