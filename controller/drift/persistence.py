"""Saving and restoring the drift monitor: baselines, alerts and bookkeeping as JSON-ready data.

A monitor learns each stratum's baseline from thousands of request-steps; a
controller that restarts should not relearn them (nor raise again the alerts
it had open). :func:`monitor_to_dict` writes what must survive — the
configuration, every drafter version with its workers and the baselines of
its strata, the alert counter and (unless the alert store keeps them, see
:mod:`controller.alerts.store`) the alerts — and :func:`monitor_from_dict`
rebuilds a monitor from it: strata refit their weights and versions
recalibrate their CUSUMs from the stored baselines (cached, so a restore costs
no more than the first fit). Live windows and CUSUM sums are not kept: a
restored monitor starts its windows afresh. These back
:meth:`AcceptanceDriftMonitor.to_dict <controller.drift.monitor.AcceptanceDriftMonitor.to_dict>`
and :meth:`~controller.drift.monitor.AcceptanceDriftMonitor.from_dict`.

Several replicas run one monitor per drafter version fleet-wide and hand a
version from one replica to another (:mod:`controller.fleet.drift_owner`):
:func:`version_to_dict` / :func:`version_from_dict` save and rebuild one
version (the rebuild touches no monitor, so it may run off the event loop),
:func:`install_version` and :func:`remove_version` move it into and out of a
running monitor without resolving anything.

Examples
--------
>>> import json
>>> import numpy as np
>>> from types import SimpleNamespace
>>> from controller.drift.monitor import AcceptanceDriftMonitor
>>> rng = np.random.default_rng(0)
>>> limits = SimpleNamespace(kind="eagle", version="v1", max_depth=4, max_width=1, trained_context_len=8192)
>>> mon = AcceptanceDriftMonitor(baseline_steps=200, baseline_max=200, window=100, n_bootstrap=128,
...                              cusum_horizon=512)
>>> for t in range(1000):
...     ctx = int(rng.choice([500, 3000, 9000]))
...     mon.observe_request(limits, ctx, int(rng.binomial(4, 0.7)), 4, now=float(t), worker_id="w0")
>>> data = json.loads(json.dumps(monitor_to_dict(mon)))
>>> sorted((s["bucket"], sum(n for _, _, n in s["baseline"])) for s in data["versions"][0]["strata"])
[(0, 200), (2, 200), (4, 200)]
>>> back = monitor_from_dict(AcceptanceDriftMonitor, data)
>>> [(s["stratum"], s["baseline_ready"], s["beyond_trained_context"]) for s in back.snapshot()["versions"][0]["strata"]]
[('ctx[0,1024)', True, False), ('ctx[2048,4096)', True, False), ('ctx[8192,16384)', True, True)]
>>> back.to_dict() == monitor_to_dict(mon)           # live windows and CUSUM sums start afresh
True
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from controller.drift.alerts import DriftAlert
from controller.drift.config import MonitorConfig
from controller.drift.strata import Stratum, Version

if TYPE_CHECKING:
    from controller.drift.monitor import AcceptanceDriftMonitor

M = TypeVar("M", bound="AcceptanceDriftMonitor")


def version_to_dict(v: Version) -> dict[str, Any]:
    """One drafter version's part of :func:`monitor_to_dict`: its limits, workers and the baselines of its
    strata (the alerts by id). Several replicas checkpoint one version at a time this way
    (:mod:`controller.fleet.drift_owner`)."""
    strata = []
    for s in v.strata.values():
        if s.weights is None:
            continue
        strata.append({"bucket": s.bucket, "domain": s.domain, "steps": s.n_seen,
                       "alert": s.alert.id if s.alert else None,
                       "baseline": [[list(k[0]), list(k[1]), n]
                                    for k, n in sorted(s.chi2.baseline_counts.items())]})
    return {"kind": v.kind, "version": v.version, "max_depth": v.max_depth,
            "max_width": v.max_width, "trained_context_len": v.trained_context_len,
            "workers": sorted(v.workers), "strata": strata,
            "extend_alert": v.extend_alert.id if v.extend_alert else None}


def monitor_to_dict(mon: AcceptanceDriftMonitor, alerts: bool = True) -> dict[str, Any]:
    """Baselines, alerts (unless ``alerts`` is False: a store keeps them) and bookkeeping as
    JSON-ready data (live windows are not kept)."""
    versions = [version_to_dict(v) for v in mon._versions.values()]
    cfg = asdict(mon.config)
    cfg["context_edges"] = list(cfg["context_edges"])
    cfg["drops"] = list(cfg["drops"])
    return {"format": 1, "config": cfg, "next_id": mon._next_id, "versions": versions,
            "alerts": [a.to_dict() for a in mon.alerts.values()] if alerts else []}


def version_from_dict(vd: dict[str, Any], config: MonitorConfig, ert_cusum: float,
                      alerts: dict[str, DriftAlert] | None = None) -> Version:
    """Rebuild one drafter version from :func:`version_to_dict` output: strata refit their weights and the
    version's CUSUMs recalibrate (cached). Alert ids found in ``alerts`` are attached; others are left for
    the caller to adopt. Touches no monitor, so it may run off the event loop."""
    v = Version(vd["kind"], vd["version"], vd["max_depth"], vd["max_width"], vd["trained_context_len"],
                len(config.drops))
    alerts = alerts or {}
    for w in vd.get("workers", []):
        v.workers.add(w)
    if vd.get("extend_alert"):
        v.extend_alert = alerts.get(vd["extend_alert"])
    for sd in vd["strata"]:
        s = Stratum(v, int(sd["bucket"]), sd["domain"], config, config.seed)
        s.n_seen = int(sd.get("steps", 0))
        s.chi2.fit({(tuple(r), tuple(c)): int(n) for r, c, n in sd["baseline"]})
        s.fit_weights(config)
        if sd.get("alert"):
            s.alert = alerts.get(sd["alert"])
        v.strata[(s.bucket, s.domain)] = s
    v.calibrate(config, ert_cusum)
    return v


def install_version(mon: AcceptanceDriftMonitor, v: Version) -> None:
    """Put a rebuilt version into a running monitor (replacing its own copy, quietly); its workers map to it
    unless the monitor has seen them on another version since."""
    remove_version(mon, v.key)
    mon._versions[v.key] = v
    for w in v.workers:
        mon._workers.setdefault(w, v.key)
    for alert in [s.alert for s in v.strata.values()] + [v.extend_alert]:
        if alert is not None:
            mon.alerts[alert.id] = alert


def remove_version(mon: AcceptanceDriftMonitor, key: tuple[str, str]) -> Version | None:
    """Take a version out of a running monitor without resolving anything (another replica watches it
    now); returns it, or None when it was not tracked."""
    v = mon._versions.pop(key, None)
    if v is None:
        return None
    for w in v.workers:
        if mon._workers.get(w) == key:
            del mon._workers[w]
    return v


def monitor_from_dict(cls: type[M], data: dict[str, Any], clock: Callable[[], float] = time.time) -> M:
    """Rebuild a monitor of class ``cls`` from :func:`monitor_to_dict` output (baselines recalibrate, cached)."""
    if data.get("format") != 1:
        raise ValueError(f"format must be 1, got {data.get('format')!r}")
    cfg = dict(data["config"])
    cfg["context_edges"] = tuple(cfg["context_edges"])
    cfg["drops"] = tuple(cfg["drops"])
    mon = cls(MonitorConfig(**cfg), clock=clock)
    mon._next_id = int(data.get("next_id", 1))
    for d in data.get("alerts", []):
        alert = DriftAlert.from_dict(d)
        mon.alerts[alert.id] = alert
    for vd in data.get("versions", []):
        v = version_from_dict(vd, mon.config, mon.ert_cusum, mon.alerts)
        mon._versions[v.key] = v
        for w in v.workers:
            mon._workers[w] = v.key
    return mon


def tracked_version(mon: AcceptanceDriftMonitor, key: tuple[str, str]) -> Version | None:
    """The monitor's live state of drafter version ``key`` (kind, version), or None."""
    return mon._versions.get(key)


def tracked_versions(mon: AcceptanceDriftMonitor) -> list[tuple[str, str]]:
    """The drafter versions a monitor tracks, least recently seen first."""
    return list(mon._versions)
