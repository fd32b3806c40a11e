"""``specctl bench policies``: every policy preset against a hindsight-best
static configuration and a per-step oracle, on the scenario suite.

For each scenario (``worker/sim/scenarios/*.yaml`` except the demo, or the files
given) the simulated fleet (:mod:`worker.sim`) runs once per

- **preset** in ``policies/presets/``: driven through the real controller —
  a :class:`controller.core.Controller` with the server's configuration and
  a simulated clock. The worker's telemetry goes through
  :func:`worker.sdk.agent.step_to_proto` and, batched as the agent batches it
  (one ``StepReports`` per 100 ms flush), into ``Controller.ingest``,
  finished requests into ``Controller.finished``; ``plan_updates`` is asked
  for plans, which reach the worker ``delay_steps`` of its own steps later
  (the network), are compiled with :func:`worker.sdk.agent.compile_plan` exactly
  as the agent does, and are ACKed. Until its first plan a worker runs the
  fallback (speculation off, the agent's default).
- ``best_static``: the grid depth ∈ {0..max_depth} × width ∈ {1, 2, 4}
  (node budget depth × width), each a fixed decision for every request and
  step; the best by goodput in hindsight, and the config it chose. The grid
  is searched in two phases to fit the time budget: every point on the
  scenario with its clock scaled by :data:`SCOUT_TIME_SCALE` (same rates, so
  the same regimes), then the best two by goodput — and the best by
  per-request speed — at full length; the hindsight best of those wins. A
  fixed decision needs no feedback, so the grid runs without the controller
  (and without the few fallback steps a controller-driven static preset has).
- ``oracle``: :class:`bench.oracle.OracleDecider` — the true acceptance and
  step cost, the goodput-optimal allocation every step (the ceiling).

Every run of a scenario sees the same clients: open-loop arrivals come from
a seed stream no decision touches, closed-loop users draw their requests
from their own streams. Time is simulated (the controller's
clock is the simulator's), so a seed gives the same numbers on any machine
and at any ``--jobs``.

Metrics per run (``DIR/policies.json``):

- ``goodput_tok_s``: tokens emitted per second of GPU step time, fleet-wide
  (Σ tokens / Σ busy seconds);
- ``tpot_ms_mean`` / ``tpot_ms_p99``: per finished request, milliseconds in
  the batch per output token;
- ``mean_accepted``: mean τ (accepted draft tokens, bonus excluded) per
  request-step that speculated — the engines' "acceptance length − 1";
- ``spec_fraction``: share of request-steps that speculated;
- ``vs_oracle`` / ``vs_best_static``: goodput ratios;
- ``request_tok_s``: Σ tokens / Σ (batch size × step time), a request's
  decode speed in the batch (≈ 1000 / TPOT), with ``request_vs_oracle`` /
  ``request_vs_best_static``.

Request classes (issue #29). A scenario with ``classes:`` (see
:mod:`worker.sim.scenario`) runs every preset with those classes laid over
its file, and adds per policy ``per_class: {NAME: {tpot_ms_p99,
tpot_ms_p50, tpot_target_ms, target_met, target_met_share, bins_met_share,
goodput_tok_s, ...}}`` (:func:`class_metrics`; a request's TPOT is its time
in the batch over the tokens it emitted, i.e. its decode steps' draft +
verify time over its tokens), ``weighted_goodput_tok_s`` and
``weighted_vs_oracle``. Its ``oracle`` is then
:class:`bench.oracle.ClassOracleDecider` (weighted goodput subject to the
targets, per step), and ``goodput-one-class`` runs the goodput preset without
the classes on the same fleet and requests (today's single-class policy),
so ``class_goals`` can state the issue's goals: each targeted class's TPOT
against its target (and the oracle's), weighted goodput against the class
oracle's, the interactive TPOT p99 ratio and the total goodput lost against
the one-class run. ``policies-classes-<scenario>.png`` plots each class's
TPOT over time beside the draft nodes and depth its requests were given.

Preset settings per scenario. A scenario's ``preset_config`` (see
:mod:`worker.sim.scenario`) lays fields over a preset file's for that
scenario's runs only — e.g. threshold-cliff runs ``vllm-batch-table`` with
the table the reporter of vLLM issue 49548 used; ``policies.json`` records
it per scenario. It is validated with the scenario, as the preset file is.

Clients. The shipped scenarios drive the fleet with closed-loop users, as
vLLM's serving benchmark does with ``--max-concurrency``: each user sends
its next request when its last reply is complete (after a think time, in
the threshold-cliff scenario), so a policy that decodes faster serves more
requests in the same time and goodput measures its decisions. With
open-loop arrivals (still available: ``poisson`` / ``bursty``) a GPU that
keeps up emits exactly the arrival rate of tokens whatever it decides, and
tokens per busy second tell policies apart only once it saturates: every
ratio sits near 1.0. The user counts give each phase the batch sizes of the
regime the scenario is about. Closed loop, the same users send the same
requests under every policy (each user has its own seed stream); a faster
policy gets further down each user's list.

Hardware truth. By default every worker is priced by the roofline of
:mod:`worker.sim.hardware`. ``--hardware H200-measured`` puts every
single-GPU H200 worker running llama-3-8b on the measured H200 table
(:mod:`worker.sim.measured`) instead — the same policies, static grid and
oracle, now against a real GPU's step costs — and runs only the scenarios
that have such a worker (a scenario named explicitly without one is
refused). ``policies.json`` records the truth in ``meta.hardware`` and per
scenario which worker ran on what (``hardware``).

``--quick`` compresses every scenario's clock (durations, change times,
burst dwell times) by :data:`QUICK_TIME_SCALE` at unchanged arrival rates,
so the load regimes stay and only their length shrinks, keeps one replica
per worker kind, and runs a coarse static grid in one phase: a smoke test for CI, its ratios are not results
(the controller barely warms up in a few simulated seconds).
"""

from __future__ import annotations

import heapq
import json
import math
import os
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from controller.config import ServerConfig, load_config
from controller.core import Controller
from policies.classes import ClassSet
from policies.presets import list_presets, load_preset
from policies.table import Decision, DecisionTable
from protos.speculation.v1 import plan_pb2, worker_pb2
from worker.sdk.agent import (AgentOptions, AgentStats, CompiledPlan, LocalDecisions, compile_classes, compile_plan,
                              step_to_proto)
from worker.sim.hello import hello_proto
from worker.sim.measured import MEASURED_HARDWARE
from worker.sim.scenario import Scenario, ScenarioError, load_scenario, scenario_from_dict, shipped_scenarios
from worker.sim.worker import SimWorker, StepResult

DEFAULT_DELAY_STEPS = 2
GRID_WIDTHS = (1, 2, 4)
QUICK_TIME_SCALE = 0.04
QUICK_GRID_DEPTHS = (0, 2, 4, 8)
QUICK_GRID_WIDTHS = (1, 4)
SCOUT_TIME_SCALE = 0.1
SERIES_BINS = 60
EXCLUDED_BY_DEFAULT = ("demo",)  # the demo's fleet, not a benchmark scenario
REFERENCES = ("best_static", "oracle")

# Goal tags by scenario name (issue 3): which scenarios the ratio goals name.
GOAL_TAGS = {
    "context-shift": "shift",
    "content-drift": "drift",
    "bursty": "bursty",
    "mixed-fleet": "mixed",
    "threshold-cliff": "cliff",
}
BEAT_STATIC_TAGS = ("shift", "drift", "bursty", "mixed")
CLIFF_RIVALS = ("vllm-batch-table", "trtllm-concurrency")
PRODUCT = "goodput"
ONE_CLASS_SUFFIX = "-one-class"  # the product without the scenario's request classes


