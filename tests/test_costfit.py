"""``specctl bench costfit``: the report's keys on a short run, the fit beating the prior,
and the comparison with the measured table on cases whose answer is known."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench.costfit import (
    BATCH_BUCKETS,
    RUNS,
    compare,
    coverage,
    measured_points,
    model_ms,
    run_costfit_bench,
    run_data,
)
from controller.models.cost import CostParams
from worker.sim.measured import TABLE_DIR, MeasuredCostModel


def synthetic_points() -> np.ndarray:
    """Batch 1, 32, 64 x q 1, 2, 4 x context 1k: ms = batch + q (so every ratio is known)."""
    rows = [(b, q, 1024, float(b + q)) for b in (1, 32, 64) for q in (1, 2, 4)]
    return np.array(rows, dtype=float)


def test_compare_reports_the_errors_it_was_given():
    points = synthetic_points()
    errors = np.array([0.0, 0.1, -0.2, 0.05, 0.0, 0.3, -0.1, 0.0, 0.0])
    model = points[:, 3] * (1.0 + errors)
    covered = np.array([True] * 3 + [False] * 6)
    out = compare(points, model, covered)
    g = out["grid"]
    assert g["all"]["n"] == 9
    assert g["all"]["median"] == pytest.approx(np.median(np.abs(errors)), abs=1e-4)
    assert g["all"]["p90"] == pytest.approx(np.quantile(np.abs(errors), 0.9), abs=1e-4)
    assert g["all"]["max"] == pytest.approx(0.3, abs=1e-4)
    assert g["all"]["bias"] == pytest.approx(errors.mean(), abs=1e-4)
    assert g["covered"]["n"] == 3 and g["covered"]["max"] == pytest.approx(0.2, abs=1e-4)
    assert g["uncovered"]["n"] == 6 and g["uncovered"]["median"] == pytest.approx(0.025, abs=1e-4)
    # Ratios: batch 32, q 4: measured 36/33; the model's (36·1.3)/(33·1.05).
    r = out["ratios"]["16-32"]["4"]
    assert r["measured"] == pytest.approx(36 / 33, abs=1e-4)
    assert r["model"] == pytest.approx(36 * 1.3 / (33 * 1.05), abs=1e-4)
    assert r["abs_err_max"] == pytest.approx(1.3 / 1.05 - 1, abs=1e-4)
    assert out["ratios"]["1"]["2"]["abs_err_max"] == pytest.approx(0.1, abs=1e-4)
    # Goals: median 5 % (met); the worst ratio at batch >= 32 is 1.3/1.05 - 1 = 23.8 % (not met).
    goals = out["goals"]
    assert goals["grid_median<=10%"] == {"value": 0.05, "met": True}
    ratio_goal = goals["ratio_q/1_batch>=32<=10%"]
    assert ratio_goal["value"] == pytest.approx(1.3 / 1.05 - 1, abs=1e-4) and not ratio_goal["met"]


def test_a_uniformly_scaled_model_has_exact_ratios():
    points = measured_points()
    out = compare(points, points[:, 3] * 1.07)
    assert out["grid"]["all"]["median"] == pytest.approx(0.07, abs=1e-4)
    assert out["grid"]["all"]["max"] == pytest.approx(0.07, abs=1e-4)
    assert all(r["abs_err_max"] < 1e-9 for per_q in out["ratios"].values() for r in per_q.values())
    assert out["goals"]["ratio_q/1_batch>=32<=10%"]["met"] and out["goals"]["grid_median<=10%"]["met"]


def test_measured_points_are_the_table_and_priced_as_the_controller_prices_a_step():
    points = measured_points()
    rows = json.loads((TABLE_DIR / "h200-llama3-8b.json").read_text())["verify"]
    assert len(points) == len(rows) == 105
    got = {(int(b), int(q), int(c)): ms for b, q, c, ms in points}
    assert got == {(r["batch"], r["tokens_per_request"], r["context"]): r["verify_ms"] for r in rows}
    # The simulator's truth returns every measured point, so the comparison is against the table itself.
    truth = MeasuredCostModel("H200-measured")
    np.testing.assert_allclose(truth.verify_ms(points[:, 0] * points[:, 1], points[:, 0] * points[:, 2],
                                               batch=points[:, 0]), points[:, 3], rtol=1e-9)
    # A model is asked for B*q batch tokens, B*c KV tokens and B*q*c attention pairs.
    p = CostParams(mem_ms=1.0, mem_ms_per_kv_token=1e-6, compute_ms=0.0, compute_ms_per_token=0.01,
                   compute_ms_per_pair=1e-9)
    b, q, c = points[:, 0], points[:, 1], points[:, 2]
    np.testing.assert_allclose(model_ms(p, points), np.maximum(1.0 + 1e-6 * b * c, 0.01 * b * q + 1e-9 * b * q * c))
    assert {f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in BATCH_BUCKETS} == {"1", "2-8", "16-32", "64-128", "256"}


def test_coverage_counts_steps_in_each_points_cell():
    points = measured_points()
    # Batch 40 lies in batch 32's cell (22.6-45.3), q = 2 in 1.41-2.83, 1024 context in 362-2896;
    # 100 tokens of context per request lies below every context cell.
    steps = np.array([[40, 80, 40 * 1024]] * 12 + [[2, 2, 200]] * 50 + [[4, 4, 4 * 8192]] * 3)
    counts, covered = coverage(points, steps, min_steps=10)
    idx = {(b, q, c): i for i, (b, q, c) in enumerate(points[:, :3])}
    assert counts[idx[(32, 2, 1024)]] == 12 and covered[idx[(32, 2, 1024)]]
    assert counts[idx[(4, 1, 8192)]] == 3 and not covered[idx[(4, 1, 8192)]]
    assert counts.sum() == 15 and covered.sum() == 1


def test_run_data_keeps_one_worker_on_the_measured_table():
    data = run_data(*RUNS[1], time_scale=0.5, seed=3)
    assert [w["id"] for w in data["workers"]] == [RUNS[1][1]]
    assert data["workers"][0]["hardware"] == "H200-measured" and data["seed"] == 3
    assert data["duration_s"] == pytest.approx(90.0)


def test_short_run_writes_the_report_and_the_fit_beats_the_prior(tmp_path):
    # threshold-cliff's worker at a tenth of its clock: ~2,000 steps, batches 1-50 at 1-3 tokens each.
    report = run_costfit_bench(tmp_path, runs=RUNS[1:], time_scale=0.1, progress=None)
    assert (tmp_path / "costfit.json").exists() and (tmp_path / "costfit.png").exists()
    on_disk = json.loads((tmp_path / "costfit.json").read_text())
    assert set(on_disk) == {"meta", "runs", "prior", "grid_fit", "points"}
    key, calibrated_key = "threshold-cliff/h100-mtp", "threshold-cliff/h100-mtp+calibration"
    assert list(on_disk["runs"]) == [key, calibrated_key]
    run, calibrated = on_disk["runs"][key], on_disk["runs"][calibrated_key]
    # The second run's worker sent the measured table as its Hello.calibration; where its live
    # steps meet the calibrated range the two agree (the truth is that table), so the scale stays ~1.
    assert run["calibration_samples"] == 0 and calibrated["calibration_samples"] == 105
    assert calibrated["calibration_scale"] == pytest.approx(1.0, abs=0.1)
    # Shapes the policy never ran are known from the calibration, not extrapolated.
    assert calibrated["grid"]["uncovered"]["median"] < run["grid"]["uncovered"]["median"]
    assert run["telemetry"]["steps"] > 100 and run["telemetry"]["spec_step_share"] > 0
    for section in (run, on_disk["prior"], on_disk["grid_fit"]):
        assert set(section["grid"]["all"]) >= {"median", "p90", "max", "n"}
        assert set(section["ratios"]) == {"1", "2-8", "16-32", "64-128", "256"}
        assert set(section["goals"]) == {"grid_median<=10%", "ratio_q/1_batch>=32<=10%"}
    assert set(run["grid"]) == {"all", "covered", "uncovered"}
    assert run["grid"]["covered"]["n"] + run["grid"]["uncovered"]["n"] == 105 and run["covered_points"] > 0
    assert len(on_disk["points"]) == 105
    # The fit learned something real: closer to the table than the roofline it started from.
    assert run["grid"]["all"]["median"] < on_disk["prior"]["grid"]["all"]["median"]
    assert report["runs"][key]["grid"] == run["grid"]
