"""``specctl demo``: the controller and a simulated GPU fleet over real gRPC.

The controlled fleet runs in real time (scaled so the scenario fits the
requested duration) with a live table per worker. Meanwhile a second
process replays the same scenario — same seeds, so the same arrivals — with
speculation always on at the static preset's depth and always off; the
summary compares goodput (tokens per second of GPU step time) and TPOT.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import multiprocessing
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from controller.config import ServerConfig, StoreSettings
from controller.observe.http import parse_host_port
from controller.server import start_server
from policies.presets import load_preset
from policies.table import Decision
from worker.sdk.agent import AgentOptions, SpeculationAgent
from worker.sim.hello import hello_proto
from worker.sim.runner import run_fleet_simulated, run_realtime
from worker.sim.scenario import load_scenario
from worker.sim.worker import SimWorker, StepResult

REFRESH_S = 0.5
WINDOW_STEPS = 200  # steps behind the live "recent" columns
STATUS_LISTEN = "127.0.0.1:0"  # the status page's HOST:PORT; port 0 picks a free one
STATUS_SAMPLE_S = 1.0  # status page history: a sample a second, so a one-minute demo draws its charts


def static_on_decision() -> Decision:
    """The static preset's decision: what an engine runs with a fixed depth."""
    return Decision.chain(load_preset("static").config.depth)


def run_fixed(scenario_name: str, decision: Decision) -> dict[str, dict]:
    """The whole scenario in simulated time with one fixed decision (subprocess)."""
    scenario = load_scenario(scenario_name)
    fleet = SimWorker.fleet(scenario)
    run_fleet_simulated(fleet, lambda rid, ctx, batch: decision, scenario.duration_s)
    return {w.worker_id: w.stats.summary() for w in fleet}


@dataclass
class LiveView:
    """Recent steps per worker, for the live table."""

    recent: dict[str, deque] = field(default_factory=dict)

    def record(self, worker_id: str, result: StepResult) -> None:
        if result.telemetry is None:
            return
        t = result.telemetry
        accepted = [r.accepted for r in t.requests if r.depth > 0]
        ctx = sum(r.context_len for r in t.requests) / max(1, len(t.requests))
        tokens = sum(r.accepted + 1 for r in t.requests)
        self.recent.setdefault(worker_id, deque(maxlen=WINDOW_STEPS)).append(
            (t.batch_size, ctx, tokens, t.draft_ms + t.verify_ms, sum(accepted), len(accepted)))


class StatusPageError(OSError):
    """The status page cannot listen where ``--status-listen`` asked (the port is taken, say)."""