# ----------------------------------------------------------------- scenarios
def suite_paths(paths: Sequence[str | Path] | None = None) -> list[Path]:
    """The scenario files to run: the given ones, else every shipped one but the demo."""
    if paths:
        out = []
        for p in paths:
            path = Path(p)
            if not path.exists() and not path.suffix:
                path = Path(load_scenario_path(str(p)))
            out.append(path)
        return out
    return [p for p in shipped_scenarios() if p.stem not in EXCLUDED_BY_DEFAULT]


def load_scenario_path(name: str) -> Path:
    from worker.sim.scenario import SCENARIO_DIR

    return SCENARIO_DIR / f"{name}.yaml"


def compress_time(data: dict, scale: float) -> dict:
    """The scenario with its clock scaled by ``scale``: duration, change times and
    ramps, bursty dwell times. Arrival rates and lengths are unchanged, so the
    batch sizes (the regimes) stay and only the phases get shorter."""
    data = json.loads(json.dumps(data))
    data["duration_s"] = data["duration_s"] * scale
    for change in data.get("changes") or []:
        change["at_s"] = change["at_s"] * scale
        change["over_s"] = change.get("over_s", 0.0) * scale

    def dwell(traffic: dict | None) -> None:
        arrivals = (traffic or {}).get("arrivals") or {}
        if arrivals.get("mean_on_s") is not None:  # bursty rates or bursty users
            arrivals["mean_on_s"] *= scale
            arrivals["mean_off_s"] *= scale

    dwell(data.get("traffic"))
    for worker in data.get("workers") or []:
        dwell(worker.get("traffic"))
    return data


def scenario_data(path: Path, quick: bool) -> dict:
    """A scenario file as a dict; ``quick``: its clock compressed and one replica per worker kind."""
    scenario = load_scenario(path)
    data = scenario.model_dump(mode="json", exclude_none=True)
    if not quick:
        return data
    for worker in data["workers"]:
        worker["count"] = 1
    return compress_time(data, QUICK_TIME_SCALE)


ROOFLINE = "roofline"


def hardware_choices() -> list[str]:
    """Values of ``--hardware``: the roofline (default) or a measured table's name."""
    return [ROOFLINE, *sorted(MEASURED_HARDWARE)]


def with_hardware(data: dict, hardware: str) -> tuple[dict, list[str]]:
    """The scenario with every worker a measured table can price moved onto it, and
    the ids of those workers.

    A worker moves when it runs on the table's GPU (the registry name, not an
    inline profile) on one GPU with the table's model; the others keep the
    roofline.
    """
    entry = MEASURED_HARDWARE[hardware]
    data = json.loads(json.dumps(data))
    moved = []
    for worker in data["workers"]:
        if (worker.get("hardware", "H100-SXM") == entry.profile and worker.get("gpus") in (None, 1)
                and worker.get("model", "llama-3-8b") == entry.model):
            worker["hardware"] = entry.name
            moved.append(worker["id"])
    return data, moved


def hardware_truth(data: dict) -> dict[str, str]:
    """Per worker replica: the cost truth it runs on (a registry name, ``name xN`` for
    tensor-parallel GPUs, ``name (inline)`` for an inline profile)."""
    out = {}
    for w in data["workers"]:
        hw = w.get("hardware", "H100-SXM")
        name = hw if isinstance(hw, str) else f"{hw['name']} (inline)"
        if (w.get("gpus") or 1) > 1:
            name += f" x{w['gpus']}"
        for wid in [w["id"]] if w.get("count", 1) == 1 else [f"{w['id']}-{i}" for i in range(w["count"])]:
            out[wid] = name
    return out


# -------------------------------------------------------------- the fleet loop
def drive(
    workers: Sequence[SimWorker],
    deciders: Sequence[Callable[[str, int, int], Decision]],
    until_s: float,
    before: Callable[[int, float], None] | None = None,
    after: Callable[[int, StepResult], None] | None = None,
) -> None:
    """Step the fleet in one simulated clock, always the worker furthest behind
    (as :func:`worker.sim.runner.run_fleet_simulated`), with hooks around steps."""
    clock = [(0.0, i) for i in range(len(workers))]
    heapq.heapify(clock)
    while clock:
        now, i = heapq.heappop(clock)
        if now >= until_s:
            continue
        if before is not None:
            before(i, now)
        result = workers[i].step(now, deciders[i])
        if result.idle:
            nxt = min(result.end, until_s) if math.isfinite(result.end) else until_s
        else:
            nxt = result.end
            if after is not None:
                after(i, result)
        heapq.heappush(clock, (nxt, i))


class Series:
    """Per time bin, fleet-wide: tokens, busy time, request-steps, depth used, τ.

    With request classes (``classes``), per class and bin as well: its
    tokens, its request-steps' step time (so ms per token in the batch), the
    depth and draft nodes its requests were given (the plan as it reached
    them), and the TPOT of its requests that finished in the bin.
    """

    FIELDS = ("tokens", "busy_s", "request_steps", "depth_sum", "spec_steps", "accepted", "batch_sum", "steps",
              "request_s", "finished_accepted", "finished_steps")
    CLASS_FIELDS = ("tokens", "request_s", "request_steps", "depth_sum", "nodes_sum")

    def __init__(self, duration_s: float, bins: int = SERIES_BINS, classes: ClassSet | None = None) -> None:
        self.bin_s = duration_s / bins
        self.data = np.zeros((len(self.FIELDS), bins))
        self.bins = bins
        self.classes = classes
        if classes is not None:
            self.class_data = np.zeros((len(self.CLASS_FIELDS), len(classes), bins))
            self.class_tpot: list[list[list[float]]] = [[[] for _ in range(bins)] for _ in classes]

    def add(self, result: StepResult) -> None:
        t = result.telemetry
        b = min(int(result.now / self.bin_s), self.bins - 1)
        depths = [r.depth for r in t.requests]
        col = self.data[:, b]
        col[0] += result.tokens
        col[1] += result.duration_s
        col[2] += len(depths)
        col[3] += sum(depths)
        col[4] += sum(1 for d in depths if d)
        col[5] += sum(r.accepted for r in t.requests)
        col[6] += t.batch_size
        col[7] += 1
        col[8] += t.batch_size * result.duration_s
        for f in result.finished:  # what an acceptance gate averages: accepted per step of finished requests
            col[9] += f.accepted_tokens
            col[10] += f.steps
        if self.classes is not None and result.request_classes:
            cs, cd = self.classes, self.class_data
            for r, name, emitted in zip(t.requests, result.request_classes, result.request_tokens):
                k = cs.index(name)
                cd[0, k, b] += emitted
                cd[1, k, b] += result.duration_s
                cd[2, k, b] += 1
                cd[3, k, b] += r.depth
                cd[4, k, b] += r.nodes
            for rec in result.records:
                self.class_tpot[cs.index(rec.request_class)][b].append(rec.tpot_ms)

    def request_tok_s(self) -> float:
        """Σ tokens / Σ (batch size × step time): each request's decode speed, token-weighted."""
        total = self.data[8].sum()
        return float(self.data[0].sum() / total) if total > 0 else 0.0

    def export(self) -> dict[str, list[float]]:
        d = dict(zip(self.FIELDS, self.data))
        with np.errstate(invalid="ignore", divide="ignore"):
            out = {
                "t_s": ((np.arange(self.bins) + 0.5) * self.bin_s).tolist(),
                "goodput_tok_s": np.where(d["busy_s"] > 0, d["tokens"] / d["busy_s"], np.nan).tolist(),
                "request_tok_s": np.where(d["request_s"] > 0, d["tokens"] / d["request_s"], np.nan).tolist(),
                "mean_depth": np.where(d["request_steps"] > 0, d["depth_sum"] / d["request_steps"], np.nan).tolist(),
                "spec_fraction": np.where(d["request_steps"] > 0, d["spec_steps"] / d["request_steps"], np.nan).tolist(),
                "mean_accepted": np.where(d["spec_steps"] > 0, d["accepted"] / d["spec_steps"], np.nan).tolist(),
                "mean_batch": np.where(d["steps"] > 0, d["batch_sum"] / d["steps"], np.nan).tolist(),
                "finished_accepted_per_step": np.where(d["finished_steps"] > 0,
                                                       d["finished_accepted"] / d["finished_steps"], np.nan).tolist(),
            }
        clean = {k: _clean(v) for k, v in out.items()}
        if self.classes is not None:
            clean["classes"] = self.export_classes()
        return clean

    def export_classes(self) -> dict[str, dict[str, list]]:
        """Per class: ``tpot_ms`` (ms per token in the batch, the bin's request-steps), ``tpot_ms_p50`` /
        ``tpot_ms_p99`` (over the requests that finished in the bin), ``mean_depth`` / ``mean_nodes``
        (what its requests were given), ``goodput_tok_s`` (its tokens per busy second)."""
        busy = self.data[self.FIELDS.index("busy_s")]
        out = {}
        for k, c in enumerate(self.classes):
            tok, req_s, steps, depth, nodes = self.class_data[:, k]
            done = self.class_tpot[k]
            with np.errstate(invalid="ignore", divide="ignore"):
                out[c.name] = {
                    "tpot_ms": _clean(np.where(tok > 0, 1e3 * req_s / tok, np.nan)),
                    "tpot_ms_p50": _clean([np.quantile(v, 0.5) if v else np.nan for v in done]),
                    "tpot_ms_p99": _clean([np.quantile(v, 0.99) if v else np.nan for v in done]),
                    "finished": [len(v) for v in done],
                    "mean_depth": _clean(np.where(steps > 0, depth / steps, np.nan)),
                    "mean_nodes": _clean(np.where(steps > 0, nodes / steps, np.nan)),
                    "goodput_tok_s": _clean(np.where(busy > 0, tok / busy, np.nan)),
                }
        return out

    def bins_met_share(self) -> dict[str, float | None]:
        """Per class with a TPOT target: the share of bins, among those where some of its requests
        finished, whose finished requests' TPOT quantile (the target's) met the target."""
        out: dict[str, float | None] = {}
        for k, c in enumerate(self.classes):
            if not c.has_target:
                continue
            q = 0.5 if c.tpot_quantile == "p50" else 0.99
            met = [float(np.quantile(v, q)) <= c.tpot_target_ms for v in self.class_tpot[k] if v]
            out[c.name] = round(sum(met) / len(met), 4) if met else None
        return out


