"""One drift monitor per drafter version fleet-wide vs one per replica: detection delay, and what it costs Redis.

``python -m bench.fleet_drift --out DIR`` writes ``DIR/fleet_drift.json``:

* ``detection`` — the same seeded request-steps (a drafter version's
  traffic over two context buckets, acceptance dropping by ``drop`` at step
  ``warmup``) fed round-robin to R per-replica monitors (today's
  ``drift_monitor: replica``) and, in the same run, whole to one monitor (the
  fleet's, ``drift_monitor: fleet``); per seed, the fleet-wide request-steps
  from the drop to the first alarm (any replica's, for per-replica). Both
  with the same ``ert``: the per-replica fleet also raises false alarms R
  times as often.
* ``redis`` — two in-process replicas (real ``DriftAlerting`` and
  ``FleetDriftMonitor``, each on its own ``FleetStore``) against a real
  ``redis-server`` for ``seconds`` of simulated traffic (``workers`` per
  replica × ``steps_per_s`` × ``requests`` request-steps, every one sampled),
  the replicas' rounds every 0.5 s of real time: Redis commands per second per replica
  (``INFO commandstats``, inside scripts too), bytes per outcome on the wire
  (the encoded entries), the stream's memory, outcomes fed to the owner's
  monitor against outcomes sampled.

``specctl bench fleet --drift-monitor both`` (:func:`run_drift_modes`) runs
the fleet benchmark's Redis phase (``bench/fleet.py``: real ``specctl serve``
replicas and agents) once per ``state.drift_monitor`` mode, the same load and
seed, without the ``kill -9``, and writes ``DIR/fleet_drift_modes.json``: one
block per mode (:func:`mode_block`) and ``fleet_over_replica`` ratios, plus
``fleet_drift_modes.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from bench.fleet import ALPHA, DRIFT_ALPHA, BenchError, RedisServer, free_port, run_phase
from controller.alerts.alerting import DriftAlerting
from controller.alerts.store import StateStore
from controller.drift.monitor import AcceptanceDriftMonitor, MonitorConfig
from controller.fleet.drift_owner import FleetDriftMonitor, Phase
from controller.fleet.store import FleetStore
from controller.protocol import RequestRow

MONITOR = dict(baseline_steps=500, window=300, round_steps=500, ert=2_000_000, n_bootstrap=512, cusum_paths=128,
               cusum_horizon=2048)
LIMITS = SimpleNamespace(kind="eagle", version="bench", max_depth=6, max_width=1, max_tree_nodes=6,
                         trained_context_len=8192)


def _delay(monitors: list[AcceptanceDriftMonitor], rng: np.random.Generator, warmup: int, horizon: int,
           alpha: float, drop: float) -> int | None:
    for t in range(warmup + horizon):
        a = alpha * (1 - drop) if t >= warmup else alpha
        tau = min(int(rng.geometric(1 - a)) - 1, 6)
        mon = monitors[t % len(monitors)]
        mon.observe_request(LIMITS, int(rng.choice((500, 3000))), tau, 6, now=float(t), worker_id=f"w{t % 16}")
        if mon.open_alerts():
            return t - warmup if t >= warmup else -1  # -1: a false alarm before the drop
    return None


def detection(seeds: int = 12, drops: tuple[float, ...] = (0.05, 0.1), replicas: int = 2, warmup: int = 3000,
              horizon: int = 20_000, alpha: float = 0.8) -> dict[str, Any]:
    """Per drop: each seed's delay (fleet-wide request-steps) for one monitor and for ``replicas`` monitors."""
    out: dict[str, Any] = {"replicas": replicas, "warmup": warmup, "horizon": horizon, "alpha": alpha,
                           "monitor": MONITOR, "drops": {}}
    for drop in drops:
        fleet, per_replica = [], []
        for seed in range(seeds):
            fleet.append(_delay([AcceptanceDriftMonitor(MonitorConfig(**MONITOR))], np.random.default_rng(seed),
                                warmup, horizon, alpha, drop))
            per_replica.append(_delay([AcceptanceDriftMonitor(MonitorConfig(**MONITOR)) for _ in range(replicas)],
                                      np.random.default_rng(seed), warmup, horizon, alpha, drop))

        def summary(delays: list[int | None]) -> dict[str, Any]:
            seen = [d for d in delays if d is not None and d >= 0]
            return {"delays": delays, "median": statistics.median(seen) if seen else None,
                    "mean": statistics.fmean(seen) if seen else None, "missed": sum(d is None for d in delays),
                    "false_alarms": sum(d == -1 for d in delays)}

        f, p = summary(fleet), summary(per_replica)
        ratios = [b / a for a, b in zip(fleet, per_replica) if a and b and a > 0 and b > 0]
        out["drops"][str(drop)] = {"fleet": f, "per_replica": p,
                                   "per_replica_over_fleet_median": statistics.median(ratios) if ratios else None}
    return out