def status_url(listen: str, port: int) -> str:
    """The browser address of a status site listening on ``listen`` (its real ``port``)."""
    host, _ = parse_host_port(listen, "status_listen")
    host = {None: "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)  # every interface: loopback
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def live_table(workers: list[SimWorker], agents: list[SpeculationAgent], view: LiveView, controller,
               sim_now: float, duration: float, url: str = "") -> Table:
    table = Table(title=f"specctl demo — simulated t = {sim_now:5.0f} s of {duration:.0f} s  (policy: {controller.policy.name})",
                  caption=f"status page: {url}" if url else None)
    for col in ("worker", "drafter", "batch", "mean ctx", "decision", "plan v", "est. τ", "obs. τ", "goodput tok/s"):
        table.add_column(col, justify="right" if col not in ("worker", "drafter", "decision") else "left")
    for w, agent in zip(workers, agents):
        rows = view.recent.get(w.worker_id)
        if not rows:
            table.add_row(w.worker_id, w.spec.drafter.kind, "-", "-", "-", str(agent.plan_version), "-", "-", "-")
            continue
        batch = sum(r[0] for r in rows) / len(rows)
        ctx = sum(r[1] for r in rows) / len(rows)
        goodput = 1000.0 * sum(r[2] for r in rows) / max(1e-9, sum(r[3] for r in rows))
        spec_n = sum(r[5] for r in rows)
        observed = f"{sum(r[4] for r in rows) / spec_n:.2f}" if spec_n else "off"
        d = agent.decide("__live__", int(ctx), max(1, round(batch)))
        decision = f"d={d.depth} w={d.width} n={d.max_nodes}" if d.depth else "off"
        state = controller.workers.get(w.worker_id)
        estimated = "-"
        if state is not None and d.depth:
            from policies.goodput import best_first_nodes

            view_acc = controller.acceptance.view(state.drafter_key, state.limits.max_depth, state.limits.max_width)
            bucket = controller.acceptance.context_bucket(int(ctx))
            nodes = best_first_nodes(view_acc.rank_probs(bucket), d.depth, d.width, d.max_nodes)
            estimated = f"{nodes.expected_accepted(d.max_nodes):.2f}"
        table.add_row(w.worker_id, w.spec.drafter.kind, f"{batch:.0f}", f"{ctx:,.0f}", decision,
                      str(agent.plan_version), estimated, observed, f"{goodput:,.0f}")
    return table


STRATEGIES = ("controller", "always on", "always off")


def summary_table(results: dict[str, dict[str, dict]], on_label: str) -> Table:
    """``results[strategy][worker]`` → one row per worker plus the fleet."""
    table = Table(title="Same arrivals under each strategy: goodput (tokens per second of GPU step time) and TPOT")
    table.add_column("worker")
    for label in ("goodput: controller", on_label, "off", "TPOT ms: controller", on_label, "off"):
        table.add_column(label, justify="right")
    for wid in results["controller"]:
        row = [results[s][wid] for s in STRATEGIES]
        table.add_row(wid, *(f"{r['goodput_tok_s']:,.0f}" for r in row), *(f"{r['tpot_ms_mean']:.1f}" for r in row))
    fleet = [fleet_goodput(results[s]) for s in STRATEGIES]
    table.add_row("fleet", *(f"{g:,.0f}" for g in fleet), "", "", "", style="bold")
    return table


def fleet_goodput(per_worker: dict[str, dict]) -> float:
    tokens = sum(s["tokens"] for s in per_worker.values())
    busy = sum(s["busy_s"] for s in per_worker.values())
    return tokens / busy if busy else 0.0


def write_results(results: dict[str, dict[str, dict]], out_dir: Path, scenario: str, policy: str) -> Path:
    """JSON of every worker's summary per strategy, and a PNG beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "demo.json"
    fleet = {s: fleet_goodput(results[s]) for s in STRATEGIES}
    payload = {"scenario": scenario, "policy": policy, "fleet_goodput_tok_s": fleet, "workers": results}
    path.write_text(json.dumps(payload, indent=2))
    workers = list(results["controller"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.27
    for i, s in enumerate(STRATEGIES):
        xs = [k + (i - 1) * width for k in range(len(workers))]
        axes[0].bar(xs, [results[s][w]["goodput_tok_s"] for w in workers], width, label=s)
        axes[1].bar(xs, [results[s][w]["tpot_ms_mean"] for w in workers], width, label=s)
    for ax, title in zip(axes, ("goodput (tok/s of step time), higher is better", "mean TPOT (ms), lower is better")):
        ax.set_xticks(range(len(workers)), workers, rotation=15, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(f"specctl demo: scenario {scenario}, policy {policy}")
    fig.tight_layout()
    fig.savefig(out_dir / "demo.png", dpi=110)
    plt.close(fig)
    return path


async def _controlled_run(scenario_name: str, duration_s: float, policy: str, console: Console,
                          status_listen: str = STATUS_LISTEN) -> dict[str, dict]:
    scenario = load_scenario(scenario_name)
    # Every demo starts fresh: drift baselines in memory, not restored from an earlier run.
    config = ServerConfig(listen="127.0.0.1:0", policy=policy, store=StoreSettings(path=""),
                          metrics_listen=status_listen, status_sample_interval_s=STATUS_SAMPLE_S)
    try:
        running = await start_server(config)
    except OSError as err:
        if not status_listen:
            raise
        raise StatusPageError(f"cannot serve the status page on {status_listen}: {err.strerror or err} "
                              f"(--status-listen 127.0.0.1:0 picks a free port)") from err
    url = ""
    if running.status_site is not None:
        url = status_url(status_listen, running.status_site.http.port)
        console.print(f"status page: [bold]{url}[/] (open it in a browser while the demo runs; "
                      f"Prometheus metrics at {url}metrics)", soft_wrap=True)
    workers = SimWorker.fleet(scenario)
    agents = [SpeculationAgent(hello_proto(w.hello), running.address, AgentOptions(fallback=Decision.off()))
              for w in workers]
    agent_tasks = [asyncio.create_task(a.run()) for a in agents]
    view = LiveView()
    time_scale = duration_s / scenario.duration_s
    sims = [asyncio.create_task(run_realtime(w, a, scenario.duration_s, time_scale,
                                             on_step=lambda r, wid=w.worker_id: view.record(wid, r)))
            for w, a in zip(workers, agents)]
    start = time.monotonic()
    try:
        with Live(console=console, refresh_per_second=4) as live:
            while not all(t.done() for t in sims):
                sim_now = min((time.monotonic() - start) / time_scale, scenario.duration_s)
                live.update(live_table(workers, agents, view, running.controller, sim_now, scenario.duration_s, url))
                await asyncio.sleep(REFRESH_S)
            # The last frame stays on screen after the page closes: without its URL.
            live.update(live_table(workers, agents, view, running.controller, scenario.duration_s,
                                   scenario.duration_s))
        for task in sims:
            task.result()
    finally:
        for agent in agents:
            agent.stop()
        await asyncio.gather(*agent_tasks, return_exceptions=True)
        await running.stop(0)
    return {w.worker_id: w.stats.summary() for w in workers}


def run_demo(duration_s: float = 60.0, scenario: str = "demo", policy: str = "goodput",
             out_dir: str = "demo-results", status_listen: str = STATUS_LISTEN) -> int:
    """``status_listen``: HOST:PORT of the controller's status page while the fleet runs (port 0: a free
    one, printed); empty for none."""
    console = Console(width=None if sys.stdout.isatty() else 150)
    on = static_on_decision()
    console.print(f"[bold]specctl demo[/]: controller ({policy}) + simulated fleet '{scenario}' over gRPC for "
                  f"~{duration_s:.0f} s; baselines (always on at depth {on.depth}, always off) run beside it.")
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        on_future = pool.submit(run_fixed, scenario, on)
        off_future = pool.submit(run_fixed, scenario, Decision.off())
        controlled = asyncio.run(_controlled_run(scenario, duration_s, policy, console, status_listen))
        with console.status("waiting for the baseline fleets to finish their replay…"):
            results = {"controller": controlled, "always on": on_future.result(), "always off": off_future.result()}
    console.print()
    console.print(summary_table(results, f"on (d={on.depth})"))
    path = write_results(results, Path(out_dir), scenario, policy)
    console.print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0
