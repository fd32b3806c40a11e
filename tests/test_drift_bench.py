"""``specctl bench drift``: the stream generator has the effects the bench
relies on, scoring follows river's drift/evaluate.py, and a tiny run writes
the JSON (with the keys the issue names) and the PNG."""

from __future__ import annotations

import io
import json

from rich.console import Console

from bench.drift import JSON_KEYS, StreamSpec, make_stream, match, run_drift_bench, score_runs


def test_streams_have_the_effects_the_bench_relies_on() -> None:
    def means(kind: str) -> tuple[float, float]:
        data = make_stream(StreamSpec(f"t-{kind}", kind, n=8000, change_at=4000), seed=0)
        return float(data["tau"][:4000].mean()), float(data["tau"][4000:].mean())

    before, after = means("context")
    assert after < before - 0.2  # the context effect is real: pooled acceptance falls
    before, after = means("batch")
    assert after < before - 0.5  # shallower drafts at large batches
    before, after = means("variance")
    assert abs(after - before) < 0.1  # same mean ...
    data = make_stream(StreamSpec("t-variance", "variance", n=8000, change_at=4000), seed=0)
    assert data["tau"][4000:].var() > 1.5 * data["tau"][:4000].var()  # ... larger spread


def test_scoring_matches_river_evaluate() -> None:
    hits, false = match([110, 900], [100], delta_max=50)
    assert hits == {0: [110]} and false == [900]
    spec = StreamSpec("t", "abrupt", n=10_000, change_at=100)  # detection window [100, 100 + DELTA_MAX]
    scored = score_runs([{"alarms": [50, 60, 130, 140, 9000]}, {"alarms": []}], spec)
    assert scored["delays"] == [30] and scored["missed_rate"] == 0.5
    assert scored["false_alarms_per_100k"] == 15.0  # 3 false alarms in 20 000 request-steps
    assert scored["mtfa"] == 4475.0  # gaps 10 and 8940


def test_tiny_bench_writes_json_and_png(tmp_path) -> None:
    streams = (StreamSpec("abrupt_drop", "abrupt", n=3000, change_at=2000),
               StreamSpec("batch_shift", "batch", n=3000, change_at=2000))
    console = Console(file=io.StringIO(), width=120)
    assert run_drift_bench(tmp_path, seeds=(0,), streams=streams, workers=1, console=console,
                           groups=("ours", "river"), null_seeds=(100,), null_steps=5000) == 0
    out = json.loads((tmp_path / "drift.json").read_text())
    assert (tmp_path / "drift.png").stat().st_size > 10_000
    assert set(out["streams"]) == {"abrupt_drop", "batch_shift"}
    for dets in out["streams"].values():
        assert {"specctl_monitor", "pooled_mean", "adwin", "page_hinkley"} <= set(dets)
        for metrics in dets.values():
            assert set(JSON_KEYS) <= set(metrics)
    assert out["streams"]["batch_shift"]["specctl_monitor"]["retrain_alerts"] == 0
    assert "goals" in out
    nulls = out["null_false_alarms"]  # false alarms counted on the long no-change streams
    assert set(nulls) == {"specctl_monitor", "pooled_mean", "adwin", "page_hinkley"}
    assert all(m["steps"] == 5000 and m["alarms"] >= 0 for m in nulls.values())
    assert "null_long: false alarms <= ADWIN's (measured)" in out["goals"]
