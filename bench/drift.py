"""``specctl bench drift``: drift detectors on seeded acceptance streams with known change points.

Each stream is a sequence of request-steps (one request's part of one engine
step): context length, batch size, the depth the policy drafted at that
batch size, and the accepted length τ. τ comes from the simulator's
per-position acceptance model (``worker.sim.acceptance``: EAGLE profile,
trained context 8192, acceptance decaying with context inside and — faster
— beyond the trained length, more so at deeper positions), so the context
effect is real: a context-mix shift lowers pooled acceptance with no change
of content.

Streams (change at ``change_at``):

* ``abrupt_drop`` — every per-position acceptance × 0.9 (10 % relative drop);
* ``gradual_decline`` — the same drop reached linearly over ``ramp`` steps;
* ``context_mix`` — context lengths move from a median of 1.4k to 5k tokens
  (part of them past the trained 8k): no content change;
* ``batch_shift`` — batches grow from 1-16 to 24-128 requests, the policy
  drafts shallower: no content change;
* ``variance_same_mean`` — each step is either near all-accept (α = 0.98)
  or near all-reject (α × 0.3), mixed so that E[τ] of every step is
  unchanged;
* ``no_change``.

Detectors: our :class:`~controller.drift.monitor.AcceptanceDriftMonitor`
(and its two detectors on their own), a pooled-mean CUSUM calibrated to the
same false-alarm budget, and river's ADWIN (delta 0.002), PageHinkley
(threshold 50, delta 0.005) and KSWIN (alpha 0.005, window 100, stat 30) fed
the same per-request-step τ. Scoring follows river's ``drift/evaluate.py``:
an alarm inside ``[start, end + delta_max]`` of a drift is a detection
(delay = first such alarm − start), any other alarm is a false alarm; missed
rate, false alarms per 100k request-steps and the mean time between false
alarms (MTFA) are reported per detector and stream over several seeds.

False alarms are also counted on long no-change streams (``null_long``,
millions of request-steps): the short streams cannot tell one alarm per
million request-steps from one per ten million, and "earlier detection at no
more false alarms" needs the rates measured side by side, not the nominal
budget a detector was calibrated to.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

import numpy as np

TRAINED_CONTEXT = 8192
MAX_DEPTH = 8
SEEDS = tuple(range(24))
KSWIN_SEEDS = 3  # KSWIN costs ~0.5 ms per update: it runs on the first seeds only
DELTA_MAX = 6000
# Nominal request-steps between false alarms our monitor and the pooled-mean CUSUM are calibrated to.
# The CUSUM's calibration is conservative at this scale (measured; likely because it bounds the alarm rate
# averaged over the baseline's estimation error), so false alarms are *measured* on long streams
# without drift (``null_long``) and compared with river's there: that is the "no more false alarms".
ERT = 300_000.0
ERT_STRICT = 1_500_000.0  # the monitor again at a 5x stricter nominal budget: the delay it costs
DETECTORS = ("specctl_monitor", "specctl_monitor_strict", "specctl_cusum", "specctl_chi2", "pooled_mean", "adwin",
             "page_hinkley", "kswin")
# Long no-change streams on which every detector's false-alarm rate is measured (KSWIN is too slow).
NULL_SEEDS = tuple(range(100, 140))  # 20M request-steps per detector
NULL_STEPS = 500_000
NULL_DETECTORS = ("specctl_monitor", "pooled_mean", "adwin", "page_hinkley")
JSON_KEYS = ("delay_median", "missed_rate", "false_alarms_per_100k", "retrain_alerts")


@dataclass(frozen=True)
class StreamSpec:
    """A seeded stream of request-steps with a known change point."""

    name: str
    kind: str  # none | abrupt | gradual | context | batch | variance
    n: int = 16_000
    change_at: int = 10_000
    ramp: int = 4_000
    drop: float = 0.10

    def drifts(self) -> list[int | tuple[int, int]]:
        """Ground-truth drifts that call for an alert (context and batch shifts do not)."""
        if self.kind in ("abrupt", "variance"):
            return [self.change_at]
        if self.kind == "gradual":
            return [(self.change_at, self.change_at + self.ramp)]
        return []


STREAMS: tuple[StreamSpec, ...] = (
    StreamSpec("abrupt_drop", "abrupt"),
    StreamSpec("gradual_decline", "gradual"),
    StreamSpec("context_mix", "context"),
    StreamSpec("batch_shift", "batch"),
    StreamSpec("variance_same_mean", "variance"),
    StreamSpec("no_change", "none"),
)


def policy_depth(batch: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Depth a goodput policy would draft at each batch size (deep when memory-bound), ±1 probes."""
    depth = np.select([batch <= 8, batch <= 16, batch <= 64], [6, 5, 3], 2)
    probe = rng.random(batch.size) < 0.1
    depth = depth + np.where(probe, rng.choice([-1, 1], size=batch.size), 0)
    return np.clip(depth, 1, MAX_DEPTH)