def _clean(values) -> list:
    """Floats rounded for JSON, NaN as None."""
    return [None if (isinstance(x, float) and math.isnan(x)) else round(float(x), 4) for x in np.asarray(values, float)]


def class_metrics(workers: Sequence[SimWorker], classes: ClassSet) -> dict[str, Any]:
    """Per request class, fleet-wide, and the weighted goodput.

    ``per_class[NAME]``: ``tpot_ms_p50`` / ``tpot_ms_p99`` / ``tpot_ms_mean``
    over its finished requests (each request's time in the batch over the
    tokens it emitted, :attr:`worker.sim.worker.RequestRecord.tpot_ms`),
    ``tpot_target_ms`` and ``tpot_quantile`` (the policy file's), ``target_met``
    (that quantile at or under the target) and ``target_met_share`` (the share
    of its finished requests at or under it), ``goodput_tok_s`` (its tokens per
    second of fleet step time: the classes' sum is ``goodput_tok_s``), its
    ``weight``, ``tokens`` and ``finished``. A request without a class, or with
    one the classes do not list, counts in the default class.
    ``weighted_goodput_tok_s``: ``Σ_c weight_c · tokens_c`` per busy second.
    """
    busy = sum(w.stats.busy_s for w in workers)
    tokens = dict.fromkeys(classes.names, 0)
    tpots: dict[str, list[float]] = {n: [] for n in classes.names}
    for w in workers:
        for name, n in w.stats.class_tokens.items():
            tokens[classes.get(name).name] += n
        # A worker whose traffic has no class_mix counts no class tokens: all its tokens are the default class's.
        tokens[classes.default] += w.stats.tokens - sum(w.stats.class_tokens.values())
        for r in w.stats.finished:
            tpots[classes.get(r.request_class).name].append(r.tpot_ms)
    per_class: dict[str, dict] = {}
    for c in classes:
        v = np.array(tpots[c.name])
        quantile = {"p50": 0.5, "p99": 0.99}[c.tpot_quantile]
        entry: dict[str, Any] = {
            "weight": c.weight,
            "tpot_target_ms": c.tpot_target_ms,
            "tpot_quantile": c.tpot_quantile if c.has_target else None,
            "tpot_ms_p50": round(float(np.quantile(v, 0.5)), 4) if v.size else None,
            "tpot_ms_p99": round(float(np.quantile(v, 0.99)), 4) if v.size else None,
            "tpot_ms_mean": round(float(v.mean()), 4) if v.size else None,
            "target_met": None,
            "target_met_share": None,
            "goodput_tok_s": round(tokens[c.name] / busy, 3) if busy else 0.0,
            "tokens": tokens[c.name],
            "finished": int(v.size),
        }
        if c.has_target and v.size:
            entry["target_met"] = bool(np.quantile(v, quantile) <= c.tpot_target_ms)
            entry["target_met_share"] = round(float((v <= c.tpot_target_ms).mean()), 4)
        per_class[c.name] = entry
    weighted = sum(c.weight * tokens[c.name] for c in classes)
    return {"weighted_goodput_tok_s": round(weighted / busy, 3) if busy else 0.0, "per_class": per_class}


def fleet_metrics(workers: Sequence[SimWorker]) -> dict[str, Any]:
    tokens = sum(w.stats.tokens for w in workers)
    busy = sum(w.stats.busy_s for w in workers)
    request_steps = sum(w.stats.request_steps for w in workers)
    spec = sum(w.stats.spec_request_steps for w in workers)
    accepted = sum(w.stats.accepted_tokens for w in workers)
    tpot = np.array([r.tpot_ms for w in workers for r in w.stats.finished])
    per_worker = {
        w.worker_id: {
            "goodput_tok_s": round(w.stats.goodput, 2),
            "spec_fraction": round(w.stats.speculation_fraction, 4),
            "mean_accepted": round(w.stats.mean_accepted_speculating, 4),
            "mean_batch": round(w.stats.request_steps / w.stats.steps, 2) if w.stats.steps else 0.0,
            "mean_nodes": round(w.stats.draft_nodes / w.stats.request_steps, 3) if w.stats.request_steps else 0.0,
        }
        for w in workers
    }
    return {
        "goodput_tok_s": round(tokens / busy, 3) if busy else 0.0,
        "tpot_ms_mean": round(float(tpot.mean()), 4) if tpot.size else None,
        "tpot_ms_p99": round(float(np.quantile(tpot, 0.99)), 4) if tpot.size else None,
        "mean_accepted": round(accepted / spec, 4) if spec else 0.0,
        "spec_fraction": round(spec / request_steps, 4) if request_steps else 0.0,
        "tokens": tokens,
        "busy_s": round(busy, 4),
        "request_steps": request_steps,
        "finished": sum(len(w.stats.finished) for w in workers),
        "workers": per_worker,
    }


