"""Closing the loop on the real model (issue 5): heads trained on chat meet
code → RETRAIN_HEADS alert over WatchAlerts → the controller's command sink
runs `specctl train-heads` on code → the worker rolls to the new heads on its
live stream → the alert resolves → the controller learns the new version."""

from __future__ import annotations

import json
import sqlite3

import pytest

from specctl.retrain_loop import LoopConfig, run_retrain_loop

pytestmark = pytest.mark.model


def test_drift_alert_retraining_and_roll_out_close_the_loop(tmp_path):
    report = run_retrain_loop(LoopConfig(work_dir=str(tmp_path), prompts=24, max_new_tokens=32, epochs=4,
                                         step_timeout_s=900), say=lambda *_: None)
    events = [e["event"] for e in report["timeline"]]
    assert events == ["heads trained", "baseline learned", "alert opened", "worker rolled", "alert resolved",
                      "new version learned"]
    alert = report["alert"]
    assert alert["detector"] in ("cusum", "chi2") and alert["expected_tau_change"] < -0.3
    assert report["new_version"] != report["first_version"]
    assert report["new_version_in_hello"] == report["new_version"]
    assert report["resolution"].startswith("superseded by")
    measured = {e["event"]: e.get("measured_tau_since_last_event") for e in report["timeline"]}
    # τ measured by the engine: chat heads on chat, then on code (until the roll), then retrained heads on code
    assert measured["worker rolled"] < 0.6 * measured["baseline learned"], report["timeline"]
    assert measured["new version learned"] > 2 * measured["worker rolled"], report["timeline"]
    # the store holds the alert's history: opened, then resolved
    with sqlite3.connect(tmp_path / "controller.sqlite3") as db:
        events = [row[0] for row in db.execute("SELECT event FROM alert_events WHERE alert_id = ? ORDER BY seq",
                                               (alert["id"],))]
    assert events == ["opened", "resolved"]
    json.dumps(report)  # the demo writes it as JSON
