"""``specctl bench fleet --drift-monitor both``: the fleet benchmark's Redis phase once per drift monitor
mode, side by side (``bench/fleet_drift.py`` :func:`run_drift_modes`, ``bench/fleet.py`` :func:`drift_record`)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import bench.fleet_drift
from bench.fleet import DRIFT_BUCKET_MIN, BenchError, drift_record, run_fleet_bench
from bench.fleet_drift import MODES, RATIO_KEYS, run_drift_modes
from protos.speculation.v1 import controller_pb2
from specctl.cli import build_parser

BLOCK_KEYS = {"alert_opened", "detection_s", "detection_evidence_s", "detection_after_fleet_drop_s",
              "open_alerts_max_per_stratum", "false_alerts_before_drift", "alerts_other_strata_after_drift",
              "redis_server_cpu_per_1k_steps_ms", "redis_ops_per_s", "cpu_per_1k_steps_ms", "evidence_shed_by_owner",
              "evidence_dropped", "monitor_request_steps", "owner", "workers_per_replica"}


class _View:
    """``Replicas.alert_history`` from fixed lists, per address."""

    def __init__(self, listed: dict[str, list[controller_pb2.DriftAlert]]) -> None:
        self.listed = listed

    async def alert_history(self, address: str) -> list[controller_pb2.DriftAlert]:
        return self.listed[address]


def _alert(alert_id: str, context_min: int, opened_at: float) -> controller_pb2.DriftAlert:
    return controller_pb2.DriftAlert(id=alert_id, stratum=f"ctx[{context_min},{context_min + 1024})",
                                     context_len_min=context_min, opened_at=opened_at,
                                     status=controller_pb2.ALERT_STATUS_OPEN)


def _procs(*addresses: str) -> list[SimpleNamespace]:
    return [SimpleNamespace(address=a, config={}, pid=None) for a in addresses]  # no /metrics to read


def _opened(t: float, replica: str, alert: controller_pb2.DriftAlert) -> dict:
    """An OPENED event as ``Replicas.follow_alerts`` records it: arrived at ``t`` on ``replica``'s stream."""
    return {"t": t, "replica": replica, "id": alert.id, "event": "ALERT_EVENT_OPENED",
            "context_len_min": alert.context_len_min, "opened_at": alert.opened_at}


def test_drift_record_times_alerts_against_the_drift_and_counts_false_ones() -> None:
    """Alerts whose evidence predates the drop are false; the first one on the drifted stratum after it gives
    the delays: to the first OPENED event any replica delivered, and to its evidence's time; one fleet-wide
    id listed by both replicas counts once with Redis, each replica's own with the embedded store."""
    early = _alert("drift-000001", DRIFT_BUCKET_MIN, 95.0)  # evidence before the drop at 100: a false alarm
    quiet = _alert("drift-000002", 0, 104.0)  # after it, on the stratum that did not drift
    found = _alert("drift-000003", DRIFT_BUCKET_MIN, 103.5)
    later = _alert("drift-000004", DRIFT_BUCKET_MIN, 111.0)
    view = _View({"a": [early, found, quiet], "b": [found, later]})
    # The false alarm reached a watcher after the drop began; the real one arrived later on b than on a.
    events = [_opened(100.5, "a", early), _opened(105.0, "b", found), _opened(104.2, "a", found),
              _opened(104.4, "a", quiet)]
    record = asyncio.run(drift_record(view, _procs("a", "b"), "redis", t_drop=100.0, t_all=110.0, events=events))
    assert record["alert_opened"] is True
    assert record["detection_s"] == pytest.approx(4.2)  # seen on a's stream, not the false alarm at 100.5
    assert record["detection_evidence_s"] == pytest.approx(3.5)
    assert record["detection_after_fleet_drop_s"] == pytest.approx(-5.8)
    assert record["false_alerts_before_drift"] == 1
    assert record["alerts_other_strata_after_drift"] == 1
    assert [a["id"] for a in record["alerts"]] == ["drift-000001", "drift-000003", "drift-000002", "drift-000004"]
    assert next(a for a in record["alerts"] if a["id"] == "drift-000003")["listed_by"] == ["a", "b"]
    # The embedded store numbers alerts per replica: the same id on two replicas is two alerts.
    embedded = asyncio.run(drift_record(view, _procs("a", "b"), "embedded", 100.0, 110.0, events))
    assert len(embedded["alerts"]) == 5 and embedded["detection_s"] == pytest.approx(4.2)
    # Only alerts before the drop, or none on the drifted stratum: nothing detected.
    missed = asyncio.run(drift_record(_View({"a": [early, quiet]}), _procs("a"), "redis", 100.0, 110.0,
                                      events[:1] + events[3:]))
    assert missed["alert_opened"] is False and missed["detection_s"] is None
    assert missed["detection_evidence_s"] is None and missed["false_alerts_before_drift"] == 1