# ------------------------------------------------------- the controller path
class WorkerLink:
    """The worker side of one connection, as :class:`worker.sdk.agent.SpeculationAgent`
    runs it: telemetry batched into one ``StepReports`` per flush interval (at
    most ``max_steps_per_message`` steps) with the finished requests after it;
    plans applied as compiled tables, per-request overrides, ACK or NACK — every
    message delivered ``delay_steps`` of this worker's steps after the
    controller produced it.

    Request classes: each request-step's class goes out in
    ``RequestStep.request_class``; a plan's ``classes`` (``ClassPlan``) are
    compiled as the agent compiles them (:func:`worker.sdk.agent.compile_classes`)
    and :meth:`decide` looks a request up in its class's table, the
    ``default_class``'s for a request without a class or with a name the plan
    does not list (counted in :attr:`unknown_classes`, never refused). A plan
    without classes gives every request its one table.

    Decisions go through the agent's own :class:`worker.sdk.agent.LocalDecisions`
    (plan, overrides, and each request's state from the steps it ran when the
    plan has state tables, issue #28), the very code ``SpeculationAgent.decide``
    runs."""

    def __init__(self, worker: SimWorker, controller: Controller, delay_steps: int, fallback: Decision,
                 options: AgentOptions = AgentOptions(), calibration: Sequence = ()) -> None:
        self.hello = hello_proto(worker.hello)
        self.hello.calibration.extend(calibration)  # Hello.calibration: forwards timed at start-up
        self.controller = controller
        self.state = controller.hello(self.hello)
        self.delay_steps = delay_steps
        self.options = options
        self.table = DecisionTable.uniform(fallback, (1,), (0,))
        self.stats = AgentStats()  # unknown_class: decisions asked for a class the plan does not list
        self.local = LocalDecisions(CompiledPlan.single(self.table), self.stats)
        self.decide = self.local.decide  # SpeculationAgent.decide's lookup, the same code
        self.version = 0
        self.steps = 0
        self.pending: deque = deque()
        self.unsent: list[worker_pb2.StepReport] = []
        self.unsent_finished: list = []
        self.last_flush = -math.inf
        self.plans_applied = 0
        self.nacks = 0
        self.rejections = 0

    @property
    def plan(self) -> CompiledPlan:
        """The plan in force, as the agent holds it (with its class and state tables)."""
        return self.local.plan

    @property
    def unknown_classes(self) -> int:
        return self.stats.unknown_class

    def after_step(self, result: StepResult) -> None:
        self.steps += 1
        self.local.observe(result.telemetry)  # each request's last outcome, as SpeculationAgent.observe keeps it
        self.unsent.append(step_to_proto(result.telemetry))  # RequestStep.request_class from the telemetry
        self.unsent_finished.extend(result.finished)
        for s in result.finished:
            self.local.forget(s.request_id)
        if (result.end - self.last_flush >= self.options.flush_interval_s
                or len(self.unsent) >= self.options.max_steps_per_message):
            self.flush(result.end)
        while self.pending and self.pending[0][0] <= self.steps:
            self.deliver(self.pending.popleft()[1])

    def flush(self, now: float) -> None:
        """Send the batched telemetry and take whatever the controller answers."""
        ctl, state = self.controller, self.state
        self.rejections += len(ctl.ingest(state, worker_pb2.StepReports(steps=self.unsent)))
        for s in self.unsent_finished:
            msg = worker_pb2.RequestFinished(request_id=s.request_id, generated_tokens=s.generated_tokens,
                                             steps=s.steps, accepted_tokens=s.accepted_tokens, timestamp=s.timestamp)
            if ctl.finished(state, msg) is not None:
                self.rejections += 1
        self.unsent, self.unsent_finished = [], []
        self.last_flush = now
        for item in ctl.plan_updates(state):
            self.pending.append((self.steps + self.delay_steps, item))

    def deliver(self, item: plan_pb2.Plan | plan_pb2.RequestDecisions) -> None:
        """Apply one controller message as the agent does, and answer it."""
        ctl, state = self.controller, self.state
        try:
            if isinstance(item, plan_pb2.Plan):
                table = compile_plan(item, self.hello, self.version)
                self.local.install(compile_classes(item, self.hello, table))
                self.table = table
                self.version = item.version
                self.plans_applied += 1
            else:
                self.local.apply_decisions(item, self.hello.drafter)
        except ValueError as err:
            self.nacks += 1
            ctl.nack(state, worker_pb2.Nack(version=item.version, nonce=item.nonce, reason=str(err)))
            return
        ctl.ack(state, worker_pb2.Ack(version=item.version, nonce=item.nonce))


class ControlledFleet:
    """A fleet whose decisions come from a :class:`Controller` in simulated time."""

    def __init__(self, workers: Sequence[SimWorker], policy, config: ServerConfig, delay_steps: int,
                 fallback: Decision = Decision.off(), calibration: Sequence = ()) -> None:
        self.now = 0.0
        self.controller = Controller(config, policy, clock=lambda: self.now)
        self.links = [WorkerLink(w, self.controller, delay_steps, fallback, calibration=calibration)
                      for w in workers]

    def after(self, i: int, result: StepResult) -> None:
        # A step's report reaches the controller when the step ends.
        if result.end > self.now:
            self.now = result.end
        self.links[i].after_step(result)


# ------------------------------------------------------------------- one run
@dataclass(frozen=True)
class Job:
    """One run of one scenario.

    ``kind``: ``preset`` (arg: preset name), ``oracle`` (arg: the static grid
    it weighs too, or ``None`` for its default), ``static`` (arg:
    (depth, width), full length), ``scout`` (arg: (depth, width), on the
    scenario at :data:`SCOUT_TIME_SCALE` — the first phase of the grid) or
    ``one_class`` (arg: preset name; a scenario with request classes only: the
    preset without the scenario's ``classes``, today's single-class policy on
    the same fleet and the same classed requests).
    """

    scenario: str
    kind: str
    arg: Any
    data: dict = field(compare=False, repr=False)
    delay_steps: int = DEFAULT_DELAY_STEPS
    config: dict | None = field(default=None, compare=False, repr=False)
    seed: int | None = None  # a preset's `seed` for this run (--seeds); None: the preset's own

    @property
    def label(self) -> str:
        if self.kind in ("static", "scout"):
            return f"{self.kind} d={self.arg[0]} w={self.arg[1]}"
        if self.kind == "one_class":
            return f"{self.arg}{ONE_CLASS_SUFFIX}"
        if self.kind == "preset" and self.seed is not None:
            return f"{self.arg} seed={self.seed}"
        return str(self.arg) if self.kind == "preset" else self.kind

    def cost_estimate(self) -> float:
        d = self.data
        workers = sum(w.get("count", 1) for w in d["workers"])
        factor = {"preset": 2.0, "one_class": 2.0, "oracle": 8.0 if d.get("classes") else 3.0}.get(self.kind, 1.0)
        return d["duration_s"] * workers * factor


def static_decision(depth: int, width: int) -> Decision:
    return Decision(depth, width, depth * width) if depth else Decision.off()


