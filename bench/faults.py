"""``specctl bench faults``: healthy workers' plan latency with and without a stuck peer.

One worker that opens ``Connect`` and never reads must not delay anyone
else's plans: its send queue is bounded (oldest dropped), and plans are
handed to that queue, never sent inline, so the housekeeping loop that pushes
every worker's plans cannot block on it.

Processes: the **controller** (``controller.server.start_server``, default
config, store in memory, in a ``multiprocessing`` child that answers a pipe:
re-plan every worker now, report a stream's queue) and the **parent**:
``workers`` healthy simulated workers on one grpc.aio loop
(``bench.controller``'s hand-encoded telemetry at 10 steps/s, every plan
ACKed at once) and, in the ``stuck`` phases, a :class:`StuckPeer` on a
connection of its own. The two phases alternate ``rounds`` times,
``phase_s`` seconds each, in one run; a stuck phase is measured from the
moment the controller reports the peer's queue dropping (its flow-control
windows are full: the send on its stream is blocked). Four times a second
the controller re-plans every worker (as a policy reload does); a plan's
latency is its receipt at the worker − ``Plan.created_at`` (one machine
clock).

``faults.json``: p50 / p99 / max per phase and the ratios stuck / alone, the
stuck stream's queue, drops and plans in flight, and whether the
housekeeping task was alive at the end. ``faults.png``: the latency
distributions side by side.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing as mp
import os
import time
from pathlib import Path

import grpc
import numpy as np

from bench.controller import CONNECT, GenStats, WireLoadWorker, _worker, bench_hello
from bench.echo import peak_rss_mb
from protos.speculation.v1 import worker_pb2

STUCK_ID = "faults-stuck"
REPLAN_EVERY_S = 0.25
HEALTHY_STEPS_PER_S = 10.0
READY_TIMEOUT_S = 60.0


def _bytes(data: bytes) -> bytes:
    return data


class StuckPeer:
    """A worker that opens Connect, reports a step (so it is planned for),
    sends messages that each draw a ~16 KiB Rejection (the detail quotes the
    nonce) and never reads what comes back: a few MB fill any flow-control
    window, after which the controller cannot send on its stream at all."""

    JUNK = worker_pb2.WorkerMessage(ack=worker_pb2.Ack(version=0, nonce="s" * 16384)).SerializeToString()

    def __init__(self, address: str, worker_id: str = STUCK_ID) -> None:
        self.address = address
        self.worker_id = worker_id
        self.channel: grpc.aio.Channel | None = None
        self.call = None
        self.sent = 0

    async def open(self, hello: worker_pb2.Hello) -> "StuckPeer":
        # A connection of its own, as a separate machine would have.
        self.channel = grpc.aio.insecure_channel(self.address, options=[("grpc.use_local_subchannel_pool", 1)])
        self.call = self.channel.stream_stream(CONNECT, request_serializer=_bytes, response_deserializer=_bytes)()
        await self.call.write(worker_pb2.WorkerMessage(hello=hello).SerializeToString())
        step = worker_pb2.StepReport(step_id=1, timestamp=time.time(), batch_size=1, draft_ms=1.0, verify_ms=10.0,
                                     requests=[worker_pb2.RequestStep(request_id="s", context_len=100, depth=2,
                                                                      width=1, nodes=2, accepted=1)])
        await self.call.write(worker_pb2.WorkerMessage(reports=worker_pb2.StepReports(steps=[step]))
                              .SerializeToString())
        return self

    async def flood(self, n: int) -> None:
        for _ in range(n):
            await self.call.write(self.JUNK)
            self.sent += 1

    async def close(self) -> None:
        if self.call is not None:
            self.call.cancel()
        if self.channel is not None:
            await self.channel.close(grace=None)


# ------------------------------------------------------- controller child

async def _controller_main(conn) -> None:
    from controller.config import ServerConfig, StoreSettings
    from controller.server import start_server

    running = await start_server(ServerConfig(listen="127.0.0.1:0", store=StoreSettings(path="")), "127.0.0.1:0")
    ctl, servicer = running.controller, running.servicer
    loop = asyncio.get_running_loop()
    requests: asyncio.Queue = asyncio.Queue()
    loop.add_reader(conn.fileno(), lambda: requests.put_nowait(conn.recv()))
    conn.send(("ready", running.port))
    try:
        while True:
            cmd, arg = await requests.get()
            if cmd == "replan":
                ctl.set_policy(ctl.policy)
                conn.send(("ok", None))
            elif cmd == "probe":
                stream, state = servicer.streams.get(arg), ctl.workers.get(arg)
                conn.send(("probe", {
                    "connected": stream is not None,
                    "queue": stream.queue.qsize() if stream else 0,
                    "queue_bound": ctl.config.send_queue_size,
                    "dropped": stream.dropped if stream else 0,
                    "plans_in_flight": len(state.plans.pending) if state else 0,
                    "plan_version": state.plans.plan_version if state else 0,
                    "housekeeping_alive": all(not t.done() for t in running.tasks),
                    "peak_rss_mb": peak_rss_mb(),
                }))
            else:
                break
    finally:
        loop.remove_reader(conn.fileno())
        await running.stop(0)


def controller_child(conn) -> None:
    """``multiprocessing`` target: the controller until the parent says stop."""
    logging.basicConfig(level=logging.ERROR)  # the simulated contexts open drift alerts: not this bench's news
    try:
        asyncio.run(_controller_main(conn))
    finally:
        conn.close()


class ControllerProcess:
    """The parent's handle on the controller child, which runs the real controller
    (:func:`controller_child`): blocking pipe calls, each answered at once."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=controller_child, args=(child,), name="specctl-faults-controller",
                                daemon=True)
        self.proc.start()
        child.close()
        self.port = self._expect("ready", READY_TIMEOUT_S)

    def _expect(self, kind: str, timeout_s: float = 10.0):
        if not self.conn.poll(timeout_s):
            raise RuntimeError(f"the controller sent no {kind!r} within {timeout_s:.0f} s "
                               f"(alive: {self.proc.is_alive()})")
        got, payload = self.conn.recv()
        if got != kind:
            raise RuntimeError(f"expected {kind!r} from the controller, got {got!r}")
        return payload

    def replan(self) -> None:
        self.conn.send(("replan", None))
        self._expect("ok")

    def probe(self, worker_id: str) -> dict:
        self.conn.send(("probe", worker_id))
        return self._expect("probe")

    def stop(self) -> None:
        try:
            self.conn.send(("stop", None))
        except (OSError, ValueError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


# ------------------------------------------------------------------- run

def _stats(ms: list[float]) -> dict:
    if not ms:
        return {"samples": 0}
    a = np.asarray(ms)
    return {"samples": len(ms), "p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
            "max_ms": float(a.max()), "mean_ms": float(a.mean())}


async def _run(ctl: ControllerProcess, workers: int, phase_s: float, rounds: int, report) -> dict:
    target = f"127.0.0.1:{ctl.port}"
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(target, options=options) for _ in range(max(1, workers // 32))]
    fleet = [WireLoadWorker(i, HEALTHY_STEPS_PER_S, seed=11) for i in range(workers)]
    stats, plans, stop = GenStats(), [], asyncio.Event()
    loop = asyncio.get_running_loop()
    load_t0 = loop.time()
    tasks = [asyncio.create_task(_worker(w, channels[i % len(channels)].stream_stream(CONNECT)(), stats, plans,
                                         load_t0, stop)) for i, w in enumerate(fleet)]
    windows: list[tuple[str, float, float]] = []
    stuck_reports: list[dict] = []

    async def replan_for(seconds: float, peer: StuckPeer | None) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            await asyncio.to_thread(ctl.replan)
            if peer is not None:
                await peer.flood(4)  # more rejections owed while it stays stuck
            await asyncio.sleep(REPLAN_EVERY_S)

    try:
        await replan_for(2.0, None)  # warm-up: every worker connected and planned once
        for r in range(rounds):
            report(f"round {r + 1}/{rounds}: alone", 2 * r)
            t0 = time.time()
            await replan_for(phase_s, None)
            windows.append(("alone", t0, time.time()))

            report(f"round {r + 1}/{rounds}: one stuck peer", 2 * r + 1)
            peer = await StuckPeer(target).open(bench_hello(STUCK_ID))
            try:
                await peer.flood(1000)
                for _ in range(200):
                    if (await asyncio.to_thread(ctl.probe, STUCK_ID))["dropped"] > 0:
                        break
                    await peer.flood(100)
                else:
                    raise RuntimeError("the stuck peer's queue never overflowed")
                t0 = time.time()
                await replan_for(phase_s, peer)
                windows.append(("stuck", t0, time.time()))
                stuck_reports.append(await asyncio.to_thread(ctl.probe, STUCK_ID))
                stuck_reports[-1]["rejections_owed"] = peer.sent
            finally:
                await peer.close()
    finally:
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for ch in channels:
            await ch.close(grace=None)
    latency: dict[str, list[float]] = {"alone": [], "stuck": []}
    for created, received in plans:
        for name, t0, t1 in windows:
            if t0 <= created < t1:
                latency[name].append((received - created) * 1000.0)
    return {"latency_ms": latency, "windows": windows, "stuck_stream": stuck_reports,
            "healthy_stream_errors": stats.stream_errors, "healthy_rejections": stats.rejections,
            "plans_received": stats.plans}


def write_plot(path: Path, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lat = result["latency_ms"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"alone": "#1f77b4", "stuck": "#d62728"}
    labels = {"alone": "no stuck peer", "stuck": "one stuck peer"}
    for name in ("alone", "stuck"):
        values = np.sort(np.asarray(lat[name]))
        if values.size:
            ax1.plot(values, np.arange(1, values.size + 1) / values.size, color=colors[name], lw=1.6,
                     label=f"{labels[name]} ({values.size} plans)")
    ax1.set_xscale("log")
    ax1.set_xlabel("plan created → received by a healthy worker (ms)")
    ax1.set_ylabel("fraction of plans")
    ax1.grid(alpha=0.3, which="both")
    ax1.legend(fontsize=8, loc="lower right")
    ax1.set_title("Healthy workers' plan latency (CDF)", fontsize=10)
    s = result["summary"]
    x = np.arange(2)
    for k, name in enumerate(("alone", "stuck")):
        vals = [s[name].get("p50_ms", 0.0), s[name].get("p99_ms", 0.0)]
        bars = ax2.bar(x + (k - 0.5) * 0.38, vals, 0.38, color=colors[name], label=labels[name])
        for b, v in zip(bars, vals):
            ax2.text(b.get_x() + b.get_width() / 2, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
    ax2.set_xticks(x, ["p50", "p99"])
    ax2.set_ylabel("ms")
    ax2.legend(fontsize=8)
    ax2.set_title(f"stuck / alone: p50 ×{s['ratio_p50']:.2f}, p99 ×{s['ratio_p99']:.2f}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_faults_bench(out_dir: str | os.PathLike, workers: int = 32, phase_s: float = 8.0, rounds: int = 3) -> int:
    """``specctl bench faults``: write ``faults.json`` and ``faults.png`` into ``out_dir``."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ctl = ControllerProcess()
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console) as bar:
            task = bar.add_task("starting", total=2 * rounds)

            def report(text: str, phases_done: int) -> None:
                bar.update(task, description=text, completed=phases_done)

            result = asyncio.run(_run(ctl, workers, phase_s, rounds, report))
            bar.update(task, completed=2 * rounds, description="done")
        final = ctl.probe(STUCK_ID)
    except RuntimeError as err:
        console.print(f"[red]specctl bench faults: {err}")
        return 1
    finally:
        ctl.stop()
    alone, stuck = _stats(result["latency_ms"]["alone"]), _stats(result["latency_ms"]["stuck"])
    summary = {
        "healthy_workers": workers, "phase_s": phase_s, "rounds": rounds, "alone": alone, "stuck": stuck,
        "ratio_p50": stuck["p50_ms"] / alone["p50_ms"], "ratio_p99": stuck["p99_ms"] / alone["p99_ms"],
        "stuck_stream_at_end_of_each_stuck_phase": result["stuck_stream"],
        "housekeeping_alive_at_end": final["housekeeping_alive"], "controller_peak_rss_mb": final["peak_rss_mb"],
        "healthy_stream_errors": result["healthy_stream_errors"], "healthy_rejections": result["healthy_rejections"],
    }
    result["summary"] = summary
    (out / "faults.json").write_text(json.dumps(summary, indent=1))
    write_plot(out / "faults.png", result)
    console.print(f"healthy plan latency p50 {alone['p50_ms']:.1f} ms / p99 {alone['p99_ms']:.1f} ms alone, "
                  f"p50 {stuck['p50_ms']:.1f} ms / p99 {stuck['p99_ms']:.1f} ms with a stuck peer "
                  f"(×{summary['ratio_p50']:.2f} / ×{summary['ratio_p99']:.2f}); "
                  f"stuck queue ≤ {final['queue_bound']}, {sum(r['dropped'] for r in result['stuck_stream'])} dropped")
    console.print(f"wrote {out / 'faults.json'} and {out / 'faults.png'}")
    return 0