def _expected_tau(alpha: np.ndarray, depth: np.ndarray) -> np.ndarray:
    live = np.arange(alpha.shape[1])[None, :] < depth[:, None]
    return (np.cumprod(alpha, axis=1) * live).sum(axis=1)


def make_stream(spec: StreamSpec, seed: int) -> dict[str, np.ndarray]:
    """Context length, batch size, depth and accepted length τ per request-step."""
    from worker.sim.acceptance import PROFILES, context_factor

    profile = PROFILES["eagle"]
    rng = np.random.default_rng([seed, sum(map(ord, spec.name))])
    n, t0 = spec.n, spec.change_at
    t = np.arange(n)
    after = t >= t0
    moved = after if spec.kind == "context" else np.zeros(n, dtype=bool)
    median = np.where(moved, 5000.0, 1400.0)
    sigma = np.where(moved, 0.6, 0.8)
    ctx = np.clip(rng.lognormal(np.log(median), sigma), 32, 120_000).astype(np.int64)
    grown = after if spec.kind == "batch" else np.zeros(n, dtype=bool)
    batch = np.where(grown, rng.integers(24, 129, n), rng.integers(1, 17, n))
    depth = policy_depth(batch, rng)
    factor = np.ones(n)
    if spec.kind == "abrupt":
        factor[after] = 1.0 - spec.drop
    elif spec.kind == "gradual":
        factor = 1.0 - spec.drop * np.clip((t - t0) / spec.ramp, 0.0, 1.0)
    base = np.array([profile.alpha[min(k, len(profile.alpha) - 1)] for k in range(MAX_DEPTH)])
    alpha = base[None, :] * context_factor(ctx, TRAINED_CONTEXT, profile, MAX_DEPTH) * factor[:, None]
    alpha = np.minimum(alpha, profile.row_cap)
    if spec.kind == "variance":
        easy_alpha = np.full_like(alpha, profile.row_cap)
        hard_alpha = alpha * 0.3
        e0, e_easy, e_hard = (_expected_tau(a, depth) for a in (alpha, easy_alpha, hard_alpha))
        p_easy = np.clip((e0 - e_hard) / (e_easy - e_hard), 0.0, 1.0)
        easy = rng.random(n) < p_easy
        alpha = np.where(after[:, None], np.where(easy[:, None], easy_alpha, hard_alpha), alpha)
    ok = rng.random((n, MAX_DEPTH)) < alpha
    ok &= np.arange(MAX_DEPTH)[None, :] < depth[:, None]
    tau = np.cumprod(ok, axis=1).sum(axis=1)
    return {"ctx": ctx, "batch": batch, "depth": depth, "tau": tau}


# ---------------------------------------------------------------- scoring
def match(alarms: Sequence[int], drifts: Sequence[int | tuple[int, int]], delta_max: int) -> tuple[dict, list]:
    """river ``drift.evaluate.match``: hits per drift window, the rest false alarms."""
    windows = []
    for d in drifts:
        start, end = d if isinstance(d, tuple) else (d, d)
        windows.append((start, start, end + delta_max))
    hits: dict[int, list[int]] = {}
    false = []
    for a in alarms:
        for i, (_, lo, hi) in enumerate(windows):
            if lo <= a <= hi:
                hits.setdefault(i, []).append(a)
                break
        else:
            false.append(a)
    return hits, false