def run_job(job: Job) -> dict[str, Any]:
    """Run one job; returns its metrics, time series and wall time."""
    started = time.perf_counter()
    scenario: Scenario = scenario_from_dict(job.data, job.scenario)
    workers = SimWorker.fleet(scenario)
    classes = scenario.class_set() if scenario.classes is not None else None  # per-class metrics when declared
    series = Series(scenario.duration_s, classes=classes)
    extra: dict[str, Any] = {}

    def record(i: int, result: StepResult) -> None:
        series.add(result)

    if job.kind in ("static", "scout"):
        decision = static_decision(*job.arg)
        drive(workers, [lambda rid, ctx, b, request_class="": decision] * len(workers), scenario.duration_s,
              after=record)
        extra["config"] = {"depth": decision.depth, "width": decision.width, "max_nodes": decision.max_nodes}
    elif job.kind == "oracle":
        from bench.oracle import ClassOracleDecider, OracleDecider

        if classes is None:
            oracles = [OracleDecider(w, job.arg) for w in workers]
        else:  # weighted goodput under the classes' TPOT targets (the single-class oracle without classes)
            oracles = [ClassOracleDecider(w, classes, job.arg) for w in workers]
        alpha = np.zeros((2, series.bins))

        def before(i: int, now: float) -> None:
            oracles[i].begin_step(now)

        def after(i: int, result: StepResult) -> None:
            series.add(result)
            b = min(int(result.now / series.bin_s), series.bins - 1)
            o = oracles[i]
            alpha[0, b] += o.alpha1_sum
            alpha[1, b] += o.alpha1_n
            o.alpha1_sum, o.alpha1_n = 0.0, 0

        drive(workers, oracles, scenario.duration_s, before=before, after=after)
        extra["true_alpha1"] = [None if not n else round(float(s / n), 4) for s, n in alpha.T]
        if classes is not None:
            steps = sum(o.steps for o in oracles)
            extra["oracle_feasible_share"] = round(sum(o.steps_feasible for o in oracles) / steps, 4) if steps else None
    elif job.kind in ("preset", "one_class"):
        config = ServerConfig.model_validate(job.config) if job.config else ServerConfig()
        if job.kind == "preset":  # the scenario's settings for this preset (and its classes), if any
            overrides = scenario.preset_fields(job.arg)
        else:  # the same preset settings without request classes
            overrides = {k: v for k, v in (scenario.preset_config.get(job.arg) or {}).items()
                         if k not in ("classes", "default_class")} or None
        if job.seed is not None:  # --seeds: this run's policy seed over the preset's (and the scenario's)
            overrides = {**(overrides or {}), "seed": job.seed}
        policy = load_preset(job.arg, overrides, f"{job.scenario}: preset_config.{job.arg}")
        fleet = ControlledFleet(workers, policy, config, job.delay_steps)

        def after(i: int, result: StepResult) -> None:
            series.add(result)
            fleet.after(i, result)

        drive(workers, [link.decide for link in fleet.links], scenario.duration_s, after=after)
        extra["controller"] = {
            "plans_applied": sum(link.plans_applied for link in fleet.links),
            "nacks": sum(link.nacks for link in fleet.links),
            "rejections": sum(link.rejections for link in fleet.links),
        }
        if classes is not None:
            extra["controller"]["class_tables"] = any(link.plan.tables for link in fleet.links)
            extra["controller"]["unknown_classes"] = sum(link.unknown_classes for link in fleet.links)
    else:
        raise ValueError(f"unknown job kind {job.kind!r}")
    out = fleet_metrics(workers)
    out["request_tok_s"] = round(series.request_tok_s(), 3)
    if classes is not None:
        out.update(class_metrics(workers, classes))
        for name, share in series.bins_met_share().items():
            out["per_class"][name]["bins_met_share"] = share
    out.update(extra)
    out["series"] = series.export() if job.kind != "scout" else None
    out["wall_s"] = round(time.perf_counter() - started, 3)
    return out


# -------------------------------------------------------------- the benchmark
@dataclass
class ScenarioPlan:
    """The runs of one scenario; the grid's second phase is decided from the first."""

    name: str
    data: dict
    presets: Sequence[str]
    grid: list[tuple[int, int]]
    delay_steps: int
    config: dict | None
    scout: bool  # two-phase grid (full suite) or every grid point at full length (quick)
    seeds: tuple[int, ...] = ()  # --seeds: each seeded preset runs once per seed (preset_seeds)
    finalists: int = 2
    scouts_left: int = 0
    finals: list[tuple[int, int]] = field(default_factory=list)
    scout_results: dict = field(default_factory=dict)

    @property
    def one_class(self) -> bool:
        """Whether the product also runs without the scenario's classes (a scenario with classes)."""
        return bool(self.data.get("classes")) and PRODUCT in self.presets

    def preset_seeds(self, preset: str) -> tuple[int | None, ...]:
        """The seeds ``preset`` runs with: every ``--seeds`` seed for a preset whose
        policy has a ``seed`` field (the goodput preset's Thompson probes), else one
        run with its own settings (the other presets draw nothing at random)."""
        return self.seeds if self.seeds and preset_has_seed(preset) else (None,)

    def first_jobs(self) -> list[Job]:
        jobs = [Job(self.name, "preset", p, self.data, self.delay_steps, self.config, seed=s)
                for p in self.presets for s in self.preset_seeds(p)]
        if self.one_class:
            jobs.append(Job(self.name, "one_class", PRODUCT, self.data, self.delay_steps, self.config))
        # The oracle weighs this scenario's static grid and the full one too, so it stays the
        # ceiling over best_static and over the static preset.
        statics = tuple(dict.fromkeys([*self.grid, *grid_points(self.data, None, GRID_WIDTHS)]))
        jobs.append(Job(self.name, "oracle", statics, self.data, self.delay_steps))
        if self.scout:
            scout_data = compress_time(self.data, SCOUT_TIME_SCALE)
            jobs += [Job(self.name, "scout", dw, scout_data) for dw in self.grid]
            self.scouts_left = len(self.grid)
        else:
            jobs += [Job(self.name, "static", dw, self.data) for dw in self.grid]
        return jobs

    def expected_runs(self) -> int:
        return (sum(len(self.preset_seeds(p)) for p in self.presets) + 1 + len(self.grid)
                + (self.finalists + 1 if self.scout else 0) + int(self.one_class))

    def on_done(self, job: Job, result: dict) -> list[Job]:
        """Second phase: once every scout is in, the best by goodput (and the best by
        per-request speed) run at full length."""
        if job.kind != "scout":
            return []
        self.scout_results[job.arg] = result
        self.scouts_left -= 1
        if self.scouts_left:
            return []
        by_goodput = sorted(self.scout_results, key=lambda a: -self.scout_results[a]["goodput_tok_s"])
        by_speed = max(self.scout_results, key=lambda a: self.scout_results[a]["request_tok_s"])
        self.finals = list(dict.fromkeys(by_goodput[: self.finalists] + [by_speed]))
        return [Job(self.name, "static", dw, self.data) for dw in self.finals]


def preset_has_seed(preset: str) -> bool:
    """Whether ``preset``'s policy takes a ``seed`` (so ``--seeds`` varies it)."""
    return "seed" in type(load_preset(preset).config).model_fields


# The metrics a preset's entry averages over its --seeds runs (the other fields are its first seed's run).
SEED_MEANS = ("goodput_tok_s", "request_tok_s", "tpot_ms_mean", "tpot_ms_p99", "mean_accepted", "spec_fraction",
              "tokens", "finished")


def merge_seeds(runs: Sequence[tuple[int, dict]]) -> dict:
    """One preset's entry from its runs at several policy seeds (``(seed, result)``,
    in ``--seeds`` order): the first seed's run with :data:`SEED_MEANS` replaced by
    their mean over the seeds, and ``seeds``: per seed its goodput and per-request
    speed (``vs_oracle`` is added per seed by :func:`summarise`).

    >>> entry = merge_seeds([(0, {"goodput_tok_s": 100.0, "request_tok_s": 10.0, "finished": 3}),
    ...                      (1, {"goodput_tok_s": 110.0, "request_tok_s": 12.0, "finished": 4})])
    >>> entry["goodput_tok_s"], entry["finished"], entry["seeds"]["1"]
    (105.0, 3.5, {'goodput_tok_s': 110.0, 'request_tok_s': 12.0})
    """
    first = runs[0][1]
    entry = {k: v for k, v in first.items() if k not in ("series", "true_alpha1")}
    for key in SEED_MEANS:
        values = [r[key] for _, r in runs if r.get(key) is not None]
        if key in first and len(values) == len(runs):
            entry[key] = round(float(np.mean(values)), 4)
    entry["seeds"] = {str(seed): {k: r[k] for k in ("goodput_tok_s", "request_tok_s") if k in r} for seed, r in runs}
    return entry