def test_the_cli_runs_both_modes_side_by_side_and_bad_settings_are_refused(tmp_path: Path, monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(bench.fleet_drift, "run_drift_modes", lambda out, **kw: calls.append((out, kw)) or 0)
    args = build_parser().parse_args(["bench", "fleet", "--drift-monitor", "both", "--workers", "6",
                                      "--duration", "3", "--out", str(tmp_path)])
    assert args.func(args) == 0
    assert calls == [(str(tmp_path), {"replicas": 2, "workers": 6, "steps_per_s": args.steps_per_s,
                                      "measure_s": 3.0, "plots": True})]
    with pytest.raises(BenchError, match="drift_monitor must be one of replica, fleet, got 'both'"):
        run_fleet_bench(tmp_path, drift_monitor="both")  # one mode per fleet run; both is run_drift_modes
    with pytest.raises(BenchError, match="replicas must be at least 2 .*, got 1"):
        run_drift_modes(tmp_path, replicas=1)


def test_both_modes_run_side_by_side_and_report_one_block_each(tmp_path: Path) -> None:
    """A tiny run: two ``specctl serve`` replicas on one ``redis-server`` per mode, four agents."""
    code = run_drift_modes(tmp_path, replicas=2, workers=4, measure_s=2.0, warmup_s=3.0, converge_s=4.0,
                           alert_s=3.0, idle_s=0.5, progress=lambda line: None)
    assert code == 0
    report = json.loads((tmp_path / "fleet_drift_modes.json").read_text())
    assert (tmp_path / "fleet_drift_modes.png").stat().st_size > 10_000
    assert list(report["modes"]) == list(MODES) == ["replica", "fleet"]
    check_modes_report(report)
    ratios = report["fleet_over_replica"]
    assert set(ratios) == set(RATIO_KEYS)
    fleet, replica = report["modes"]["fleet"], report["modes"]["replica"]
    assert ratios["cpu_per_1k_steps_ms"] == pytest.approx(fleet["cpu_per_1k_steps_ms"] / replica["cpu_per_1k_steps_ms"])
    assert report["seed"] == 0 and report["workers"] == 4


def check_modes_report(report: dict) -> None:
    """What ``fleet_drift_modes.json`` must hold whatever the machine's speed: each block agrees with the
    phase it sums up, and the modes differ as their construction says (one owner's monitor fed through
    Redis, or every replica's own)."""
    for mode, block in report["modes"].items():
        assert BLOCK_KEYS <= set(block), (mode, BLOCK_KEYS - set(block))
        phase = report["phases"][mode]
        assert phase["backend"] == "redis" and "failover" not in phase
        assert block["cpu_per_1k_steps_ms"] > 0 and block["redis_ops_per_s"] > 0, block
        redis_cpu = block["redis_server_cpu_per_1k_steps_ms"]
        assert isinstance(redis_cpu, float) and redis_cpu >= 0.0, block  # CPU ticks: 0.0 is possible
        assert isinstance(block["alert_opened"], bool)
        assert (block["detection_evidence_s"] is not None) == block["alert_opened"]
        if block["detection_s"] is not None:
            # The first OPENED event on the drifted stratum arrived after the evidence of the first alert
            # there (same host clock); both delays count from the same drop.
            assert block["detection_evidence_s"] is not None
            assert block["detection_s"] >= block["detection_evidence_s"] >= 0.0, block
            assert block["detection_after_fleet_drop_s"] == pytest.approx(
                block["detection_s"] - block["fleet_drop_after_s"]), block
        alerts = phase["drift"]["alerts"]
        assert block["false_alerts_before_drift"] == sum(a["opened_s"] < 0 for a in alerts)
        assert block["open_alerts_max_per_stratum"] == max(
            [0, *(n for sample in phase["alerts"]["samples"] for n in sample["open"].values())])
        feeds = phase["drift"]["feeds"]
        workers = {r["address"]: r["workers"] for r in phase["replicas"]}
        for r in phase["replicas"]:  # its /metrics timed the plans it handed to gRPC in the last minute
            handoff = r["plan_handoff_ms"]
            if r["workers"]:
                assert handoff["n"] >= r["workers"] and 0.0 <= handoff["p50"] <= handoff["p99"] <= handoff["max"], r
        assert set(feeds) == set(workers) and block["feeds_read"] == 2  # both replicas' /metrics answered
        assert block["monitor_request_steps"] == int(sum(f["monitor_request_steps"] for f in feeds.values())) > 0
        assert block["evidence_dropped"] == int(sum(f["dropped_request_steps"] for f in feeds.values()))
        if mode == "replica":  # every replica's own monitor watches its own workers; nothing goes through Redis
            assert all(f["monitor_request_steps"] > 0 for a, f in feeds.items() if workers[a]), feeds
            assert all(f["evidence_sent"] == 0 and not f["owns"] for f in feeds.values()), feeds
        else:  # one monitor, the owner's, fed by every replica's forwarded evidence
            # Never two owners at once. The lease may have moved during the phase on a loaded machine
            # (the monitor then ran on each owner in turn), so which replica fed its monitor is not
            # pinned; the owner at the end did.
            owners = [a for a, f in feeds.items() if f["owns"]]
            assert len(owners) == 1, feeds
            owner = block["owner"]
            assert owners == [owner] and feeds[owner]["owns"] == ["eagle/v1"]
            assert feeds[owner]["monitor_request_steps"] > 0, feeds
            assert all(f["evidence_sent"] > 0 for a, f in feeds.items() if workers[a]), feeds
            assert block["evidence_shed_by_owner"] == int(feeds[owner]["dropped_request_steps"])
            for a, f in feeds.items():  # every replica with workers samples by the owner's published fraction
                if workers[a]:
                    assert 0.0 < f["sample_fraction"].get("eagle/v1", 0.0) <= 1.0, (a, workers, f)
    # The modes really differ: one fleet monitor has exactly one owner, whose shedding is counted;
    # per-replica monitors have none.
    fleet, replica = report["modes"]["fleet"], report["modes"]["replica"]
    # The same replica addresses: the same workers on the same replicas in both runs.
    assert [r["address"] for r in report["phases"]["fleet"]["replicas"]] == \
        [r["address"] for r in report["phases"]["replica"]["replicas"]]
    assert fleet["workers_per_replica"] == replica["workers_per_replica"] and sum(fleet["workers_per_replica"]) == 4
    assert isinstance(fleet["owner"], str) and isinstance(fleet["evidence_shed_by_owner"], int)
    assert replica["owner"] is None and replica["evidence_shed_by_owner"] is None
