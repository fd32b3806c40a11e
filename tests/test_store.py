"""StateStore: a real SQLite file (WAL) holding drift baselines, alert history
and acknowledgements across reopenings; clear errors for unusable files."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import pytest

from controller.alerts.alerting import restore_monitor
from controller.drift import AcceptanceDriftMonitor, DriftAlert, MonitorConfig
from controller.drift.alerts import Action, Severity, Status
from controller.alerts.store import StateStore, StoreError
from tests.test_drift_monitor import FAST, custom_stream, feed


def make_alert(alert_id: str = "drift-000001", version: str = "v1", **kw) -> DriftAlert:
    fields = dict(id=alert_id, drafter_kind="eagle", drafter_version=version, stratum="ctx[0,1024)",
                  context_len_min=0, context_len_max=1024, domain="", detector="cusum", statistic=14.2,
                  p_value=None, p_adjusted=None, score=1.1, baseline_hist=[5, 3, 2], current_hist=[7, 2, 1],
                  baseline_alpha=[0.6, 0.5], current_alpha=[0.45, 0.4], expected_tau_change=-0.12,
                  first_seen=100.0, opened_at=120.0, severity=Severity.WARNING, action=Action.RETRAIN_HEADS,
                  extra={"threshold": np.float64(12.5), "tested": np.int64(3)})
    fields.update(kw)
    return DriftAlert(**fields)


def baselines(mon: AcceptanceDriftMonitor) -> dict:
    """(version, stratum) -> (baseline request-steps, ready) for every stratum with a baseline."""
    return {(v["drafter_version"], s["stratum"]): (s["baseline"], s["baseline_ready"])
            for v in mon.snapshot()["versions"] for s in v["strata"] if s["baseline_ready"]}


@pytest.fixture
def db(tmp_path: Path) -> str:
    return str(tmp_path / "state" / "specctl.sqlite3")  # the folder does not exist yet


def test_alert_history_and_acks_survive_reopening_in_wal_mode(db: str) -> None:
    store = StateStore(db)
    alert = make_alert()
    store.record_event("opened", alert.to_dict(), at=120.0)
    alert.acked_at, alert.acked_by = 130.0, "oncall"
    store.record_event("acknowledged", alert.to_dict(), at=130.0)
    alert.status, alert.resolved_at, alert.resolution = Status.RESOLVED, 150.0, "matches baseline again"
    store.record_event("resolved", alert.to_dict(), at=150.0)
    store.record_event("opened", make_alert("drift-000002", version="v2", opened_at=160.0).to_dict(), at=160.0)
    store.close()

    with sqlite3.connect(db) as conn:  # the file as any SQLite client sees it
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("SELECT status, acked_by FROM alerts WHERE id = 'drift-000001'").fetchone() == \
            ("RESOLVED", "oncall")

    again = StateStore(db)
    try:
        events = again.events("drift-000001").result()
        assert [(e, at) for e, at, _ in events] == [("opened", 120.0), ("acknowledged", 130.0), ("resolved", 150.0)]
        assert events[0][2]["acked_at"] is None and events[1][2]["acked_by"] == "oncall"
        back = [DriftAlert.from_dict(d) for d in again.alerts().result()]
        assert [a.id for a in back] == ["drift-000001", "drift-000002"]
        assert back[0].to_dict() == alert.to_dict()  # numpy scalars in `extra` came back as plain numbers
        assert [a.id for a in map(DriftAlert.from_dict, again.alerts(open_only=True).result())] == ["drift-000002"]
        assert [d["id"] for d in again.alerts(drafter_version="v1").result()] == ["drift-000001"]
        assert again.alert("drift-000404").result() is None
        assert again.max_alert_number().result() == 2
    finally:
        again.close()


def test_monitor_baselines_are_saved_per_version_and_restored(db: str) -> None:
    data = custom_stream(3000, 10, (100, 4000))
    mon = AcceptanceDriftMonitor(**FAST)
    feed(mon, data, version="v1", worker="w0")
    feed(mon, data, version="v2", worker="w1")
    store = StateStore(db)
    store.save_monitor(mon.to_dict(alerts=False), at=1.0)
    store.close()

    store = StateStore(db)
    try:
        with sqlite3.connect(db) as conn:
            assert sorted(conn.execute("SELECT drafter_version FROM baselines")) == [("v1",), ("v2",)]
        restored, open_alerts = restore_monitor(store, mon.config)
        assert open_alerts == []
        assert baselines(restored) == baselines(mon) and len(baselines(mon)) >= 4
        # A version the monitor no longer tracks leaves the store with the next save.
        mon.retire_version("eagle", "v1")
        store.save_monitor(mon.to_dict(alerts=False), at=2.0)
        store.flush()
        with sqlite3.connect(db) as conn:
            assert list(conn.execute("SELECT drafter_version FROM baselines")) == [("v2",)]
    finally:
        store.close()


def test_baselines_of_other_context_buckets_are_not_restored(db: str) -> None:
    mon = AcceptanceDriftMonitor(**FAST)
    feed(mon, custom_stream(1500, 11, (100, 900)))
    store = StateStore(db)
    try:
        store.save_monitor(mon.to_dict(alerts=False), at=1.0)
        other = MonitorConfig(**{**FAST, "context_edges": (0, 512, 4096)})
        restored, _ = restore_monitor(store, other)
        assert restored.snapshot()["versions"] == []
        same, _ = restore_monitor(store, mon.config)
        assert [v["drafter_version"] for v in same.snapshot()["versions"]] == ["v1"]
    finally:
        store.close()


def test_in_memory_store_works_and_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    store = StateStore("")
    store.record_event("opened", make_alert().to_dict(), at=1.0)
    assert [d["id"] for d in store.alerts().result()] == ["drift-000001"]
    store.close()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(StoreError, match="closed"):
        store.record_event("opened", make_alert().to_dict(), at=1.0)


def test_unusable_files_are_refused_naming_the_path(tmp_path: Path) -> None:
    garbage = tmp_path / "not-a-db.sqlite3"
    garbage.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match=r"store\.path=.*not-a-db\.sqlite3"):
        StateStore(str(garbage))
    newer = tmp_path / "newer.sqlite3"
    with sqlite3.connect(newer) as conn:
        conn.execute("PRAGMA user_version=99")
    with pytest.raises(StoreError, match="schema version 99"):
        StateStore(str(newer))
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StoreError, match="store.path"):
        StateStore(str(blocker / "below-a-file.sqlite3"))