def grid_points(data: dict, depths: Sequence[int] | None, widths: Sequence[int]) -> list[tuple[int, int]]:
    """The static grid, cut to the fleet's largest drafter (wider or deeper points
    would only repeat the largest one the drafters can build)."""
    max_depth = max(w["drafter"].get("max_depth") or 8 for w in data["workers"])
    max_width = max(w["drafter"].get("max_width") or 8 for w in data["workers"])
    depths = range(max_depth + 1) if depths is None else [d for d in depths if d <= max_depth]
    widths = [w for w in widths if w <= max_width] or [1]
    return [(d, w) for d in depths for w in ([1] if d == 0 else widths)]


def summarise(plan: ScenarioPlan, results: dict[Job, dict]) -> tuple[dict, dict]:
    """(policies.json entry, series entry) of one scenario."""
    runs = {job: r for job, r in results.items() if job.scenario == plan.name}
    policies: dict[str, dict] = {}
    series: dict[str, dict] = {}
    statics = []
    seeded: dict[str, list[tuple[int, dict]]] = {}
    for job, r in runs.items():
        if job.kind == "scout":
            continue
        if job.kind == "static":
            statics.append((job, r))
            continue
        if job.kind == "preset" and job.seed is not None:
            seeded.setdefault(job.arg, []).append((job.seed, r))
            continue
        key = job.arg if job.kind == "preset" else job.label if job.kind == "one_class" else job.kind
        entry = {k: v for k, v in r.items() if k not in ("series", "true_alpha1")}
        policies[key] = entry
        series[key] = dict(r["series"])
        if r.get("true_alpha1") is not None:
            series[key]["true_alpha1"] = r["true_alpha1"]
    for name, seed_runs in seeded.items():  # --seeds: the mean over the seeds, each seed's run in "seeds"
        seed_runs.sort(key=lambda sr: plan.seeds.index(sr[0]))
        policies[name] = merge_seeds(seed_runs)
        series[name] = dict(seed_runs[0][1]["series"])
    grid = []
    for job, r in statics:
        grid.append({**r["config"], "goodput_tok_s": r["goodput_tok_s"], "request_tok_s": r["request_tok_s"],
                     "tpot_ms_mean": r["tpot_ms_mean"], "phase": "full"})
    for job, r in runs.items():
        if job.kind == "scout":
            grid.append({**r["config"], "goodput_tok_s": r["goodput_tok_s"], "request_tok_s": r["request_tok_s"],
                         "tpot_ms_mean": r["tpot_ms_mean"], "phase": f"scout x{SCOUT_TIME_SCALE}"})
    best_speed = None
    if statics:
        # Hindsight best by goodput; ties (equal to the reported precision) go to
        # the faster per-request decode, then to the smaller config.
        job, best = max(statics, key=lambda jr: (jr[1]["goodput_tok_s"], jr[1]["request_tok_s"],
                                                 -jr[0].arg[0], -jr[0].arg[1]))
        entry = {k: v for k, v in best.items() if k != "series"}
        _, fastest = max(statics, key=lambda jr: (jr[1]["request_tok_s"], -jr[0].arg[0], -jr[0].arg[1]))
        best_speed = fastest["request_tok_s"]
        entry["best_by_request_tok_s"] = {**fastest["config"], "request_tok_s": fastest["request_tok_s"],
                                          "goodput_tok_s": fastest["goodput_tok_s"]}
        policies["best_static"] = entry
        series["best_static"] = best["series"]
    oracle = policies.get("oracle", {})
    static = policies.get("best_static", {})
    for entry in policies.values():
        entry["vs_oracle"] = _ratio(entry["goodput_tok_s"], oracle.get("goodput_tok_s"))
        entry["vs_best_static"] = _ratio(entry["goodput_tok_s"], static.get("goodput_tok_s"))
        entry["request_vs_oracle"] = _ratio(entry["request_tok_s"], oracle.get("request_tok_s"))
        entry["request_vs_best_static"] = _ratio(entry["request_tok_s"], best_speed)
        if "weighted_goodput_tok_s" in entry:
            entry["weighted_vs_oracle"] = _ratio(entry["weighted_goodput_tok_s"], oracle.get("weighted_goodput_tok_s"))
        for per_seed in entry.get("seeds", {}).values():
            per_seed["vs_oracle"] = _ratio(per_seed["goodput_tok_s"], oracle.get("goodput_tok_s"))
        if "seeds" in entry:
            entry["vs_oracle_min"] = min((x["vs_oracle"] for x in entry["seeds"].values() if x["vs_oracle"]),
                                         default=None)
    ordered = dict(sorted(policies.items(), key=lambda kv: (kv[0] in REFERENCES, kv[0] != PRODUCT, kv[0])))
    entry = {
        "duration_s": plan.data["duration_s"],
        "workers": [wid for w in plan.data["workers"] for wid in
                    ([w["id"]] if w.get("count", 1) == 1 else [f"{w['id']}-{i}" for i in range(w["count"])])],
        "has_changes": bool(plan.data.get("changes")),
        "hardware": hardware_truth(plan.data),
        "preset_config": plan.data.get("preset_config") or {},
        "policies": ordered,
        "grid": sorted(grid, key=lambda g: (g["phase"] != "full", g["depth"], g["width"])),
    }
    entry["goals"] = scenario_goals(plan.name, ordered, "goodput_tok_s")
    entry["goals_request_tok_s"] = scenario_goals(plan.name, ordered, "request_tok_s")
    if plan.data.get("classes"):
        entry["classes"] = plan.data["classes"]
        entry["default_class"] = plan.data.get("default_class")
        entry["class_goals"] = class_goals(ordered)
    return entry, series


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def scenario_goals(name: str, policies: dict[str, dict], metric: str = "goodput_tok_s") -> dict[str, Any]:
    """The issue's ratio goals for the product policy on one scenario, on ``metric``.

    Each ratio goal also records ``ceiling``: the same ratio for the oracle,
    the most any policy could reach against that reference.
    """
    product = policies.get(PRODUCT)
    if product is None:
        return {}
    g = product[metric]
    oracle = policies.get("oracle")
    best = oracle[metric] if oracle else None
    goals: dict[str, Any] = {}

    def goal(key: str, reference: float, threshold: float, **extra) -> None:
        ratio = g / reference if reference else math.inf
        entry = {"value": round(ratio, 4), "met": ratio >= threshold, **extra}
        if best is not None and reference:
            entry["ceiling"] = round(best / reference, 4)
        goals[key] = entry

    if oracle and oracle[metric]:
        ratio = g / oracle[metric]
        goals["vs_oracle>=0.95"] = {"value": round(ratio, 4), "met": ratio >= 0.95}
    baselines = {k: v[metric] for k, v in policies.items()
                 if k not in REFERENCES and k != PRODUCT and not k.endswith(ONE_CLASS_SUFFIX)}
    if baselines:
        best_name = max(baselines, key=baselines.get)
        goal("vs_best_baseline>=0.98", baselines[best_name], 0.98, baseline=best_name)
    tag = GOAL_TAGS.get(name)
    static = policies.get("best_static")
    if tag in BEAT_STATIC_TAGS and static:
        reference = static[metric] if metric == "goodput_tok_s" else static["best_by_request_tok_s"][metric]
        goal("vs_best_static>=1.10", reference, 1.10)
    if tag == "cliff":
        for rival in CLIFF_RIVALS:
            if rival in policies and policies[rival][metric]:
                goal(f"vs_{rival}>=1.3", policies[rival][metric], 1.3)
    return goals