def score_runs(runs: list[dict[str, Any]], spec: StreamSpec) -> dict[str, Any]:
    """Aggregate one detector's runs (one per seed) on one stream."""
    drifts = spec.drifts()
    starts = [d[0] if isinstance(d, tuple) else d for d in drifts]
    delays, missed, n_drifts, false_total, gaps, n_total, alarms = [], 0, 0, 0, [], 0, 0
    retrain = extend = investigate = 0
    for run in runs:
        hits, false = match(run["alarms"], drifts, DELTA_MAX)
        for i, start in enumerate(starts):
            n_drifts += 1
            if i in hits:
                delays.append(min(hits[i]) - start)
            else:
                missed += 1
        false_total += len(false)
        gaps += [b - a for a, b in zip(false, false[1:])]
        n_total += spec.n
        alarms += len(run["alarms"])
        retrain += run.get("retrain", 0)
        extend += run.get("extend", 0)
        investigate += run.get("investigate", 0)
    out = {
        "delay_median": float(np.median(delays)) if delays else None,
        "missed_rate": missed / n_drifts if n_drifts else None,
        "false_alarms_per_100k": round(false_total / n_total * 1e5, 2),
        "mtfa": float(np.mean(gaps)) if gaps else None,
        "alarms": alarms,
        "delays": delays,
        "retrain_alerts": None,
        "alarm_times": [list(run["alarms"]) for run in runs],
    }
    if runs and "retrain" in runs[0]:
        out.update(retrain_alerts=retrain, extend_alerts=extend, investigate_alerts=investigate)
    return out


# -------------------------------------------------------------- detectors
def run_monitor(data: dict[str, np.ndarray], seed: int, ert: float = ERT) -> dict[str, dict[str, Any]]:
    """Our monitor on one stream: alarms of the monitor and of each of its detectors."""
    from controller.drift import AcceptanceDriftMonitor, Action

    limits = SimpleNamespace(kind="eagle", version="heads-v1", max_depth=MAX_DEPTH, max_width=1,
                             trained_context_len=TRAINED_CONTEXT, max_tree_nodes=MAX_DEPTH)
    mon = AcceptanceDriftMonitor(baseline_steps=800, window=400, round_steps=500, ert=ert, seed=seed)
    events: list[tuple[int, Any]] = []
    t_now = [0]
    mon.listeners.append(lambda ev, a: events.append((t_now[0], a)) if ev == "opened" else None)
    observe = mon.observe_request
    for i, (c, d, tau) in enumerate(zip(data["ctx"].tolist(), data["depth"].tolist(), data["tau"].tolist())):
        t_now[0] = i
        observe(limits, c, tau, d, (), (), "", float(i), "w0")
    actionable = [(t, a) for t, a in events if a.action is not Action.EXTEND_TRAINING_CONTEXT]
    counts = {
        "retrain": sum(a.action is Action.RETRAIN_HEADS for _, a in events),
        "extend": sum(a.action is Action.EXTEND_TRAINING_CONTEXT for _, a in events),
        "investigate": sum(a.action is Action.INVESTIGATE for _, a in events),
    }
    # One alarm per step at which the monitor raised anything (a CUSUM alarm may name several strata).
    return {
        "specctl_monitor": {"alarms": sorted({t for t, _ in actionable}), **counts},
        "specctl_cusum": {"alarms": sorted({t for t, a in actionable if a.detector == "cusum"})},
        "specctl_chi2": {"alarms": sorted({t for t, a in actionable if a.detector == "chi2"})},
    }


def run_scalar(detector: Any, xs: np.ndarray) -> dict[str, Any]:
    alarms = []
    for i, x in enumerate(xs.tolist()):
        detector.update(x)
        if detector.drift_detected:
            alarms.append(i)
    return {"alarms": alarms}


def pooled_mean_cusum(tau: np.ndarray, seed: int) -> Any:
    """Two-sided CUSUM on pooled τ, ±5 % slack, calibrated to ``ERT``.

    It needs a precise target: with 800 samples its error (~3 %) rivals the
    5 % slack and the calibration (averaged over the target's error) has to
    set a very high threshold, hence a 4000-step baseline.
    """
    from controller.drift import CUSUM

    n_base = 4000
    return CUSUM(direction="both", slack=0.05 * float(tau[:n_base].mean()), ert=ERT, n_baseline=n_base, seed=seed)


