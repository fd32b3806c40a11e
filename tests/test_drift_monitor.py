"""AcceptanceDriftMonitor: content drift → RETRAIN_HEADS; context-mix and
batch shifts → no retrain alert; traffic past the trained context →
EXTEND_TRAINING_CONTEXT; whole-distribution test; one alert per stratum until
it resolves; persistence; the controller's on_step hook."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from bench.drift import MAX_DEPTH, TRAINED_CONTEXT, StreamSpec, make_stream
from controller.drift import AcceptanceDriftMonitor, Action, Severity, Status
from worker.sim.acceptance import PROFILES, context_factor

FAST = dict(baseline_steps=500, window=300, round_steps=500, ert=2_000_000, n_bootstrap=512, cusum_paths=128,
            cusum_horizon=2048)


def limits(version: str = "v1") -> SimpleNamespace:
    return SimpleNamespace(kind="eagle", version=version, max_depth=MAX_DEPTH, max_width=1,
                           trained_context_len=TRAINED_CONTEXT, max_tree_nodes=MAX_DEPTH)


def feed(mon: AcceptanceDriftMonitor, data: dict, start: int = 0, end: int | None = None, t0: int = 0,
         version: str = "v1", worker: str = "w0", domain: str | list[str] = "") -> None:
    lim = limits(version)
    end = len(data["tau"]) if end is None else end
    domains = domain if isinstance(domain, list) else None
    for i in range(start, end):
        mon.observe_request(lim, int(data["ctx"][i]), int(data["tau"][i]), int(data["depth"][i]),
                            domain=domains[i] if domains else domain, now=float(t0 + i), worker_id=worker)


def stream(kind: str, n: int, change_at: int, seed: int = 0, **kw) -> dict:
    return make_stream(StreamSpec(f"test-{kind}", kind, n=n, change_at=change_at, **kw), seed)


def custom_stream(n: int, seed: int, ctx_range: tuple[int, int], factor: np.ndarray | float = 1.0) -> dict:
    """Chain steps at depth 6 with contexts uniform in ctx_range and acceptance × factor."""
    rng = np.random.default_rng(seed)
    profile = PROFILES["eagle"]
    ctx = rng.integers(*ctx_range, size=n)
    depth = np.full(n, 6)
    base = np.array(profile.alpha[:MAX_DEPTH])
    alpha = base * context_factor(ctx, TRAINED_CONTEXT, profile, MAX_DEPTH) * np.broadcast_to(factor, (n,))[:, None]
    ok = rng.random((n, MAX_DEPTH)) < np.minimum(alpha, 0.98)
    ok &= np.arange(MAX_DEPTH)[None, :] < depth[:, None]
    return {"ctx": ctx, "depth": depth, "tau": np.cumprod(ok, axis=1).sum(axis=1)}


def retrain(mon: AcceptanceDriftMonitor) -> list:
    return [a for a in mon.alerts.values() if a.action is Action.RETRAIN_HEADS]


def test_content_drop_raises_retrain_heads_with_every_field() -> None:
    data = stream("abrupt", n=9000, change_at=6000)
    mon = AcceptanceDriftMonitor(**FAST)
    opened: list = []
    mon.listeners.append(lambda event, alert: opened.append((event, alert)))
    feed(mon, data, 0, 6000)
    assert not mon.alerts
    feed(mon, data, 6000)
    alerts = retrain(mon)
    assert alerts and all(e == "opened" for e, _ in opened)
    first = min(alerts, key=lambda a: a.opened_at)
    assert 6000 < first.opened_at < 7000
    for a in alerts:
        assert a.drafter_kind == "eagle" and a.drafter_version == "v1"
        assert a.stratum.startswith("ctx[") and a.context_len_max <= TRAINED_CONTEXT
        assert a.detector in ("cusum", "chi2") and a.score >= 1.0
        assert len(a.baseline_hist) == len(a.current_hist) == MAX_DEPTH + 1
        assert sum(a.baseline_hist) == a.n_baseline >= 500 and sum(a.current_hist) == a.n_current > 0
        assert len(a.baseline_alpha) == MAX_DEPTH and a.expected_tau_change < -0.05
        assert a.severity in (Severity.WARNING, Severity.CRITICAL) and a.first_seen <= a.opened_at
        assert a.status is Status.OPEN
    assert first.p_value is None if first.detector == "cusum" else 0 < first.p_value < 1
    json.dumps([a.to_dict() for a in mon.alerts.values()])  # JSON-ready for logs, webhooks, gRPC


@pytest.mark.parametrize("kind", ["context", "batch"])
def test_context_mix_or_batch_shift_alone_raise_no_retrain(kind: str) -> None:
    data = stream(kind, n=14_000, change_at=8000, seed=1)
    # The shift is real: the pooled accepted length moves a lot.
    assert data["tau"][:8000].mean() - data["tau"][8000:].mean() > 0.25
    mon = AcceptanceDriftMonitor(**{**FAST, "baseline_steps": 800})
    feed(mon, data)
    assert retrain(mon) == []
    extend = [a for a in mon.alerts.values() if a.action is Action.EXTEND_TRAINING_CONTEXT]
    if kind == "batch":
        assert not mon.alerts
    else:  # contexts moved past the trained 8k: a distinct finding, not "retrain"
        assert [a.stratum for a in extend if a.detector == "context_share"] == [f"ctx>{TRAINED_CONTEXT}"]
        assert all(a.action is not Action.INVESTIGATE for a in mon.alerts.values())


def test_same_mean_spread_change_is_caught_by_the_distribution_test() -> None:
    data = stream("variance", n=10_000, change_at=6000, seed=2)
    assert abs(data["tau"][:6000].mean() - data["tau"][6000:].mean()) < 0.1
    mon = AcceptanceDriftMonitor(**FAST)
    feed(mon, data, 0, 6000)
    assert not mon.alerts
    feed(mon, data, 6000)
    chi2 = [a for a in mon.alerts.values() if a.detector == "chi2"]
    assert chi2 and min(a.opened_at for a in chi2) < 8000
    a = chi2[0]
    assert a.p_adjusted is not None and a.p_value <= a.p_adjusted <= mon.round_level
    assert abs(a.expected_tau_change) < 0.1
    # The histogram moved to both ends: more all-reject and more all-accept steps.
    base = np.array(a.baseline_hist) / sum(a.baseline_hist)
    cur = np.array(a.current_hist) / sum(a.current_hist)
    assert cur[0] > base[0] + 0.1 and cur[5:].sum() > base[5:].sum()


def test_one_alert_per_stratum_until_it_resolves() -> None:
    drop = custom_stream(16_000, 3, (100, 4000), factor=np.r_[np.ones(4000), np.full(12_000, 0.9)])
    mon = AcceptanceDriftMonitor(**FAST)
    feed(mon, drop)
    alerts = list(mon.alerts.values())
    by_stratum = {}
    for a in alerts:
        by_stratum.setdefault(a.stratum, []).append(a)
    assert alerts and all(len(v) == 1 for v in by_stratum.values()), by_stratum.keys()  # no storm
    assert max(a.opened_at for a in alerts) < 9000  # nothing new over the last 7000 drifted steps
    assert all(a.is_open for a in alerts)
    # Acceptance comes back (e.g. the traffic returned): alerts resolve, none reopens.
    back = custom_stream(12_000, 4, (100, 4000))
    feed(mon, back, t0=16_000)
    assert all(a.status is Status.RESOLVED and a.resolution == "matches baseline again" for a in alerts)
    assert set(mon.alerts) == {a.id for a in alerts}
    assert mon.open_alerts() == []


def test_a_new_drafter_version_supersedes_the_old_ones_alerts() -> None:
    drop = custom_stream(6000, 5, (100, 2000), factor=np.r_[np.ones(3000), np.full(3000, 0.85)])
    mon = AcceptanceDriftMonitor(**FAST)
    feed(mon, drop, version="v1", worker="w0")
    old = mon.open_alerts()
    assert old and all(a.drafter_version == "v1" for a in old)
    fresh = custom_stream(2000, 6, (100, 2000), factor=0.85)
    feed(mon, fresh, t0=6000, version="v2", worker="w0")  # w0 rolled to the retrained heads
    assert all(a.status is Status.RESOLVED and a.resolution == "superseded by eagle/v2" for a in old)
    assert mon.open_alerts() == []  # v2 learns its own baseline (its acceptance is its normal)
    versions = [v["drafter_version"] for v in mon.snapshot()["versions"]]
    assert versions == ["v2"]


def test_traffic_past_the_trained_context_is_extend_never_retrain() -> None:
    # Only long-context traffic, then its acceptance falls further (e.g. longer contexts inside the bucket).
    data = custom_stream(8000, 7, (9000, 16000), factor=np.r_[np.ones(4000), np.full(4000, 0.85)])
    mon = AcceptanceDriftMonitor(**FAST)
    feed(mon, data)
    assert mon.alerts and retrain(mon) == []
    assert {a.action for a in mon.alerts.values()} == {Action.EXTEND_TRAINING_CONTEXT}
    share = [a for a in mon.alerts.values() if a.detector == "context_share"]
    assert len(share) == 1 and share[0].statistic == 1.0 and share[0].severity is Severity.CRITICAL
    # All traffic ran past the trained length: no in-range baseline, and the alert says so.
    assert share[0].n_baseline == 0 and share[0].expected_tau_change == 0.0
    assert "no baseline within the trained length yet" in share[0].message


def test_domain_tags_are_strata_of_their_own() -> None:
    n = 9000
    rng = np.random.default_rng(8)
    domains = list(rng.choice(["chat", "code"], size=n))
    factor = np.where((np.arange(n) >= 5000) & (np.array(domains) == "code"), 0.85, 1.0)
    data = custom_stream(n, 9, (100, 2000), factor=factor)
    mon = AcceptanceDriftMonitor(**FAST)
    feed(mon, data, domain=domains)
    alerts = retrain(mon)
    assert alerts and all(a.domain == "code" and a.stratum.endswith("/code") for a in alerts)


def test_baselines_and_open_alerts_survive_a_round_trip() -> None:
    data = custom_stream(9000, 10, (100, 4000), factor=np.r_[np.ones(3000), np.full(6000, 0.88)])
    mon = AcceptanceDriftMonitor(**FAST)
    feed(mon, data, 0, 3000)
    restored = AcceptanceDriftMonitor.from_dict(json.loads(json.dumps(mon.to_dict())))
    snap = restored.snapshot()["versions"][0]
    assert all(s["baseline_ready"] for s in snap["strata"] if s["baseline"] >= 500)
    feed(restored, data, 3000, 6000)  # no relearning: the drift is caught against the stored baseline
    opened = restored.open_alerts()
    assert opened and all(a.action is Action.RETRAIN_HEADS for a in opened)
    again = AcceptanceDriftMonitor.from_dict(json.loads(json.dumps(restored.to_dict())))
    assert [a.id for a in again.open_alerts()] == [a.id for a in opened]
    feed(again, data, 6000, 9000, worker="w0")
    assert [a.id for a in again.open_alerts()] == [a.id for a in opened]  # same alerts, none duplicated
    assert again.to_dict()["next_id"] == restored.to_dict()["next_id"]


def test_observe_step_works_as_the_controllers_on_step_hook() -> None:
    from controller.config import ServerConfig
    from controller.core import Controller
    from policies.presets import load_preset
    from protos.speculation.v1 import worker_pb2
    from tests.support import make_hello

    clock = [1000.0]
    ctl = Controller(ServerConfig(), load_preset("goodput"), clock=lambda: clock[0])
    mon = AcceptanceDriftMonitor(**{**FAST, "baseline_steps": 100})
    ctl.on_step.append(mon.observe_step)  # the wiring: one line where the controller is built
    state = ctl.hello(make_hello("w-hook", max_depth=6))
    rng = np.random.default_rng(11)
    for step_id in range(1, 101):
        clock[0] += 0.05
        reqs = []
        for j in range(4):
            tau = int(min(rng.geometric(0.25) - 1, 6))
            reqs.append(worker_pb2.RequestStep(request_id=f"r{j}", context_len=500 + 900 * j, depth=6, width=1,
                                               nodes=6, accepted=tau, domain="chat"))
        ctl.ingest(state, worker_pb2.StepReports(steps=[worker_pb2.StepReport(
            step_id=step_id, timestamp=clock[0], batch_size=4, draft_ms=1.0, verify_ms=10.0, requests=reqs)]))
    snap = mon.snapshot()
    assert snap["steps"] == 400
    (version,) = snap["versions"]
    assert (version["drafter_kind"], version["drafter_version"], version["workers"]) == ("eagle", "v1", ["w-hook"])
    assert {s["stratum"] for s in version["strata"]} == {"ctx[0,1024)/chat", "ctx[1024,2048)/chat",
                                                         "ctx[2048,4096)/chat"}
    assert sum(s["steps"] for s in version["strata"]) == 400


def test_a_drift_that_goes_on_alerts_only_its_own_stratum() -> None:
    """A drop on long contexts that goes on for 20k steps after it is seen
    alerts its own stratum once and never the quiet short-context stratum
    interleaved with it (the fleet-wide monitor's test in test_replicas.py
    once named it)."""
    n = 24_000
    quiet = custom_stream(n, 5, (100, 1000))
    drop = custom_stream(n, 6, (1100, 2000), factor=np.r_[np.ones(4000), np.full(n - 4000, 0.75)])
    both = {k: np.stack([quiet[k], drop[k]], axis=1).reshape(-1) for k in ("ctx", "depth", "tau")}  # interleaved
    mon = AcceptanceDriftMonitor(**FAST)
    feed(mon, both)
    alerts = list(mon.alerts.values())
    assert alerts, "the drop on long contexts was not seen"
    assert {a.context_len_min for a in alerts} == {1024}, [(a.stratum, a.detector, a.expected_tau_change)
                                                          for a in alerts]