def class_goals(policies: dict[str, dict]) -> dict[str, Any]:
    """The issue's request-class goals (#29) for the product on a scenario with classes.

    - ``NAME tpot <= target``, per class with a target: the product's TPOT
      quantile against it, with the oracle's (what the per-class oracle
      reached) and the one-class run's;
    - ``weighted_vs_oracle>=0.95``: weighted goodput against the class oracle's;
    - ``NAME tpot_p99 one-class/classes>=1.3``, per class with a target: how
      much lower its TPOT p99 is than under the same policy without classes;
    - ``goodput_loss_vs_one_class<=0.10``: total goodput lost to the classes.
    """
    product = policies.get(PRODUCT)
    if product is None or "per_class" not in product:
        return {}
    oracle = policies.get("oracle")
    single = policies.get(f"{PRODUCT}{ONE_CLASS_SUFFIX}")
    goals: dict[str, Any] = {}
    for name, c in product["per_class"].items():
        if c["tpot_target_ms"] is None:
            continue
        key = f"tpot_{c['tpot_quantile']}"
        value = c[f"tpot_ms_{c['tpot_quantile']}"]
        g = {"value": value, "target": c["tpot_target_ms"], "met": c["target_met"],
             "target_met_share": c["target_met_share"], "bins_met_share": c.get("bins_met_share")}
        if oracle is not None:
            o = oracle["per_class"][name]
            g.update(oracle=o[f"tpot_ms_{c['tpot_quantile']}"], oracle_met=o["target_met"],
                     oracle_bins_met_share=o.get("bins_met_share"))
        if single is not None:
            g["one_class"] = single["per_class"][name][f"tpot_ms_{c['tpot_quantile']}"]
        goals[f"{name} {key}<=target"] = g
    if oracle is not None and oracle.get("weighted_goodput_tok_s"):
        ratio = product["weighted_goodput_tok_s"] / oracle["weighted_goodput_tok_s"]
        goals["weighted_vs_oracle>=0.95"] = {"value": round(ratio, 4), "met": ratio >= 0.95}
    if single is not None:
        for name, c in product["per_class"].items():
            base = single["per_class"][name]["tpot_ms_p99"]
            if c["tpot_target_ms"] is None or not c["tpot_ms_p99"] or base is None:
                continue
            ratio = base / c["tpot_ms_p99"]
            goals[f"{name} tpot_p99 one-class/classes>=1.3"] = {
                "value": round(ratio, 4), "met": ratio >= 1.3, "one_class": base, "classes": c["tpot_ms_p99"]}
        if single["goodput_tok_s"]:
            loss = 1.0 - product["goodput_tok_s"] / single["goodput_tok_s"]
            goals["goodput_loss_vs_one_class<=0.10"] = {
                "value": round(loss, 4), "met": loss <= 0.10, "one_class": single["goodput_tok_s"],
                "classes": product["goodput_tok_s"]}
    return goals


def execute(plans: Sequence[ScenarioPlan], n_jobs: int, progress=None, tasks: dict | None = None) -> dict[Job, dict]:
    """Run every plan's jobs on ``n_jobs`` processes (``<= 1``: in this process).

    Jobs start heaviest first, the grid's scouts before them (they are short
    and decide the second phase, which is queued as soon as they are in).
    """
    results: dict[Job, dict] = {}
    by_name = {p.name: p for p in plans}
    first = [job for p in plans for job in p.first_jobs()]
    queue = deque(sorted(first, key=lambda j: (j.kind != "scout", -j.cost_estimate())))

    def done(job: Job, result: dict) -> list[Job]:
        results[job] = result
        if progress is not None and tasks is not None:
            progress.advance(tasks[job.scenario])
            progress.advance(tasks["__all__"])
        more = by_name[job.scenario].on_done(job, result)
        if progress is not None and tasks is not None and job.kind == "scout" and not by_name[job.scenario].scouts_left:
            plan = by_name[job.scenario]
            surplus = plan.finalists + 1 - len(plan.finals)
            if surplus:
                t = progress.tasks[tasks[job.scenario]]
                progress.update(tasks[job.scenario], total=t.total - surplus)
                progress.update(tasks["__all__"], total=progress.tasks[tasks["__all__"]].total - surplus)
        return more

    if n_jobs <= 1:
        while queue:
            job = queue.popleft()
            queue.extend(done(job, run_job(job)))
        return results
    import multiprocessing as mp

    with ProcessPoolExecutor(max_workers=n_jobs, mp_context=mp.get_context("spawn")) as pool:
        running = {pool.submit(run_job, job): job for job in queue}
        while running:
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                job = running.pop(future)
                for extra in done(job, future.result()):
                    running[pool.submit(run_job, extra)] = extra
    return results


