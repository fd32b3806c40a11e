"""The status page in a real browser: a controller with a synthetic worker
that rolls out a new drafter version and drifts, headless Chromium loading
the page over HTTP, and the screenshot checked for the plotted series."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from matplotlib import image

from controller.config import ServerConfig
from controller.core import Controller
from controller.observe.history import SERIES, StatusHistory
from controller.server import start_server
from controller.observe.web import (DEPTH_COLORS, POSITION_COLORS, ROLLOUT_COLOR, SEVERITY_COLORS, SPEEDUP_COLOR,
                            TAU_COLORS, render_page)
from policies.presets import load_preset
from policies.table import Decision
from tests.support import SyntheticWorker, feed, http_get, make_hello, wait_for
from tests.test_metrics import observed_config
from worker.sdk.agent import SpeculationAgent

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--window-size=1280,1600"]
LOADS = [(1, 500), (4, 500), (2, 3000)]


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("chromium is not installed: `make test` installs Debian's chromium "
                    "(apt-get install --no-install-recommends chromium); install it and rerun")
    return path


async def run_chromium(*args: str, profile: Path) -> bytes:
    """Run Chromium without blocking the loop the controller serves on."""
    proc = await asyncio.create_subprocess_exec(chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()[-2000:]
    return out


def pixels_of(img: np.ndarray, color: str, tol: int = 6) -> np.ndarray:
    """(row, col) of the pixels within ``tol`` of ``color`` on every channel."""
    rgb = np.array([int(color[i:i + 2], 16) for i in (1, 3, 5)])
    return np.argwhere(np.all(np.abs(img[:, :, :3].astype(int) - rgb) <= tol, axis=2))


async def grow_history(server) -> tuple[SpeculationAgent, SyntheticWorker]:
    """Worker w0 runs drafter heads-a, then rolls out heads-b, whose acceptance
    drops until the drift monitor opens an alert; returns the heads-b agent
    (still connected) and its worker."""
    history = server.status_site.history
    monitor = server.alerting.monitor
    truth = {"heads-a": 0.8, "heads-b": 0.8}

    async def serve(agent, worker, samples: int) -> None:
        start = history.samples
        while history.samples < start + samples:
            await feed(agent, worker, LOADS, rounds=2)

    agent = None
    for version in ("heads-a", "heads-b"):
        if agent is not None:
            agent.stop()
        agent = SpeculationAgent(make_hello("w0", max_depth=5, version=version), server.address).start()
        worker = SyntheticWorker(lambda ctx, v=version: truth[v] * (1.0 if ctx < 2048 else 0.7), seed=7)
        await feed(agent, worker, LOADS, rounds=20, decide=lambda rid, ctx, b: Decision.chain(4))
        await wait_for(lambda: agent.plan_version >= 1)
        await serve(agent, worker, 25)
    truth["heads-b"] = 0.45  # the content moved under heads-b
    deadline = time.monotonic() + 60
    while not monitor.open_alerts():
        assert time.monotonic() < deadline, "the drift monitor never saw the acceptance drop"
        await serve(agent, worker, 1)
    await serve(agent, worker, 15)
    return agent, worker


async def keep_serving(agent: SpeculationAgent, worker: SyntheticWorker) -> None:
    """Traffic goes on while the browser looks (until cancelled)."""
    while True:
        await feed(agent, worker, LOADS, rounds=1, pause_s=0.05)


async def test_status_page_in_headless_chromium(tmp_path: Path) -> None:
    chromium()
    server = await start_server(observed_config())
    agent = traffic = None
    try:
        agent, worker = await grow_history(server)
        traffic = asyncio.create_task(keep_serving(agent, worker))
        base = f"http://127.0.0.1:{server.status_site.http.port}"
        status, content_type, body = await http_get(base + "/status.json")
        assert status == 200 and content_type == "application/json"
        snap = json.loads(body)
        (w0,) = snap["workers"]
        assert w0["worker_id"] == "w0" and w0["drafter_version"] == "heads-b"
        assert [(r["previous_version"], r["drafter_version"]) for r in snap["rollouts"]] == [
            (None, "heads-a"), ("heads-a", "heads-b")]
        h = w0["history"]
        assert len(h["t"]) >= 50 and {"heads-a", "heads-b"} <= set(h["drafter_version"])
        alphas = [a[0] for a, v in zip(h["alpha"], h["drafter_version"]) if a and a[0] is not None]
        assert 0.3 < float(np.mean(alphas)) < 0.95
        assert all(abs(sum(s) - 1.0) < 1e-9 for s in h["tau_share"] if s)
        assert any(s is not None and s > 0 for s in h["speedup"])
        open_alerts = [a for a in snap["alerts"] if a["status"] == "OPEN" and a["drafter_version"] == "heads-b"]
        assert open_alerts

        dom = (await run_chromium("--dump-dom", base + "/", profile=tmp_path / "profile-dom")).decode()
        for text in ("worker w0", "heads-b", "Plan v", "Acceptance per draft position", "Accepted length τ distribution",
                     "Estimated end-to-end speedup", "Head retraining events", "w0 from heads-a",
                     *(a["action"] for a in open_alerts)):
            assert text in dom, text
        assert dom.count("<svg") == 6

        png = tmp_path / "page.png"
        await run_chromium(f"--screenshot={png}", base + "/", profile=tmp_path / "profile-shot")
    finally:
        if traffic is not None:
            traffic.cancel()
        if agent is not None:
            agent.stop()
        await server.stop(0)
    check_screenshot(png, snap)


def check_screenshot(png: Path, snap: dict) -> None:
    img = np.round(image.imread(png) * 255).astype(np.uint8)
    assert img.shape[:2] == (1600, 1280)
    # Not blank: many colours, and much of the page is neither background nor white.
    flat = img[:, :, :3].reshape(-1, 3)
    assert len(np.unique(flat, axis=0)) > 200
    # Every plotted series drawn as a line across its chart, not only as a legend swatch.
    lines = {}
    for name, color in (("α1", POSITION_COLORS[0]), ("α2", POSITION_COLORS[1]), ("speedup", SPEEDUP_COLOR)):
        px = pixels_of(img, color)
        assert len(px) > 300, (name, len(px))
        assert np.ptp(px[:, 1]) > 250, (name, np.ptp(px[:, 1]))  # spans the time axis
        lines[name] = px
    # τ shares: filled areas; the plan heat-map: blocks of the depths the plan uses.
    tau = np.concatenate([pixels_of(img, c) for c in TAU_COLORS[:3]])
    assert len(tau) > 5000
    depths = {d for row in snap["workers"][0]["plan"]["depth"] for d in row}
    heat = np.concatenate([pixels_of(img, DEPTH_COLORS[d], tol=2) for d in depths])
    assert all(len(pixels_of(img, DEPTH_COLORS[d], tol=2)) > 400 for d in depths), depths
    # Roll-out markers and the drift alert (timeline bar and shaded spans).
    assert len(pixels_of(img, ROLLOUT_COLOR)) > 100
    assert sum(len(pixels_of(img, c)) for c in SEVERITY_COLORS.values()) > 300
    # Layout: heat-map, α and τ side by side (left to right), the speedup below them.
    row_of = {name: np.median(px[:, 0]) for name, px in (("heat", heat), ("tau", tau), *lines.items())}
    col_of = {name: np.median(px[:, 1]) for name, px in (("heat", heat), ("tau", tau), *lines.items())}
    assert col_of["heat"] < col_of["α1"] < col_of["tau"]
    assert abs(row_of["α1"] - row_of["tau"]) < 200
    assert row_of["speedup"] > row_of["α1"] + 100


def test_page_escapes_worker_supplied_text() -> None:
    snap = {"now": 1000.0, "policy": "goodput", "policy_reloads": 0, "policy_reload_failures": 0, "samples": 0,
            "rejections": {}, "drift_monitor": False, "alerts": [], "rollouts": [],
            "workers": [{"worker_id": "<script>x</script>", "engine": "e", "model": "m", "accelerator": "a",
                         "drafter_kind": "eagle", "drafter_version": "v&1", "max_depth": 4, "connected": True,
                         "plan_version": 0, "acked_plan_version": 0, "plans_pushed": 0, "acks": 0, "nacks": 0,
                         "steps": 0, "mean_batch_size": 0.0, "mean_context_len": 0.0, "realised_goodput_tok_s": 0.0,
                         "estimated_speedup": None, "detail": True, "plan": None,
                         "history": {k: [] for k in SERIES}}]}
    html = render_page(snap)
    assert "<script>" not in html and "&lt;script&gt;x&lt;/script&gt;" in html and "v&amp;1" in html
    assert html.count("no data yet") == 4 and "no plan yet" in html


def test_history_samples_due_workers_oldest_first_within_budget() -> None:
    clock = [100.0]
    ctl = Controller(ServerConfig(), load_preset("static"), clock=lambda: clock[0])
    history = StatusHistory(ctl, capacity=3)
    for w in ("a", "b", "c"):
        ctl.hello(make_hello(w))
    # No budget: one worker per tick, each once per interval.
    assert [history.sample_due(5.0, budget_s=0.0) for _ in range(4)] == [1, 1, 1, 0]
    clock[0] += 5.0
    ctl.hello(make_hello("d"))
    assert history.sample_due(5.0, budget_s=0.0) == 1 and len(history.workers["d"].t) == 1  # never sampled: first
    assert history.sample_due(5.0, budget_s=1.0) == 3
    for _ in range(3):
        clock[0] += 5.0
        history.sample_due(5.0, budget_s=1.0)
    assert [len(history.workers[w].t) for w in "abcd"] == [3, 3, 3, 3]  # ring buffers
    ctl.hello(make_hello("a", version="v2"))
    assert [(r.worker_id, r.previous_version, r.drafter_version) for r in history.rollouts] == [
        ("a", None, "v1"), ("b", None, "v1"), ("c", None, "v1"), ("d", None, "v1"), ("a", "v1", "v2")]
    assert history.rollouts[-1].t == clock[0]