class _Replica:
    def __init__(self, url: str, name: str) -> None:
        self.store = FleetStore(url, fleet="bench-drift", replica_id=name)
        self.alerting = DriftAlerting(AcceptanceDriftMonitor(MonitorConfig(**MONITOR)), StateStore(""), [],
                                      cpu_fraction=1.0, max_buffered=1_000_000)
        self.drift = FleetDriftMonitor(self.store, self.alerting, None, lease_ttl_s=10.0)
        self.drift.attach()
        self.rng = np.random.default_rng(len(name))
        self.sampled = 0
        self.step = 0

    def traffic(self, workers: int, steps: int, requests: int, now: float) -> None:
        for w in range(workers):
            state = SimpleNamespace(limits=LIMITS, worker_id=f"{self.store.replica_id}-w{w}")
            for _ in range(steps):
                self.step += 1
                ctx = int(self.rng.choice((500, 3000)))
                accepted = np.minimum(self.rng.geometric(0.2, size=requests) - 1, 6)
                rows = [RequestRow(f"{w}-{self.step}-{i}", ctx + i, 6, 1, 6, int(a), None, None, 6, 1, 6, 0)
                        for i, a in enumerate(accepted)]
                self.alerting.feed.on_rows(state, SimpleNamespace(timestamp=now, requests=[
                    SimpleNamespace(domain="")] * requests), rows)
                self.sampled += requests

    def seen(self) -> int:
        v = self.alerting.monitor._versions.get(("eagle", "bench"))
        return v.steps if v is not None else 0