def run_policy_bench(
    scenarios: Sequence[str | Path] | None = None,
    out_dir: str | Path = "bench/results",
    *,
    quick: bool = False,
    jobs: int | None = None,
    delay_steps: int = DEFAULT_DELAY_STEPS,
    presets: Sequence[str] | None = None,
    config_path: str | None = None,
    grid_depths: Sequence[int] | None = None,
    grid_widths: Sequence[int] | None = None,
    scout: bool | None = None,
    plots: bool = True,
    console=None,
    scenario_data_override: dict[str, dict] | None = None,
    hardware: str | None = None,
    seeds: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Run the benchmark, write ``policies.json`` (+ ``policies-series.json`` and PNGs), return the report.

    ``seeds``: policy seeds (``--seeds``): every preset with a ``seed`` field runs
    once per seed and reports the mean, each seed's run under ``seeds``
    (:func:`merge_seeds`); the other runs are unchanged.

    ``scenario_data_override``: {name: scenario dict} to run instead of files
    (tests); ``scout``: two-phase grid (default: on for the full suite, off
    for ``--quick``, which runs its coarse grid at full length);
    ``hardware``: the cost truth, ``"roofline"`` (default) or a measured
    table's name (see the module docstring).
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = console or Console()
    started = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    presets = list(presets) if presets else list_presets()
    for name in presets:
        load_preset(name)  # refuse a bad name before any run
    seeds = tuple(seeds or ())
    bad = [x for x in seeds if isinstance(x, bool) or not isinstance(x, int) or x < 0]
    if bad or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds: {list(seeds)} must be distinct integers >= 0"
                         + (f" ({bad} are not)" if bad else " (some repeat)"))
    config = load_config(config_path).model_dump(mode="json") if config_path else None
    if grid_depths is None and quick:
        grid_depths = QUICK_GRID_DEPTHS
    if grid_widths is None:
        grid_widths = QUICK_GRID_WIDTHS if quick else GRID_WIDTHS
    if scout is None:
        scout = not quick
    hardware = hardware or ROOFLINE
    if hardware not in hardware_choices():
        raise ValueError(f"hardware {hardware!r}: choose one of {', '.join(hardware_choices())}")
    datas: dict[str, dict] = dict(scenario_data_override or {})
    explicit = bool(datas) or bool(scenarios)
    if not datas:
        for path in suite_paths(scenarios):
            data = scenario_data(path, quick)
            datas[data["name"]] = data
    skipped: dict[str, str] = {}
    if hardware != ROOFLINE:
        for name in list(datas):
            data, moved = with_hardware(datas[name], hardware)
            if not moved:
                entry = MEASURED_HARDWARE[hardware]
                reason = f"no single-GPU {entry.profile} worker running {entry.model} to put on {hardware}"
                if explicit:
                    raise ScenarioError(name, [f"workers: {reason}"])
                skipped[name] = reason
                del datas[name]
                continue
            scenario_from_dict(data, name)  # refuse a bad combination before any run
            datas[name] = data
    plans = [ScenarioPlan(name, data, presets, grid_points(data, grid_depths, grid_widths), delay_steps, config, scout,
                          seeds)
             for name, data in datas.items()]
    n_runs = sum(p.expected_runs() for p in plans)
    n_jobs = jobs if jobs is not None else max(1, min(os.cpu_count() or 1, n_runs))
    with Progress(TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        tasks = {p.name: progress.add_task(p.name, total=p.expected_runs()) for p in plans}
        tasks["__all__"] = progress.add_task("all runs", total=n_runs)
        results = execute(plans, n_jobs, progress, tasks)
    report: dict[str, Any] = {
        "meta": {
            "benchmark": "specctl bench policies",
            "quick": quick,
            "time_scale": QUICK_TIME_SCALE if quick else 1.0,
            "hardware": hardware,
            "hardware_truth": (
                "the roofline (worker.sim.hardware) for every worker" if hardware == ROOFLINE else
                f"{MEASURED_HARDWARE[hardware].profile} single-GPU {MEASURED_HARDWARE[hardware].model} workers "
                f"priced from worker/sim/hardware_tables/{MEASURED_HARDWARE[hardware].table}; the others by "
                "the roofline (per scenario: hardware)"),
            "skipped_scenarios": skipped,
            "delay_steps": delay_steps,
            "policy_seeds": list(seeds) or None,
            "fallback": "speculation off until a worker's first plan arrives",
            "presets": presets,
            "grid": {"depths": list(grid_depths) if grid_depths is not None else "0..max_depth",
                     "widths": list(grid_widths),
                     "search": (f"every point on the scenario at x{SCOUT_TIME_SCALE} time, then the best "
                                f"{plans[0].finalists if plans else 3} by goodput and the best by request_tok_s "
                                "at full length" if scout else "every point at full length")},
            "controller_config": config or "defaults (ServerConfig())",
            "trtllm_gate": gate_settings(presets),
            "jobs": n_jobs,
            "runtime_s": None,
            "definitions": DEFINITIONS,
        },
        "scenarios": {},
    }
    all_series: dict[str, dict] = {}
    for plan in plans:
        entry, series = summarise(plan, results)
        report["scenarios"][plan.name] = entry
        all_series[plan.name] = series
    report["meta"]["runtime_s"] = round(time.perf_counter() - started, 2)
    (out / "policies.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "policies-series.json").write_text(json.dumps(all_series) + "\n")
    if plots:
        from bench.plots import plot_goodput, plot_series

        plot_goodput(report, out / "policies.png")
        plot_goodput(report, out / "policies-speed.png", metric="request_tok_s")
        for name, entry in report["scenarios"].items():
            if entry["has_changes"]:
                plot_series(name, all_series[name], entry, out / f"policies-series-{name}.png",
                            gate_settings(presets, entry["preset_config"].get("trtllm-gate")))
            if "class_goals" in entry:
                from bench.plots import plot_classes

                plot_classes(name, all_series[name], entry, out / f"policies-classes-{name}.png")
    console.print(results_table(report))
    console.print(goals_table(report))
    if any("class_goals" in e for e in report["scenarios"].values()):
        console.print(class_goals_table(report))
    console.print(f"wrote {out / 'policies.json'} in {report['meta']['runtime_s']:.1f} s")
    return report


def gate_settings(presets: Sequence[str], overrides: dict | None = None) -> dict | None:
    """The TensorRT-LLM gate preset's threshold and window (with a scenario's
    ``preset_config`` for it), for the series plots."""
    if "trtllm-gate" not in presets:
        return None
    config = load_preset("trtllm-gate", overrides).config
    return {"threshold": config.acceptance_rate_threshold, "window": config.acceptance_rate_window_size}


DEFINITIONS = {
    "goodput_tok_s": "Σ tokens emitted / Σ GPU step seconds over the fleet (the issue's goodput)",
    "request_tok_s": "Σ tokens / Σ (batch size × step seconds): a request's decode speed in the batch, "
                     "token-weighted (≈ 1000 / TPOT)",
    "tpot_ms_mean/p99": "per finished request: ms in the batch per output token",
    "mean_accepted": "mean τ (accepted draft tokens, bonus excluded) per speculating request-step",
    "spec_fraction": "share of request-steps that speculated",
    "vs_oracle / vs_best_static": "goodput ratios; request_vs_*: the same on request_tok_s",
    "per_class (scenarios with classes)": "per request class: tpot_ms_p50/p99 over its finished requests (time in "
                                          "the batch over tokens emitted), its target and whether that quantile met "
                                          "it, target_met_share (its requests at or under the target), "
                                          "bins_met_share (time bins whose finished requests met it), goodput_tok_s "
                                          "(its tokens per fleet busy second)",
    "weighted_goodput_tok_s": "Σ_c weight_c · tokens_c / Σ busy seconds; weighted_vs_oracle: against the class "
                              "oracle's (weighted goodput under the TPOT targets, per step)",
    "goodput-one-class": "the goodput preset without the scenario's classes, on the same fleet and requests",
    "seeds (with --seeds)": "per policy seed of a preset with a `seed` field (the goodput preset's probes): that "
                            "run's goodput_tok_s, request_tok_s and vs_oracle; the entry's goodput_tok_s, "
                            "request_tok_s, tpot_ms_mean/p99, mean_accepted, spec_fraction, tokens and finished are "
                            "their means over the seeds (vs_oracle that of the mean goodput, vs_oracle_min the "
                            "lowest seed's), its other fields and its series the first seed's run",
}


# ------------------------------------------------------------------- tables
def results_table(report: dict):
    from rich.table import Table

    table = Table(title="Goodput tok/s · ratio to oracle / to best static · request-speed ratio to oracle",
                  show_lines=True)
    names = list(report["scenarios"])
    policies: list[str] = []
    for entry in report["scenarios"].values():
        for p in entry["policies"]:
            if p not in policies:
                policies.append(p)
    policies.sort(key=lambda p: (p in REFERENCES, p != PRODUCT, p))
    table.add_column("policy")
    for name in names:
        table.add_column(name, justify="right")
    for p in policies:
        row = [p]
        for name in names:
            e = report["scenarios"][name]["policies"].get(p)
            if e is None:
                row.append("-")
                continue
            cell = (f"{e['goodput_tok_s']:,.0f}\n{_fmt(e['vs_oracle'])} / {_fmt(e['vs_best_static'])}"
                    f"\nspeed {_fmt(e['request_vs_oracle'])}")
            if p == "best_static":
                c = e["config"]
                cell += f"\nd={c['depth']} w={c['width']}"
            if e.get("seeds"):  # --seeds: the mean above, each seed's ratio to the oracle here
                cell += "\nseeds " + " ".join(f"{_fmt(x['vs_oracle'])}" for x in e["seeds"].values())
            row.append(cell)
        table.add_row(*row, style="bold" if p == PRODUCT else None)
    return table


def class_goals_table(report: dict):
    """The request-class goals (issue #29) of every scenario with classes, and each policy's per-class TPOT."""
    from rich.table import Table

    table = Table(title=f"Request classes: '{PRODUCT}' against its targets, the class oracle and itself without "
                        "classes")
    for col in ("scenario", "goal", "value", "met", "reference"):
        table.add_column(col)
    for name, entry in report["scenarios"].items():
        for goal, g in entry.get("class_goals", {}).items():
            ref = ", ".join(f"{k} {v}" for k, v in g.items() if k not in ("value", "met"))
            met = g.get("met")
            table.add_row(name, goal, f"{g['value']}", "-" if met is None else "yes" if met else "[red]NO[/]", ref)
    return table


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def goals_table(report: dict):
    from rich.table import Table

    table = Table(title=f"Goals for '{PRODUCT}' (issue 3): on goodput_tok_s, the oracle's ratio (the ceiling), "
                        "and on request_tok_s")
    for col in ("scenario", "goal", "goodput", "met", "oracle", "request speed", "met "):
        table.add_column(col)
    for name, entry in report["scenarios"].items():
        speed = entry.get("goals_request_tok_s", {})
        for goal, g in entry.get("goals", {}).items():
            s = speed.get(goal, {})
            extra = f" ({g['baseline']})" if "baseline" in g else ""
            extra_s = f" ({s['baseline']})" if "baseline" in s else ""
            table.add_row(name, goal, f"{g['value']:.3f}{extra}", "yes" if g["met"] else "[red]NO[/]",
                          f"{g['ceiling']:.3f}" if "ceiling" in g else "-",
                          f"{s['value']:.3f}{extra_s}" if s else "-",
                          ("yes" if s["met"] else "[red]NO[/]") if s else "-")
    return table