def run_task(spec: StreamSpec, seed: int, which: str,
             strict: bool = True) -> tuple[str, int, dict[str, dict[str, Any]], float]:
    """One (stream, seed, detector group) job; runs in a worker process.

    ``which``: ``ours`` (the monitor at ``ERT`` and ``ERT_STRICT``, its
    detectors, the pooled-mean CUSUM), ``river`` (ADWIN, PageHinkley) or
    ``kswin``; ``strict=False`` skips the monitor at ``ERT_STRICT``.
    """
    t = time.perf_counter()
    data = make_stream(spec, seed)
    tau = data["tau"].astype(np.float64)
    out: dict[str, dict[str, Any]] = {}
    if which == "ours":
        out.update(run_monitor(data, seed))
        if strict:
            out["specctl_monitor_strict"] = run_monitor(data, seed, ert=ERT_STRICT)["specctl_monitor"]
        out["pooled_mean"] = run_scalar(pooled_mean_cusum(tau, seed), tau)
    else:
        from river import drift

        if which == "river":
            out["adwin"] = run_scalar(drift.ADWIN(delta=0.002), tau)
            out["page_hinkley"] = run_scalar(drift.PageHinkley(threshold=50, delta=0.005), tau)
        else:
            out["kswin"] = run_scalar(drift.KSWIN(alpha=0.005, window_size=100, stat_size=30, seed=seed), tau)
    return spec.name, seed, out, time.perf_counter() - t


def null_stream(steps: int) -> StreamSpec:
    return StreamSpec("null_long", "none", n=steps, change_at=steps)