def _codec_cost(n: int = 4000) -> dict[str, float]:
    """Encoding and decoding, µs per outcome, on an entry of ``n`` chain outcomes."""
    from controller.fleet.drift_stream import EvidenceGroup, Outcome, StreamLimits, decode_groups, encode_groups
    lim = StreamLimits("eagle", "bench", 6, 1, 8192)
    rng = np.random.default_rng(0)
    groups = [EvidenceGroup(f"w{k % 16}", 1000.0 + k, lim, tuple(Outcome(int(rng.integers(0, 4096)),
                                                                         int(rng.integers(0, 7)), 6, (), (), "")
                                                                 for _ in range(8))) for k in range(n // 8)]
    t0 = time.perf_counter()
    data = encode_groups(groups)
    t1 = time.perf_counter()
    decode_groups(data)
    t2 = time.perf_counter()
    return {"encode": 1e6 * (t1 - t0) / n, "decode": 1e6 * (t2 - t1) / n}


def _commands(client) -> int:
    return sum(int(v["calls"]) for k, v in client.info("commandstats").items() if k != "cmdstat_info")


async def redis_cost(url: str, client, *, workers: int = 16, steps_per_s: int = 50, requests: int = 8,
                     seconds: int = 20) -> dict[str, Any]:
    """Two replicas' drift evidence through Redis; see the module docstring."""
    nodes = [_Replica(url, "a"), _Replica(url, "b")]
    try:
        client.config_resetstat()
        start = _commands(client)
        t = time.time()
        cpu0 = time.process_time()
        for k in range(2 * seconds):  # rounds every 0.5 s, in real time (leases and checkpoints keep time)
            for n in nodes:
                n.traffic(workers, steps_per_s // 2, requests, t + k / 2)
            for n in nodes:
                await n.drift.run_round()
                n.alerting.feed.drain(10.0)
            await asyncio.sleep(max(0.0, t + (k + 1) / 2 - time.time()))
        deadline = time.monotonic() + 60
        while sum(n.seen() for n in nodes) < sum(n.sampled for n in nodes) and time.monotonic() < deadline:
            for n in nodes:
                await n.drift.run_round()
                n.alerting.feed.drain(10.0)
            await asyncio.sleep(0.05)
        cpu = time.process_time() - cpu0
        commands = _commands(client) - start
        breakdown = {k[len("cmdstat_"):]: int(v["calls"]) for k, v in client.info("commandstats").items()
                     if k != "cmdstat_info"}
        stats = {n.store.replica_id: n.drift.outbox.stats()["counts"] for n in nodes}
        sent = sum(s.get("sent", 0) for s in stats.values())
        sent_bytes = sum(s.get("bytes_sent", 0) for s in stats.values())
        owner = next(n for n in nodes if n.drift.watches[("eagle", "bench")].phase is Phase.OWNED)
        await owner.drift._checkpoints(force=True)  # the baselines as they are now, for its size
        key = owner.drift.outbox.stream_key(("eagle", "bench"))
        return {
            "replicas": 2, "workers_per_replica": workers, "steps_per_s": steps_per_s, "requests_per_step": requests,
            "seconds": seconds, "outcomes_per_s_per_replica": workers * steps_per_s * requests,
            "redis_commands_per_s_per_replica": commands / seconds / 2, "redis_commands": breakdown,
            "bytes_per_outcome": sent_bytes / sent if sent else None,
            "stream_entries": client.xlen(key), "stream_memory_bytes": client.memory_usage(key),
            "checkpoint_bytes": len(client.get(owner.drift.checkpoint_key(("eagle", "bench"))) or b""),
            "outcomes_sampled": sum(n.sampled for n in nodes), "outcomes_fed_to_owner": owner.seen(),
            # Both replicas' every part in this process: sampling, encoding, sending, reading, decoding, monitor.
            "process_cpu_us_per_outcome": 1e6 * cpu / sum(n.sampled for n in nodes),
            "codec_us_per_outcome": _codec_cost(),
            "owner": owner.store.replica_id,
        }
    finally:
        for n in nodes:
            n.store.close()
            n.alerting.store.close()


MODES = ("replica", "fleet")
# Block keys whose fleet / replica ratio is reported (lower is better for every one).
RATIO_KEYS = ("detection_s", "detection_evidence_s", "cpu_per_1k_steps_ms", "cpu_per_1k_steps_marginal_ms",
              "redis_server_cpu_per_1k_steps_ms", "redis_ops_per_s")


def mode_block(phase: dict[str, Any]) -> dict[str, Any]:
    """One drift monitor mode's Redis phase (``bench.fleet.run_phase``) in the side-by-side's keys.

    ``evidence_shed_by_owner``: request-steps the feed of the replica running the fleet monitor dropped
    (shed beyond ``inbound_limit``, or a full buffer); None with per-replica monitors, which have no owner
    (their own drops are in ``evidence_dropped``, summed over replicas).

    >>> phase = {"cpu_per_1k_steps_ms": 200.0, "cpu_per_1k_steps_marginal_ms": 150.0,
    ...          "redis_server_cpu_per_1k_steps_ms": 20.0, "redis_ops_per_s": 90.0,
    ...          "alerts": {"open_max_per_stratum": 1},
    ...          "drift": {"alert_opened": True, "detection_s": 2.5, "detection_after_fleet_drop_s": -9.5,
    ...                    "detection_evidence_s": 1.5,
    ...                    "false_alerts_before_drift": 0, "alerts_other_strata_after_drift": 0,
    ...                    "fleet_drop_after_s": 12.0, "alerts": [], "feeds": {
    ...                        "a": {"monitor_request_steps": 900.0, "dropped_request_steps": 40.0,
    ...                              "evidence_sent": 1000.0, "evidence_dropped_outbox": 0.0, "owns": ["eagle/v1"]},
    ...                        "b": {"monitor_request_steps": 0.0, "dropped_request_steps": 0.0,
    ...                              "evidence_sent": 800.0, "evidence_dropped_outbox": 0.0, "owns": []}}}}
    >>> b = mode_block(phase)
    >>> b["owner"], b["evidence_shed_by_owner"], b["evidence_dropped"], b["monitor_request_steps"]
    ('a', 40, 40, 900)
    """
    drift, feeds = phase["drift"], phase["drift"]["feeds"]
    owners = [a for a, f in feeds.items() if f.get("owns")]
    return {
        "alert_opened": drift["alert_opened"],
        "detection_s": drift["detection_s"],
        "detection_after_fleet_drop_s": drift["detection_after_fleet_drop_s"],
        "detection_evidence_s": drift["detection_evidence_s"],
        "fleet_drop_after_s": drift["fleet_drop_after_s"],
        "open_alerts_max_per_stratum": phase["alerts"]["open_max_per_stratum"],
        "false_alerts_before_drift": drift["false_alerts_before_drift"],
        "alerts_other_strata_after_drift": drift["alerts_other_strata_after_drift"],
        "redis_server_cpu_per_1k_steps_ms": phase.get("redis_server_cpu_per_1k_steps_ms"),
        "redis_ops_per_s": phase.get("redis_ops_per_s"),
        "cpu_per_1k_steps_ms": phase["cpu_per_1k_steps_ms"],
        "cpu_per_1k_steps_marginal_ms": phase["cpu_per_1k_steps_marginal_ms"],
        "owner": owners[0] if len(owners) == 1 else (owners or None),
        "evidence_shed_by_owner": (int(sum(feeds[a].get("dropped_request_steps", 0) for a in owners))
                                   if owners else None),
        "evidence_dropped": int(sum(f.get("dropped_request_steps", 0) for f in feeds.values())),
        "evidence_dropped_outbox": int(sum(f.get("evidence_dropped_outbox", 0) for f in feeds.values())),
        "monitor_request_steps": int(sum(f.get("monitor_request_steps", 0) for f in feeds.values())),
        "feeds_read": sum("error" not in f for f in feeds.values()),
        "workers_per_replica": [r["workers"] for r in phase.get("replicas", ())],
    }


def mode_ratios(blocks: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """``fleet`` over ``replica`` for :data:`RATIO_KEYS` (None where either is missing or the divisor is 0).

    >>> mode_ratios({"replica": {"detection_s": 4.0, "redis_ops_per_s": 100.0},
    ...              "fleet": {"detection_s": 2.0, "redis_ops_per_s": 150.0}})["detection_s"]
    0.5
    """
    out: dict[str, float | None] = {}
    for key in RATIO_KEYS:
        fleet, replica = blocks["fleet"].get(key), blocks["replica"].get(key)
        out[key] = fleet / replica if fleet is not None and replica else None
    return out


def run_drift_modes(out_dir: str | Path, *, replicas: int = 2, workers: int = 32, steps_per_s: float = 50.0,
                    requests: int = 8, measure_s: float = 20.0, warmup_s: float = 8.0, converge_s: float = 12.0,
                    alert_s: float = 12.0, idle_s: float = 5.0, seed: int = 0, drift_alpha: float = DRIFT_ALPHA,
                    plots: bool = True, progress=print) -> int:
    """The fleet benchmark's Redis phase per drift monitor mode, in turn (same load, same ``seed``); writes
    ``fleet_drift_modes.json`` (+ PNG); returns a process exit code. ``drift_alpha``: the drifted bucket's
    acceptance after the drop (from ``bench.fleet.ALPHA``); the default drop is large enough that both modes
    alarm within about a second, a smaller one separates them (see :func:`detection`)."""
    if replicas < 2:
        raise BenchError(f"replicas must be at least 2 (a drift seen by one replica's workers), got {replicas}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    phases: dict[str, dict[str, Any]] = {}
    # The same replica addresses in both runs: the agents' rendezvous then puts the same workers on the same
    # replicas, so the drop that starts on replica 0's workers starts on the same workers in both modes.
    ports = [free_port() for _ in range(replicas)]
    with tempfile.TemporaryDirectory(prefix="specctl-fleet-modes-") as tmp:
        for mode in MODES:
            phases[mode] = asyncio.run(run_phase(
                "redis", Path(tmp) / mode, replicas, workers, steps_per_s, requests, warmup_s, measure_s, converge_s,
                alert_s, idle_s=idle_s, progress=lambda line, m=mode: progress(f"[{m}] {line}"), drift_monitor=mode,
                seed=seed, failover=False, drift_alpha=drift_alpha, ports=ports))
    blocks = {mode: mode_block(phases[mode]) for mode in MODES}
    report = {"replicas": replicas, "workers": workers, "steps_per_s": steps_per_s, "requests_per_step": requests,
              "measure_s": measure_s, "converge_s": converge_s, "alert_s": alert_s, "seed": seed,
              "alpha": ALPHA, "drift_alpha": drift_alpha,
              "modes": blocks, "fleet_over_replica": mode_ratios(blocks), "phases": phases}
    (out / "fleet_drift_modes.json").write_text(json.dumps(report, indent=1, default=str))
    if plots:
        plot_modes(report, out / "fleet_drift_modes.png")
    print(json.dumps({"modes": blocks, "fleet_over_replica": report["fleet_over_replica"]}, indent=1))
    return 0


def plot_modes(report: dict[str, Any], path: Path) -> None:
    """Both modes side by side: CPU per 1k steps (controller, redis-server), Redis ops/s, the drifted stratum's
    first alert against the drift's start, evidence the monitors saw and dropped."""
    from bench.plots import grouped_bars, plt

    blocks = report["modes"]
    modes = list(blocks)
    colors = {"replica": "#7f7f7f", "fleet": "#d62728"}
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    grouped_bars(axes[0][0], ["controller", "redis-server"],
                 {m: [blocks[m]["cpu_per_1k_steps_ms"], blocks[m]["redis_server_cpu_per_1k_steps_ms"]] for m in modes},
                 colors)
    axes[0][0].set_ylabel("CPU ms per 1,000 steps ingested")
    axes[0][0].set_title(f"CPU ({report['replicas']} replicas, {report['workers']} workers)", fontsize=10)
    grouped_bars(axes[0][1], ["Redis commands / s"], {m: [blocks[m]["redis_ops_per_s"]] for m in modes}, colors)
    axes[0][1].set_title("Redis load", fontsize=10)

    ax = axes[1][0]
    for i, m in enumerate(modes):
        b = blocks[m]
        opened = [a["opened_s"] for a in report["phases"][m]["drift"]["alerts"]]
        ax.scatter(opened, [i] * len(opened), marker="|", s=200, color=colors.get(m, "#1f77b4"))
        if b["detection_evidence_s"] is not None:
            ax.scatter([b["detection_evidence_s"]], [i], marker="o", s=60, facecolors="none",
                       edgecolors=colors.get(m, "#1f77b4"), zorder=5)
        if b["detection_s"] is not None:
            ax.scatter([b["detection_s"]], [i], marker="*", s=160, color=colors.get(m, "#1f77b4"), zorder=5)
            ax.annotate(f"{b['detection_s']:.1f} s", (b["detection_s"], i), textcoords="offset points",
                        xytext=(6, 6), fontsize=8)
        ax.text(0.01, i + 0.25, f"false before drift: {b['false_alerts_before_drift']}, open max/stratum: "
                f"{b['open_alerts_max_per_stratum']}", transform=ax.get_yaxis_transform(), fontsize=7)
    ax.axvline(0.0, color="black", ls=":", lw=1)
    fleet_drop = next(iter(blocks.values()))["fleet_drop_after_s"]
    ax.axvline(fleet_drop, color="black", ls="--", lw=1)
    ax.set_yticks(range(len(modes)), modes)
    ax.set_ylim(-0.6, len(modes) - 0.2)
    ax.set_xlabel("s after the drop on replica 0's workers (dashed: on every worker)")
    ax.set_title("Alerts (| opened_at; drifted stratum: o its evidence, * seen on WatchAlerts)", fontsize=10)

    grouped_bars(axes[1][1], ["seen by the monitor(s)", "dropped / shed"],
                 {m: [blocks[m]["monitor_request_steps"], blocks[m]["evidence_dropped"]] for m in modes}, colors,
                 fmt="{:.0f}")
    axes[1][1].set_ylabel("request-steps (whole run)")
    axes[1][1].set_title("Drift evidence", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--seeds", type=int, default=12)
    parser.add_argument("--seconds", type=int, default=20)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"detection": detection(seeds=args.seeds)}
    server = RedisServer(Path(tempfile.mkdtemp(prefix="specctl-fleet-drift-"))).start()
    try:
        report["redis"] = asyncio.run(redis_cost(server.url, server.client(), seconds=args.seconds))
    finally:
        server.stop()
    (out / "fleet_drift.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report["redis"].items()}, indent=2))
    for drop, d in report["detection"]["drops"].items():
        print(f"drop {drop}: fleet median {d['fleet']['median']} (missed {d['fleet']['missed']}), per-replica "
              f"median {d['per_replica']['median']} (missed {d['per_replica']['missed']}), "
              f"per-seed ratio median {d['per_replica_over_fleet_median']}")


if __name__ == "__main__":
    main()
