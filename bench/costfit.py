"""``specctl bench costfit``: the controller's fitted step-cost model against a measured GPU.

Issue 28, item 4 (cost-model fidelity). The controller prices every plan with
the :class:`controller.models.cost.StepCostModel` it fits to one worker's
step reports. This benchmark gives that fit the telemetry it would get from
an H200 whose step costs are the measured table
(``worker/sim/hardware_tables/h200-llama3-8b.json`` through
:class:`worker.sim.measured.MeasuredCostModel`) and compares the fitted
model with the table.

Telemetry. Each run is one worker of a shipped scenario, alone and moved onto
``H200-measured``, driven by the real controller with the ``goodput`` preset
exactly as ``specctl bench policies`` drives its controller runs
(:class:`bench.policies.ControlledFleet`: reports batched per 100 ms into
``Controller.ingest``, plans delivered two worker steps later, speculation
off until the first plan). So the fit sees the batches and tree sizes the
policy picks, and its probes, nothing else. Default runs (:data:`RUNS`):

- ``mixed-fleet`` / ``h200-eagle``: 10 closed-loop users, 25 from 60 to 120 s,
  EAGLE trees up to 64 nodes: 10-25 requests at ~6-8 tokens each (up to
  180 batch tokens), contexts of 0.6k-10k; the policy grows trees up to the
  ridge (most steps cost 1.1-1.25x a plain decode of the same batch);
- ``threshold-cliff`` / its one worker (an H100 in the file, moved to the
  H200 table here): 2 -> 12 -> 64 -> 2 users with a two-token chain drafter:
  batches of 1-50 requests at 1-3 tokens each, short contexts; the ridge
  approached by the batch rather than the tree.

The JSON's ``telemetry`` says per run what the steps spanned and how far
past a plain decode's cost they went (``share_over_plain_x1.1`` / ``x1.25``).

The fitted model is the one the controller holds for that worker at the end
of the run: ``Controller.workers[id].cost.refit()`` (nothing is refitted
here outside the controller). The prior is that model's ``prior``: the
roofline :meth:`CostParams.from_hardware` builds from the worker's Hello (the
H200 hints and Llama-3-8B's sizes), what the controller starts from. A third
model, ``grid_fit``, is a :class:`StepCostModel` fed every measured point
itself (noise-free, :data:`GRID_FIT_REPEATS` times each, through
``observe_verify``): how close the model's functional form can get with
perfect coverage, so that what coverage costs and what the form costs can be
told apart.

Comparison (:func:`compare`), on the measured points only (105; the corners
the table leaves out are not judged): each point is ``batch`` B requests of
``q`` tokens over ``c`` context, priced by a fitted model as
``verify_ms(B·q, B·c, B·q·c)`` (what the controller's ingest computes from
such a step). Relative error ``model / measured - 1``; |error| median, p90,
max over all points, and separately over the points the run's telemetry
covered and the rest. A point is covered when at least
:data:`MIN_COVER_STEPS` steps fall in its cell: per axis (B, q = batch
tokens / B, c = KV tokens / B, log scale) the interval around the grid value
up to halfway to its neighbours (and as far beyond the first and last).

Ratios: the cost of q tokens per request over one token per request at the
same batch and context, model against measured (``fitted ratio / measured
ratio - 1``), per batch bucket (:data:`BATCH_BUCKETS`) and q.

Goals (the issue's): median |error| over the grid <= 10 %, and the q/1 ratios
within 10 % at batch >= 32 — every measured (B >= 32, q, c) point, so the
worst one decides (the median is reported beside it).

Deterministic: simulated time, seeded scenarios (``seed`` overrides their
seeds), the controller's clock is the simulator's.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from bench.policies import DEFAULT_DELAY_STEPS, ControlledFleet, compress_time, drive
from controller.config import ServerConfig
from controller.models.cost import CostParams, StepCostModel
from protos.speculation.v1 import worker_pb2
from policies.presets import load_preset
from worker.sim.measured import MEASURED_HARDWARE, TABLE_DIR
from worker.sim.scenario import load_scenario, scenario_from_dict
from worker.sim.worker import SimWorker, StepResult

HARDWARE = "H200-measured"
PRESET = "goodput"
# (scenario, worker id): each run keeps that one worker, on HARDWARE.
RUNS: tuple[tuple[str, str], ...] = (("mixed-fleet", "h200-eagle"), ("threshold-cliff", "h100-mtp"))
BATCH_BUCKETS: tuple[tuple[int, int], ...] = ((1, 1), (2, 8), (16, 32), (64, 128), (256, 256))
GOAL_GRID_MEDIAN = 0.10
GOAL_RATIO = 0.10
GOAL_RATIO_MIN_BATCH = 32
MIN_COVER_STEPS = 10
GRID_FIT_REPEATS = 10
CALIBRATED_SUFFIX = "+calibration"
QUICK_TIME_SCALE = 0.1
# Slices drawn in the PNG: (batch, context), cost against batch tokens over q = 1..16.
PLOT_SLICES: tuple[tuple[int, int], ...] = ((1, 1024), (8, 8192), (16, 1024), (32, 8192),
                                            (64, 1024), (128, 1024), (256, 1024), (4, 32768))


# ------------------------------------------------------------------ the table
def measured_points(table: str | None = None) -> np.ndarray:
    """The measured verify points of ``table`` (default: HARDWARE's) as rows
    ``(batch, tokens_per_request, context, verify_ms)``, sorted."""
    name = table or MEASURED_HARDWARE[HARDWARE].table
    path = Path(name) if Path(name).is_absolute() else TABLE_DIR / name
    rows = json.loads(path.read_text())["verify"]
    out = np.array([(r["batch"], r["tokens_per_request"], r["context"], r["verify_ms"]) for r in rows], dtype=float)
    return out[np.lexsort((out[:, 2], out[:, 1], out[:, 0]))]


def model_ms(params: CostParams, points: np.ndarray) -> np.ndarray:
    """``params``' price of each point ``(B, q, c, ...)``: B requests of q new tokens over c cached tokens each."""
    b, q, c = points[:, 0], points[:, 1], points[:, 2]
    return np.asarray(params.verify_ms(b * q, b * c, b * q * c), dtype=float)


# ----------------------------------------------------------------- comparison
def _stats(abs_err: np.ndarray) -> dict[str, Any]:
    if abs_err.size == 0:
        return {"n": 0, "median": None, "p90": None, "max": None}
    return {"n": int(abs_err.size), "median": round(float(np.median(abs_err)), 4),
            "p90": round(float(np.quantile(abs_err, 0.9)), 4), "max": round(float(abs_err.max()), 4)}


def bucket_of(batch: float) -> str | None:
    for lo, hi in BATCH_BUCKETS:
        if lo <= batch <= hi:
            return str(lo) if lo == hi else f"{lo}-{hi}"
    return None


def ratio_rows(points: np.ndarray, model: np.ndarray) -> list[dict[str, float]]:
    """Per measured (B, q > 1, c) whose one-token point is measured too: the measured
    and the model's cost of q tokens per request over one."""
    measured = {(b, q, c): ms for b, q, c, ms in points[:, :4]}
    priced = {(b, q, c): m for (b, q, c), m in zip(map(tuple, points[:, :3]), model)}
    out = []
    for (b, q, c), ms in measured.items():
        base = (b, 1.0, c)
        if q <= 1 or base not in measured:
            continue
        out.append({"batch": b, "q": q, "context": c, "measured": ms / measured[base],
                    "model": priced[(b, q, c)] / priced[base]})
    return out


def compare(points: np.ndarray, model: np.ndarray, covered: np.ndarray | None = None) -> dict[str, Any]:
    """A model's prices (``model``, one per row of ``points``) against the measured ones.

    Returns ``grid`` (|relative error| median / p90 / max, and mean signed
    error as ``bias``, over ``all`` points and, given ``covered``, the
    ``covered`` and ``uncovered`` ones), ``ratios`` (per batch bucket and q:
    mean measured and model q/1 ratio, |ratio error| median and max) and
    ``goals``.
    """
    measured = points[:, 3]
    err = model / measured - 1.0
    grid: dict[str, Any] = {"all": {**_stats(np.abs(err)), "bias": round(float(err.mean()), 4)}}
    if covered is not None:
        for key, mask in (("covered", covered), ("uncovered", ~covered)):
            grid[key] = {**_stats(np.abs(err[mask])), "bias": round(float(err[mask].mean()), 4) if mask.any() else None}
    rows = ratio_rows(points, model)
    ratios: dict[str, Any] = {}
    for lo, hi in BATCH_BUCKETS:
        name = bucket_of(lo)
        per_q = {}
        for q in sorted({r["q"] for r in rows}):
            sel = [r for r in rows if lo <= r["batch"] <= hi and r["q"] == q]
            if not sel:
                continue
            m = np.array([r["measured"] for r in sel])
            f = np.array([r["model"] for r in sel])
            e = np.abs(f / m - 1.0)
            per_q[f"{q:g}"] = {"measured": round(float(m.mean()), 4), "model": round(float(f.mean()), 4),
                               "abs_err_median": round(float(np.median(e)), 4), "abs_err_max": round(float(e.max()), 4),
                               "n": len(sel)}
        ratios[name] = per_q
    big = np.array([abs(r["model"] / r["measured"] - 1.0) for r in rows if r["batch"] >= GOAL_RATIO_MIN_BATCH])
    median = float(np.median(np.abs(err)))
    goals = {
        f"grid_median<={GOAL_GRID_MEDIAN:.0%}": {"value": round(median, 4), "met": bool(median <= GOAL_GRID_MEDIAN)},
        f"ratio_q/1_batch>={GOAL_RATIO_MIN_BATCH}<={GOAL_RATIO:.0%}": {
            "value": round(float(big.max()), 4) if big.size else None,
            "median": round(float(np.median(big)), 4) if big.size else None,
            "met": bool(big.size and big.max() <= GOAL_RATIO)},
    }
    return {"grid": grid, "ratios": ratios, "goals": goals}


# ------------------------------------------------------------------- coverage
def _cells(grid_values: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Index of the grid value whose log-scale cell holds each ``x`` (-1 outside every cell)."""
    g = np.log(grid_values)
    mid = (g[1:] + g[:-1]) / 2
    bounds = np.concatenate([[g[0] - (g[1] - g[0]) / 2], mid, [g[-1] + (g[-1] - g[-2]) / 2]])
    lx = np.log(np.maximum(x, 1e-12))
    idx = np.searchsorted(bounds, lx, side="right") - 1
    return np.where((idx >= 0) & (idx < len(g)), idx, -1)


def coverage(points: np.ndarray, steps: np.ndarray, min_steps: int = MIN_COVER_STEPS) -> tuple[np.ndarray, np.ndarray]:
    """Per measured point, the telemetry steps in its cell and whether that makes it covered.

    ``steps``: rows ``(batch, batch_tokens, kv_tokens, ...)``, one per step.
    """
    axes = [np.unique(points[:, k]) for k in range(3)]
    counts = np.zeros([len(a) for a in axes], dtype=np.int64)
    if len(steps):
        b = steps[:, 0]
        idx = [_cells(axes[0], b), _cells(axes[1], steps[:, 1] / b), _cells(axes[2], steps[:, 2] / b)]
        ok = np.all([i >= 0 for i in idx], axis=0)
        np.add.at(counts, tuple(i[ok] for i in idx), 1)
    where = [np.searchsorted(a, points[:, k]) for k, a in enumerate(axes)]
    n = counts[tuple(where)]
    return n, n >= min_steps


# -------------------------------------------------------------- the telemetry
def run_data(scenario: str, worker: str, time_scale: float = 1.0, seed: int | None = None) -> dict:
    """The scenario with only ``worker``, on :data:`HARDWARE`, its clock scaled by ``time_scale``."""
    data = load_scenario(scenario).model_dump(mode="json", exclude_none=True)
    entry = MEASURED_HARDWARE[HARDWARE]
    kept = [w for w in data["workers"] if w["id"] == worker]
    if not kept:
        raise ValueError(f"scenario {data['name']!r} has no worker {worker!r}")
    w = kept[0]
    if w.get("model", entry.model) != entry.model or (w.get("gpus") or 1) != 1:
        raise ValueError(f"{data['name']}/{worker}: {HARDWARE} prices one GPU running {entry.model}")
    w.update(hardware=HARDWARE, count=1)
    data["workers"] = [w]
    if seed is not None:
        data["seed"] = seed
    if time_scale != 1.0:
        data = compress_time(data, time_scale)
    return data


def table_calibration_samples(table: str | None = None) -> list[worker_pb2.VerifySample]:
    """The measured table's verify rows as ``Hello.calibration`` (what ``specctl calibrate`` on that GPU
    writes and ``specctl worker --calibration`` sends): one sample per measured point, ``repeats`` as
    measured (capped at the proto's 64)."""
    path = TABLE_DIR / (table or MEASURED_HARDWARE[HARDWARE].table)
    data = json.loads(path.read_text())
    repeats = int(min(max(int((data.get("info") or {}).get("repeats", 1)), 1), 64))
    return [worker_pb2.VerifySample(batch_size=int(r["batch"]), batch_tokens=int(r["batch_tokens"]),
                                    kv_tokens=int(r["kv_tokens"]), verify_ms=float(r["verify_ms"]), repeats=repeats)
            for r in data["verify"]]


def run_telemetry(data: dict, progress: Callable[[str], None] | None = None,
                  delay_steps: int = DEFAULT_DELAY_STEPS, calibration: Sequence = ()) -> dict[str, Any]:
    """Drive the scenario's one worker under the controller (goodput preset); return the
    controller's fitted cost model, its prior and the steps' shapes. ``calibration``: the worker's
    ``Hello.calibration`` (none by default)."""
    scenario = scenario_from_dict(data, data["name"])
    workers = SimWorker.fleet(scenario)
    policy = load_preset(PRESET, scenario.preset_config.get(PRESET), f"{data['name']}: preset_config.{PRESET}")
    fleet = ControlledFleet(workers, policy, ServerConfig(), delay_steps, calibration=calibration)
    shapes: list[tuple[float, float, float, float]] = []
    duration = scenario.duration_s
    next_report = [duration / 10]

    def after(i: int, result: StepResult) -> None:
        t = result.telemetry
        n = t.batch_size
        tokens = n + sum(r.nodes for r in t.requests)
        kv = sum(r.context_len for r in t.requests)
        pairs = sum((1 + r.nodes) * r.context_len for r in t.requests)
        shapes.append((n, tokens, kv, pairs, t.verify_ms))
        fleet.after(i, result)
        if progress is not None and result.end >= next_report[0]:
            progress(f"  {data['name']}: {min(result.end, duration):6.1f} / {duration:.0f} s simulated, "
                     f"{len(shapes):,} steps")
            next_report[0] += duration / 10

    started = time.perf_counter()
    drive(workers, [link.decide for link in fleet.links], duration, after=after)
    state = fleet.controller.workers[workers[0].worker_id]
    fitted = state.cost.refit()
    return {"fitted": fitted, "prior": state.cost.prior, "model": state.cost, "steps": np.asarray(shapes, dtype=float),
            "wall_s": time.perf_counter() - started, "plans_applied": fleet.links[0].plans_applied,
            "worker": workers[0]}


def grid_fit(points: np.ndarray, prior: CostParams, repeats: int = GRID_FIT_REPEATS) -> CostParams:
    """A StepCostModel fed every measured point ``repeats`` times (noise-free): the form's best case."""
    model = StepCostModel(prior=prior)
    for _ in range(repeats):
        for b, q, c, ms in points[:, :4]:
            model.observe_verify(b * q, b * c, ms, b * q * c)
    return model.refit()


def params_dict(p: CostParams) -> dict[str, Any]:
    out = {k: (round(v, 9) if isinstance(v, float) else v) for k, v in vars(p).items()
           if not k.startswith("_") and k not in ("compute_knots", "compute_rise_ms", "compute_evidence", "live_evidence")}
    if p.compute_knots:
        out["compute_curve"] = [[k, round(r, 4)] for k, r in zip(p.compute_knots, p.compute_rise_ms)]
    return out


def telemetry_summary(steps: np.ndarray, truth: np.ndarray, fitted: np.ndarray, plain: np.ndarray) -> dict[str, Any]:
    """What the steps spanned, and the fit against the (noise-free) truth at the shapes it saw.

    ``truth``: the table's price of each step; ``plain``: of the same batch at one token per request
    (the share of steps costing 25 % more than that says how far past the ridge the policy went)."""
    if not len(steps):
        return {"steps": 0}
    b, t, kv = steps[:, 0], steps[:, 1], steps[:, 2]
    q, c = t / b, kv / b

    def span(x: np.ndarray) -> list[float]:
        return [round(float(v), 2) for v in np.quantile(x, (0.0, 0.5, 0.9, 1.0))]

    err = np.abs(fitted / truth - 1.0)
    return {"steps": int(len(steps)), "batch_min_median_p90_max": span(b), "tokens_per_request": span(q),
            "batch_tokens": span(t), "context_per_request": span(c),
            "spec_step_share": round(float(np.mean(t > b)), 4),
            "share_over_plain_x1.1": round(float(np.mean(truth > 1.1 * plain)), 4),
            "share_over_plain_x1.25": round(float(np.mean(truth > 1.25 * plain)), 4),
            "fit_at_observed_shapes": _stats(err)}


# ------------------------------------------------------------------ the bench
def run_costfit_bench(out_dir: str | Path = "bench/results", *, runs: Sequence[tuple[str, str]] = RUNS,
                      time_scale: float = 1.0, seed: int | None = None, plots: bool = True,
                      calibrated: bool = True, progress: Callable[[str], None] | None = print) -> dict[str, Any]:
    """Run the benchmark; write ``costfit.json`` (and ``costfit.png``) to ``out_dir``; return the report."""
    started = time.perf_counter()
    say = progress or (lambda _msg: None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    points = measured_points()
    report: dict[str, Any] = {
        "meta": {
            "benchmark": "specctl bench costfit",
            "hardware": HARDWARE,
            "table": f"worker/sim/hardware_tables/{MEASURED_HARDWARE[HARDWARE].table}",
            "measured_points": int(len(points)),
            "preset": PRESET,
            "delay_steps": DEFAULT_DELAY_STEPS,
            "time_scale": time_scale,
            "seed": seed if seed is not None else "the scenarios' own",
            "fitted": "the controller's StepCostModel for the worker at the end of the run (Controller.workers[id]"
                      ".cost.refit())",
            "prior": "that model's prior: CostParams.from_hardware on the worker's Hello hints (H200, Llama-3-8B)",
            "calibrated": f"runs named '...{CALIBRATED_SUFFIX}': the same run with the worker's Hello carrying the "
                          "measured table as its calibration (what specctl calibrate on that GPU writes and "
                          "specctl worker --calibration sends); the fit is still the controller's, live steps "
                          "and calibration together",
            "grid_fit": f"a StepCostModel fed every measured point {GRID_FIT_REPEATS}x, noise-free: the form's "
                        "best case",
            "pricing": "a point (B requests, q tokens, c context) is verify_ms(B*q, B*c, B*q*c)",
            "error": "model / measured - 1 per measured point; |error| median, p90, max",
            "coverage": f"a point is covered when >= {MIN_COVER_STEPS} steps fall in its cell (per axis B, "
                        "q = batch tokens / B, c = KV tokens / B: halfway to the neighbouring grid values in log)",
            "ratio": "cost(B, q, c) / cost(B, 1, c); error fitted ratio / measured ratio - 1; per batch bucket "
                     "and q: mean ratios, |error| median and max",
            "goals": f"median |error| over the grid <= {GOAL_GRID_MEDIAN:.0%}; every q/1 ratio at batch >= "
                     f"{GOAL_RATIO_MIN_BATCH} within {GOAL_RATIO:.0%}",
            "runtime_s": None,
        },
        "runs": {},
    }
    prior: CostParams | None = None
    priced: dict[str, np.ndarray] = {}
    covered_by: dict[str, np.ndarray] = {}
    counted: dict[str, np.ndarray] = {}
    samples = table_calibration_samples()
    variants = [(scenario, worker, cal) for scenario, worker in runs for cal in ((), samples)[:1 + calibrated]]
    for scenario, worker, calibration in variants:
        data = run_data(scenario, worker, time_scale, seed)
        key = f"{data['name']}/{worker}" + (CALIBRATED_SUFFIX if calibration else "")
        say(f"costfit: {key} on {HARDWARE}, {data['duration_s']:.0f} s simulated, preset {PRESET}")
        res = run_telemetry(data, say, calibration=calibration)
        prior = res["prior"] if prior is None else prior
        steps = res["steps"]
        fitted = res["fitted"]
        counts, covered = coverage(points, steps)
        ms = model_ms(fitted, points)
        cost = res["worker"].cost
        truth = cost.verify_ms(steps[:, 1], steps[:, 2], 0.0, batch=steps[:, 0]) if len(steps) else np.zeros(0)
        plain = cost.verify_ms(steps[:, 0], steps[:, 2], 0.0, batch=steps[:, 0]) if len(steps) else np.zeros(0)
        # The fit's price of each step it saw (with the step's own attention pairs, as the controller
        # prices a plan) against the truth's noise-free one.
        at_steps = (np.asarray(fitted.verify_ms(steps[:, 1], steps[:, 2], steps[:, 3]), dtype=float) if len(steps)
                    else np.zeros(0))
        entry = {
            "scenario": data["name"], "worker": worker, "duration_s": data["duration_s"],
            "seed": data["seed"], "wall_s": round(res["wall_s"], 2), "plans_applied": res["plans_applied"],
            "samples": res["model"].samples, "rmse_ms": round(res["model"].rmse_ms, 4),
            "calibration_samples": res["model"].calibration_samples,
            "calibration_scale": round(res["model"].calibration_scale, 4),
            "telemetry": telemetry_summary(steps, truth, at_steps, plain),
            "covered_points": int(covered.sum()),
            **compare(points, ms, covered),
            "params": params_dict(fitted),
        }
        report["runs"][key] = entry
        priced[key], covered_by[key], counted[key] = ms, covered, counts
        g = entry["grid"]
        say(f"  fitted: median {g['all']['median']:.1%}, p90 {g['all']['p90']:.1%} over {g['all']['n']} points "
            f"({entry['covered_points']} covered: median {_pct(g['covered']['median'])}; "
            f"uncovered {_pct(g['uncovered']['median'])})")
    assert prior is not None
    prior_ms = model_ms(prior, points)
    report["prior"] = {**compare(points, prior_ms), "params": params_dict(prior)}
    say("costfit: fitting the form to the whole table (grid_fit)")
    best = grid_fit(points, prior)
    best_ms = model_ms(best, points)
    report["grid_fit"] = {**compare(points, best_ms), "params": params_dict(best)}
    report["points"] = [
        {"batch": int(b), "q": int(q), "context": int(c), "measured_ms": round(float(m), 4),
         "prior_ms": round(float(p), 4), "grid_fit_ms": round(float(g), 4),
         "fitted_ms": {k: round(float(v[i]), 4) for k, v in priced.items()},
         "steps_in_cell": {k: int(v[i]) for k, v in counted.items()},
         "covered": {k: bool(v[i]) for k, v in covered_by.items()}}
        for i, (b, q, c, m, p, g) in enumerate(zip(*points[:, :4].T, prior_ms, best_ms))
    ]
    report["meta"]["runtime_s"] = round(time.perf_counter() - started, 2)
    (out / "costfit.json").write_text(json.dumps(report, indent=1) + "\n")
    if plots:
        plot_costfit(report, out / "costfit.png")
    say(summary_text(report))
    say(f"wrote {out / 'costfit.json'}" + (f" and {out / 'costfit.png'}" if plots else "")
        + f" in {report['meta']['runtime_s']:.1f} s")
    return report


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def summary_text(report: dict) -> str:
    """The numbers and goals, as printed at the end of a run."""
    lines = ["", "model            grid |err| median / p90 / max   covered median   uncovered median"]
    models = [*report["runs"].items(), ("prior", report["prior"]), ("grid_fit", report["grid_fit"])]
    for name, e in models:
        g = e["grid"]
        lines.append(f"{name:<28} {_pct(g['all']['median']):>6} / {_pct(g['all']['p90']):>6} / "
                     f"{_pct(g['all']['max']):>6}   {_pct(g.get('covered', {}).get('median')):>8}   "
                     f"{_pct(g.get('uncovered', {}).get('median')):>8}")
    lines.append("")
    lines.append("q/1 ratio (mean over the bucket's points): measured | prior | " + " | ".join(report["runs"])
                 + " | grid_fit")
    for bucket, per_q in report["prior"]["ratios"].items():
        for q, r in per_q.items():
            cells = [f"{report['runs'][k]['ratios'][bucket][q]['model']:.2f}" for k in report["runs"]]
            lines.append(f"  batch {bucket:>7} q={q:>2}: {r['measured']:.2f} | {r['model']:.2f} | "
                         + " | ".join(cells) + f" | {report['grid_fit']['ratios'][bucket][q]['model']:.2f}")
    lines.append("")
    for name, e in models:
        for goal, g in e["goals"].items():
            extra = f" (median {_pct(g['median'])})" if "median" in g else ""
            lines.append(f"goal {goal:<28} {name:<28} {_pct(g['value']):>7}{extra}  "
                         f"{'met' if g['met'] else 'NOT met'}")
    return "\n".join(lines)


# ---------------------------------------------------------------------- plot
def plot_costfit(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = report["points"]
    runs = list(report["runs"])
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    slices = [(b, c) for b, c in PLOT_SLICES if any(p["batch"] == b and p["context"] == c for p in pts)]
    ncol = 4
    nrow_slices = math.ceil(len(slices) / ncol)
    fig, axes = plt.subplots(nrow_slices + 1, ncol, figsize=(4.2 * ncol, 3.4 * (nrow_slices + 1)), squeeze=False)
    for ax, (b, c) in zip(axes[:nrow_slices].ravel(), slices):
        sel = sorted((p for p in pts if p["batch"] == b and p["context"] == c), key=lambda p: p["q"])
        x = [b * p["q"] for p in sel]
        ax.plot(x, [p["measured_ms"] for p in sel], "ko-", lw=2, label="measured (H200 table)")
        ax.plot(x, [p["prior_ms"] for p in sel], "--", color="grey", label="roofline prior")
        for k, col in zip(runs, colors):
            cov = [p["covered"][k] for p in sel]
            ax.plot(x, [p["fitted_ms"][k] for p in sel], "-", color=col, label=f"fitted: {k}")
            ax.plot([xi for xi, cv in zip(x, cov) if cv], [p["fitted_ms"][k] for p, cv in zip(sel, cov) if cv],
                    "o", color=col, ms=4)
        ax.plot(x, [p["grid_fit_ms"] for p in sel], ":", color="tab:purple", label="form fitted to the whole table")
        ax.set_xscale("log", base=2)
        ax.set_title(f"batch {b}, context {c // 1024}k", fontsize=10)
        ax.set_xlabel("batch tokens (batch x q, q = 1..16)", fontsize=8)
        ax.set_ylabel("verify ms", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in axes[:nrow_slices].ravel()[len(slices):]:
        ax.axis("off")
    axes[0, 0].legend(fontsize=6, loc="upper left")
    buckets = list(report["prior"]["ratios"])
    qs = list(report["prior"]["ratios"][buckets[-1]])[-ncol:]
    for ax, q in zip(axes[-1], qs):
        xs = np.arange(len(buckets))
        have = [b for b in buckets if q in report["prior"]["ratios"][b]]
        xi = [buckets.index(b) for b in have]
        ax.plot(xi, [report["prior"]["ratios"][b][q]["measured"] for b in have], "ko-", lw=2, label="measured")
        ax.plot(xi, [report["prior"]["ratios"][b][q]["model"] for b in have], "--", color="grey", marker="s",
                label="prior")
        for k, col in zip(runs, colors):
            ax.plot(xi, [report["runs"][k]["ratios"][b][q]["model"] for b in have], "-", color=col, marker="o",
                    label=f"fitted: {k}")
        ax.plot(xi, [report["grid_fit"]["ratios"][b][q]["model"] for b in have], ":", color="tab:purple", marker="^",
                label="grid_fit")
        ax.set_xticks(xs)
        ax.set_xticklabels(buckets, fontsize=8)
        ax.set_xlabel("batch bucket", fontsize=8)
        ax.set_ylabel(f"cost(q={q}) / cost(q=1)", fontsize=8)
        ax.set_title(f"q/1 ratio, q = {q} (mean over contexts)", fontsize=10)
        ax.grid(alpha=0.3)
    axes[-1, 0].legend(fontsize=6)
    med = ", ".join(f"{k} {report['runs'][k]['grid']['all']['median']:.1%}" for k in runs)
    fig.suptitle(f"Fitted step cost vs the measured H200 table (median |error|: prior "
                 f"{report['prior']['grid']['all']['median']:.1%}, {med}; dots: covered by telemetry)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