def score_null(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """False alarms of one detector over the long no-change streams."""
    steps = sum(r["steps"] for r in runs)
    alarms = sum(len(r["alarms"]) for r in runs)
    return {"steps": steps, "alarms": alarms, "per_million": round(alarms / steps * 1e6, 3),
            "steps_per_alarm": round(steps / alarms) if alarms else None}


# ------------------------------------------------------------------ main
def run_drift_bench(out_dir: str | os.PathLike = "bench/results", seeds: Sequence[int] = SEEDS,
                    streams: Sequence[StreamSpec] = STREAMS, workers: int | None = None, console: Any = None,
                    groups: Sequence[str] = ("kswin", "ours", "river"), null_seeds: Sequence[int] = NULL_SEEDS,
                    null_steps: int = NULL_STEPS) -> int:
    """Run every detector on every stream and seed; write ``drift.json`` and ``drift.png``.

    ``groups`` picks detector groups: ``"ours"`` (the monitor, its detectors,
    the pooled-mean CUSUM), ``"river"`` (ADWIN, PageHinkley) and ``"kswin"``
    (river's KSWIN, by far the slowest: ~0.5 ms per update). Every group but
    KSWIN also runs on ``null_seeds`` no-change streams of ``null_steps``
    request-steps, where false alarms are counted (``null_false_alarms``).
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:  # piped: do not squeeze the table into 80 columns
            console = Console(width=120)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    order = [g for g in ("kswin", "ours", "river") if g in groups]  # slowest first
    tasks = [(spec, seed, g) for g in order for spec in streams
             for seed in (seeds[:KSWIN_SEEDS] if g == "kswin" else seeds)]
    null = null_stream(null_steps)
    tasks = [(null, seed, g, False) for g in order if g != "kswin" for seed in null_seeds] + tasks
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {s.name: {d: [] for d in DETECTORS} for s in streams}
    null_runs: dict[str, list[dict[str, Any]]] = {d: [] for d in NULL_DETECTORS}
    cpu_s = 0.0
    workers = workers or min(2, os.cpu_count() or 1)

    def collect(name: str, seed: int, res: dict[str, dict[str, Any]], secs: float) -> float:
        for det, r in res.items():
            if name == null.name:
                if det in null_runs:
                    null_runs[det].append({"seed": seed, "steps": null.n, "alarms": r["alarms"]})
            else:
                runs[name][det].append({"seed": seed, **r})
        return secs
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        bar = progress.add_task("drift bench: streams × seeds × detectors", total=len(tasks))
        if workers > 1:
            with ProcessPoolExecutor(max_workers=workers) as pool:
                futures = [pool.submit(run_task, *task) for task in tasks]
                for fut in as_completed(futures):
                    cpu_s += collect(*fut.result())
                    progress.advance(bar)
        else:
            for task in tasks:
                cpu_s += collect(*run_task(*task))
                progress.advance(bar)
    by_name = {s.name: s for s in streams}
    results: dict[str, Any] = {
        "config": {
            "seeds": list(seeds), "kswin_seeds": list(seeds[:KSWIN_SEEDS]), "delta_max": DELTA_MAX,
            "ert_nominal": ERT, "ert_strict_nominal": ERT_STRICT, "trained_context_len": TRAINED_CONTEXT,
            "null_long": {"seeds": list(null_seeds), "steps": null_steps},
            "streams": {s.name: asdict(s) for s in streams},
            "unit": "request-step (one request's part of one engine step)",
            "river": {"adwin": {"delta": 0.002}, "page_hinkley": {"threshold": 50, "delta": 0.005},
                      "kswin": {"alpha": 0.005, "window_size": 100, "stat_size": 30}},
        },
        "streams": {},
    }
    for name, dets in runs.items():
        results["streams"][name] = {d: score_runs(sorted(r, key=lambda x: x["seed"]), by_name[name])
                                    for d, r in dets.items() if r}
    results["null_false_alarms"] = {d: score_null(r) for d, r in null_runs.items() if r}
    results["goals"] = evaluate_goals(results["streams"], results["null_false_alarms"])
    results["elapsed_s"] = round(time.perf_counter() - started, 1)
    results["cpu_s"] = round(cpu_s, 1)
    (out / "drift.json").write_text(json.dumps(results, indent=2))
    plot(results, streams, out / "drift.png")

    table = Table(title=f"drift bench ({len(seeds)} seeds, delta_max {DELTA_MAX}, nominal ERT {ERT:,.0f})")
    for col in ("stream", "detector", "delay med", "missed", "FA/100k", "MTFA", "retrain"):
        table.add_column(col, no_wrap=True, justify="left" if col in ("stream", "detector") else "right")
    for name, dets in results["streams"].items():
        for det, m in dets.items():
            table.add_row(name, det, _fmt(m["delay_median"]), _fmt(m["missed_rate"]),
                          _fmt(m["false_alarms_per_100k"]), _fmt(m["mtfa"]), _fmt(m["retrain_alerts"]))
    console.print(table)
    nulls = results["null_false_alarms"]
    if nulls:
        console.print(f"false alarms on {len(null_seeds)} no-change streams of {null_steps:,} request-steps: "
                      + ", ".join(f"{d} {m['alarms']} ({m['per_million']:g}/M)" for d, m in nulls.items()))
    for goal, ok in results["goals"].items():
        console.print(f"{'[green]met' if ok else '[red]not met'}[/]  {goal}")
    console.print(f"wrote {out / 'drift.json'} and {out / 'drift.png'} in {results['elapsed_s']} s")
    return 0


def evaluate_goals(streams: dict[str, Any], nulls: dict[str, Any] | None = None) -> dict[str, bool]:
    """The issue's goals, checked on the scores (absent streams or detectors are skipped)."""
    goals: dict[str, bool] = {}
    nulls = nulls or {}
    if "specctl_monitor" in nulls and "adwin" in nulls:
        goals["null_long: false alarms <= ADWIN's (measured)"] = (
            nulls["specctl_monitor"]["per_million"] <= nulls["adwin"]["per_million"])
    ab = streams.get("abrupt_drop", {})
    if "specctl_monitor" in ab and "adwin" in ab:
        m, a = ab["specctl_monitor"], ab["adwin"]
        fa_m = sum(s["specctl_monitor"]["false_alarms_per_100k"] for s in streams.values() if "specctl_monitor" in s)
        fa_a = sum(s["adwin"]["false_alarms_per_100k"] for s in streams.values() if "adwin" in s)
        goals["abrupt_drop: median delay <= ADWIN's"] = (
            m["delay_median"] is not None and a["delay_median"] is not None and m["delay_median"] <= a["delay_median"])
        goals["abrupt_drop: false alarms <= ADWIN's"] = m["false_alarms_per_100k"] <= a["false_alarms_per_100k"]
        goals["all streams: false alarms <= ADWIN's (summed per 100k)"] = fa_m <= fa_a
    for name in ("context_mix", "batch_shift"):
        s = streams.get(name, {})
        if "specctl_monitor" in s:
            goals[f"{name}: zero retrain alerts"] = s["specctl_monitor"]["retrain_alerts"] == 0
        if "pooled_mean" in s:
            goals[f"{name}: pooled-mean detector fires"] = s["pooled_mean"]["alarms"] > 0
    v = streams.get("variance_same_mean", {})
    if "specctl_monitor" in v and "adwin" in v:
        goals["variance_same_mean: caught (missed rate 0)"] = v["specctl_monitor"]["missed_rate"] == 0
        goals["variance_same_mean: ADWIN misses it"] = (v["adwin"]["missed_rate"] or 0) > 0
    return goals


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"
    return str(x)


def plot(results: dict[str, Any], streams: Sequence[StreamSpec], path: Path) -> None:
    """Per stream (seed 0): rolling mean τ, the change point and each detector's alarms; then the scores."""
    from matplotlib.figure import Figure

    dets = list(DETECTORS)
    colors = dict(zip(dets, ("tab:red", "darkred", "tab:orange", "tab:pink", "tab:purple", "tab:blue", "tab:green",
                             "tab:gray")))
    fig = Figure(figsize=(13, 2.4 * len(streams) + 4.0))
    grid = fig.add_gridspec(len(streams) + 1, 2, height_ratios=[1.0] * len(streams) + [1.5])
    for row, spec in enumerate(streams):
        ax = fig.add_subplot(grid[row, :])
        tau = make_stream(spec, SEEDS[0])["tau"].astype(float)
        k = 400
        roll = np.convolve(tau, np.ones(k) / k, mode="valid")
        ax.plot(np.arange(k - 1, spec.n), roll, color="black", lw=1)
        ax.axvline(spec.change_at, color="black", ls="--", lw=1)
        if spec.kind == "gradual":
            ax.axvspan(spec.change_at, spec.change_at + spec.ramp, color="0.9")
        lo, hi = float(roll.min()), float(roll.max())
        span = hi - lo
        for j, det in enumerate(dets):
            alarms = _alarms_of(results, spec.name, det)
            y = lo - span * (0.15 + 0.12 * j)
            ax.scatter(alarms, np.full(len(alarms), y), marker="|", s=50, color=colors[det])
        ax.set_ylim(lo - span * (0.25 + 0.12 * len(dets)), hi + span * 0.1)
        ax.set_xlim(0, spec.n)
        kind = ("drift: alarms after it are detections" if spec.drifts()
                else "no retrain-worthy drift: every alarm is false")
        ax.set_title(f"{spec.name} (seed {SEEDS[0]}), change at {spec.change_at} — {kind}", fontsize=9)
        ax.set_ylabel("τ (rolling 400)", fontsize=8)
    handles = [fig.axes[0].scatter([], [], marker="|", s=80, color=colors[d], label=d) for d in dets]
    fig.legend(handles=handles, loc="upper center", ncol=len(dets), fontsize=8, frameon=False)
    names = [s.name for s in streams]
    width = 0.8 / len(dets)
    ax = fig.add_subplot(grid[-1, 0])
    drift_names = [s.name for s in streams if s.drifts()]
    for j, det in enumerate(dets):
        vals = [results["streams"][n].get(det, {}).get("delay_median") for n in drift_names]
        missed = [results["streams"][n].get(det, {}).get("missed_rate") or 0 for n in drift_names]
        x = np.arange(len(drift_names)) + j * width
        ax.bar(x, [v if v is not None else np.nan for v in vals], width, color=colors[det])
        for xi, v, m in zip(x, vals, missed):
            if v is None:
                ax.text(xi, 0.03, "missed", rotation=90, fontsize=6, ha="center", va="bottom", color=colors[det],
                        transform=ax.get_xaxis_transform())
            elif m > 0:
                ax.text(xi, v * 1.05, f"{m:.0%} missed", rotation=90, fontsize=6, ha="center", va="bottom")
    ax.set_xticks(np.arange(len(drift_names)) + 0.4, drift_names, fontsize=8)
    ax.set_ylabel("median detection delay (request-steps)", fontsize=8)
    ax.set_yscale("log")
    ax = fig.add_subplot(grid[-1, 1])
    for j, det in enumerate(dets):
        vals = [results["streams"][n].get(det, {}).get("false_alarms_per_100k", 0) or 0 for n in names]
        ax.bar(np.arange(len(names)) + j * width, np.maximum(vals, 0.05), width, color=colors[det])
    ax.axhline(1e5 / ERT, color="tab:red", ls=":", lw=1)
    ax.set_yscale("log")
    ax.set_xticks(np.arange(len(names)) + 0.4, [n.replace("_", "\n", 1) for n in names], fontsize=7)
    ax.set_ylabel("false alarms per 100k (0 drawn at 0.05)", fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.975))
    fig.savefig(path, dpi=90)


def _alarms_of(results: dict[str, Any], stream: str, det: str) -> list[int]:
    times = results["streams"].get(stream, {}).get(det, {}).get("alarm_times") or [[]]
    return times[0]
