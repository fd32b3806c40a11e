"""Closing the loop: drift alert → retraining → roll-out → the controller learns.

One process holds a controller (real gRPC on a free loopback port, drift
monitor on, alert store in ``work_dir``), a reference worker (real model,
Medusa or EAGLE heads that poll their directory for new versions) and a
WatchAlerts client. The steps:

1. heads are trained on the first prompt mix only (``chat``);
2. traffic of that mix: the monitor learns the heads' baseline;
3. traffic moves to the new mix (``code``): acceptance falls, the monitor
   opens a ``RETRAIN_HEADS`` alert;
4. the controller's command sink runs ``specctl train-heads`` on the new
   mix into the worker's heads directory (a real subprocess, as a
   retraining pipeline would);
5. the worker sees the new version between two steps and rolls to it on its
   live stream; the old version's alert resolves ("superseded");
6. the controller learns the new version's acceptance on the new mix.

Traffic carries no domain tag: a worker that tags domains gets a stratum
per domain, and a new domain then starts its own baseline instead of
raising an alert.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

__all__ = ["LoopConfig", "LoopTimeout", "run_retrain_loop"]


class LoopTimeout(RuntimeError):
    """A step of the loop did not happen in time; the message names it."""


@dataclass
class LoopConfig:
    """Sizes of the loop; the defaults are for a demo on a CPU (a few minutes)."""

    work_dir: str
    model: str = "smollm2-135m"
    drafter: str = "medusa"
    first_mix: str = "chat"
    new_mix: str = "code"
    prompts: int = 24  # per mix, for training and for traffic
    max_new_tokens: int = 32
    epochs: int = 4
    concurrency: int = 4
    threads: int = 1
    step_timeout_s: float = 600.0
    monitor: dict = field(default_factory=lambda: {
        # Small strata for a CPU worker's few request-steps per second; the
        # false-alarm budget (ert) stays far above the run's length.
        "baseline_steps": 150, "baseline_max": 600, "window": 60, "round_steps": 60, "ert": 2e5,
        "n_bootstrap": 512, "cusum_paths": 64, "cusum_horizon": 600, "resolve_windows": 2, "drops": (0.5, 0.2),
    })


def _train_argv(cfg: LoopConfig, mix: str, out: Path) -> list[str]:
    return [sys.executable, "-m", "specctl.cli", "train-heads", "--drafter", cfg.drafter, "--model", cfg.model,
            "--prompts", mix, "--limit", str(cfg.prompts), "--max-new-tokens", str(cfg.max_new_tokens),
            "--epochs", str(cfg.epochs), "--threads", str(cfg.threads), "--out", str(out)]


class _AlertLog:
    """A WatchAlerts client on its own thread: every event, in order."""

    def __init__(self, address: str) -> None:
        import grpc

        from protos.speculation.v1 import controller_pb2, controller_pb2_grpc

        self.events: list = []
        self._cond = threading.Condition()
        self._channel = grpc.insecure_channel(address)
        stub = controller_pb2_grpc.SpeculationControllerStub(self._channel)
        self._call = stub.WatchAlerts(controller_pb2.WatchAlertsRequest())
        threading.Thread(target=self._read, daemon=True, name="alert-watch").start()

    def _read(self) -> None:
        import grpc

        try:
            for alert in self._call:
                with self._cond:
                    self.events.append(alert)
                    self._cond.notify_all()
        except grpc.RpcError:
            pass  # cancelled at close

    def wait(self, match: Callable, timeout: float, what: str, progress: Callable[[], None] | None = None,
             every_s: float = 15.0):
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for alert in self.events:
                    if match(alert):
                        return alert
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LoopTimeout(f"{what}: not seen in {timeout:.0f} s")
                if not self._cond.wait(min(left, every_s)) and progress is not None:
                    progress()

    def close(self) -> None:
        self._call.cancel()
        self._channel.close()


class _Traffic:
    """Closed-loop clients on the worker's HTTP endpoint (``worker.reference.load.run_phase``);
    the mix changes by swapping the contents of the prompt pool they draw from."""

    def __init__(self, address: str, concurrency: int, max_new_tokens: int) -> None:
        from worker.reference.load import LoadStats, run_phase

        self.pool: list = []
        self.stats = LoadStats()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=run_phase, daemon=True, name="retrain-loop-load",
            args=(address, self.pool, concurrency, float("inf"), 0.0, max_new_tokens, self.stats, random.Random(0),
                  self._stop))

    def start(self, prompts: list) -> "_Traffic":
        self.pool[:] = prompts
        self._thread.start()
        return self

    def switch(self, prompts: list) -> None:
        self.pool[:] = prompts

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)


def _expected_chain(controller, worker_id: str, version: str) -> tuple[float, float]:
    """(E[accepted] of a chain at max depth, effective samples) of a version, short-context bucket."""
    [status] = controller.status(worker_id).workers
    for s in status.acceptance:
        if s.drafter_version == version and s.context_len_min == 0:
            return s.expected_accepted_chain, float(s.effective_samples[0]) if s.effective_samples else 0.0
    return 0.0, 0.0


def run_retrain_loop(cfg: LoopConfig, say: Callable[[str], None] = print) -> dict:
    """Run the six steps; return a report (timeline, versions, acceptance per phase)."""
    from controller.background import BackgroundController
    from controller.config import ServerConfig
    from protos.speculation.v1 import controller_pb2
    from worker.reference.threads import set_threads
    from worker.reference.prompts import load_prompts
    from worker.reference.server import WorkerOptions, load_worker

    set_threads(cfg.threads)
    work = Path(cfg.work_dir)
    heads_dir = work / "heads"
    t0 = time.time()
    timeline: list[dict] = []
    worker = None
    seen = [0, 0]  # engine row-steps and accepted tokens at the last event

    def mark(event: str, **details) -> None:
        if worker is not None:  # measured τ (accepted draft tokens per request-step) since the last event
            stats = worker.engine.stats
            rows, accepted = stats.row_steps - seen[0], stats.accepted - seen[1]
            seen[:] = [stats.row_steps, stats.accepted]
            details["measured_tau_since_last_event"] = round(accepted / rows, 3) if rows else None
        timeline.append({"t_s": round(time.time() - t0, 1), "event": event, **details})
        say(f"[{time.time() - t0:6.1f} s] {event}" + (f"  {details}" if details else ""))

    first = _first_heads(cfg, heads_dir, say)
    mark("heads trained", version=first.version, mix=cfg.first_mix)

    config = ServerConfig.model_validate({
        "listen": "127.0.0.1:0",
        "policy": "static",  # the monitor is policy-independent; a fixed depth keeps its evidence flowing
        "store": {"path": str(work / "controller.sqlite3")},
        "drift": {"monitor": cfg.monitor},
        "alerts": {"command": {"argv": _train_argv(cfg, cfg.new_mix, heads_dir), "timeout_s": cfg.step_timeout_s,
                               "events": ["opened"], "actions": ["RETRAIN_HEADS"]}},
    })
    controller = BackgroundController(config)
    alerts = _AlertLog(controller.address)
    opts = WorkerOptions(model=cfg.model, drafter=cfg.drafter, heads=str(heads_dir), controller=controller.address,
                         listen="127.0.0.1:0", worker_id=f"loop-{cfg.drafter}", max_batch=cfg.concurrency,
                         fallback_depth=3, max_depth=3, max_width=1, max_tree_nodes=3, heads_poll_s=1.0)
    worker = load_worker(opts, log_fn=lambda *_: None).start()
    ctl = controller.running.controller
    untagged = {mix: [replace(p, domain="") for p in load_prompts(mix)[: cfg.prompts]]
                for mix in (cfg.first_mix, cfg.new_mix)}
    traffic = _Traffic(worker.address, cfg.concurrency, cfg.max_new_tokens)
    report: dict = {"config": {k: v for k, v in vars(cfg).items() if k != "monitor"}, "monitor": cfg.monitor}
    try:
        say(f"2. {cfg.first_mix} traffic: the monitor learns the baseline of {first.version}")
        traffic.start(untagged[cfg.first_mix])
        _wait(lambda: _baseline_ready(controller, first.version), cfg.step_timeout_s, "baseline of the first heads")
        tau_first, _ = _expected_chain(ctl, worker.worker_id, first.version)
        mark("baseline learned", version=first.version, expected_accepted_chain=round(tau_first, 3))

        say(f"3. traffic moves to {cfg.new_mix}")
        traffic.switch(untagged[cfg.new_mix])
        opened = alerts.wait(lambda a: a.event == controller_pb2.ALERT_EVENT_OPENED
                             and a.drafter_version == first.version
                             and a.action == controller_pb2.ALERT_ACTION_RETRAIN_HEADS,
                             cfg.step_timeout_s, "RETRAIN_HEADS alert",
                             progress=lambda: say("   monitor: " + _monitor_line(controller, first.version)))
        mark("alert opened", id=opened.id, stratum=opened.stratum, detector=opened.detector,
             expected_tau_change=round(opened.expected_tau_change, 3))

        say(f"4. the command sink runs `specctl train-heads --prompts {cfg.new_mix}`; 5. the worker rolls")
        _wait(lambda: bool(worker.rollouts), cfg.step_timeout_s, "roll-out of retrained heads")
        _, old_version, new_version = worker.rollouts[0]
        mark("worker rolled", old=old_version, new=new_version)
        resolved = alerts.wait(lambda a: a.event == controller_pb2.ALERT_EVENT_RESOLVED and a.id == opened.id,
                               cfg.step_timeout_s, "resolution of the alert")
        mark("alert resolved", id=resolved.id, resolution=resolved.resolution)

        say(f"6. the controller learns {new_version} on {cfg.new_mix}")
        _wait(lambda: _expected_chain(ctl, worker.worker_id, new_version)[1] >= 50, cfg.step_timeout_s,
              "acceptance evidence for the new heads")
        tau_new, samples = _expected_chain(ctl, worker.worker_id, new_version)
        mark("new version learned", version=new_version, expected_accepted_chain=round(tau_new, 3),
             effective_samples=round(samples, 1))
        report.update(first_version=first.version, new_version=new_version, alert=_alert_summary(opened),
                      resolution=resolved.resolution, expected_accepted_chain={
                          "first_heads_at_baseline": tau_first, "new_heads_on_new_mix": tau_new},
                      new_version_in_hello=ctl.workers[worker.worker_id].hello.drafter.version)
        return report
    finally:
        report["timeline"] = timeline
        report["requests"] = traffic.stats.summary()
        traffic.stop()
        alerts.close()
        worker.stop()
        controller.close()


def _first_heads(cfg: LoopConfig, heads_dir: Path, say: Callable[[str], None]):
    """Heads trained on the first mix only (reused when ``heads_dir`` already holds such heads)."""
    from worker.reference.heads import TrainConfig, train_heads
    from worker.reference.heads.store import HeadsBundle

    if HeadsBundle.exists(heads_dir, cfg.drafter):
        bundle = HeadsBundle.load(heads_dir, cfg.drafter)
        if bundle.meta.get("prompts") == cfg.first_mix and bundle.meta.get("limit") == cfg.prompts:
            say(f"1. reusing {cfg.drafter} heads {bundle.version} trained on {cfg.first_mix} in {heads_dir}")
            return bundle
    say(f"1. training {cfg.drafter} heads on {cfg.prompts} {cfg.first_mix} prompts")
    bundle = train_heads(cfg.drafter, cfg.model, cfg.first_mix, heads_dir,
                         config=TrainConfig(kind=cfg.drafter, epochs=cfg.epochs), max_new_tokens=cfg.max_new_tokens,
                         limit=cfg.prompts, log=lambda *_: None)
    bundle.meta["limit"] = cfg.prompts
    bundle.save(heads_dir)
    return bundle


def _monitor_line(controller, version: str) -> str:
    snap = controller.call(_snapshot(controller.running.alerting))
    for v in snap["versions"]:
        if v["drafter_version"] == version:
            strata = ", ".join(f"{s['stratum']}: {s['steps']} steps, p={s['last_p_value']}" for s in v["strata"])
            stats = [None if x is None else round(x, 2) for x in v["cusum_statistics"]]
            limits = [None if x is None else round(x, 2) for x in v["cusum_thresholds"]]
            return f"{v['steps']} request-steps; CUSUM {stats} / thresholds {limits}; {strata}"
    return "no telemetry for this version yet"


def _baseline_ready(controller, version: str) -> bool:
    """A stratum has its baseline and it is precise enough for a calibrated CUSUM."""
    snap = controller.call(_snapshot(controller.running.alerting))
    return any(any(s["baseline_ready"] for s in v["strata"]) and any(h is not None for h in v["cusum_thresholds"])
               for v in snap["versions"] if v["drafter_version"] == version)


async def _snapshot(alerting) -> dict:
    return alerting.monitor.snapshot()  # on the controller's loop: the monitor is not thread-safe


def _alert_summary(alert) -> dict:
    return {"id": alert.id, "stratum": alert.stratum, "detector": alert.detector, "score": alert.score,
            "baseline_hist": list(alert.baseline_hist), "current_hist": list(alert.current_hist),
            "expected_tau_change": alert.expected_tau_change}


def _wait(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise LoopTimeout(f"{what}: not reached in {timeout:.0f} s")
        time.sleep(interval)
