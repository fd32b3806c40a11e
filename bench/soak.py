"""``specctl bench soak``: the controller's memory while workers churn requests.

The controller runs as its own process (``specctl serve``, default settings,
the store in memory) so its memory can be read from ``/proc/PID/status``:
``VmRSS`` (resident now) and ``VmHWM`` (the peak). Simulated workers on one
event loop (``bench.controller``'s hand-encoded workers, with short request
lives of 4-12 steps so requests turn over fast) send Hello, telemetry every
100 ms with ≈8 requests per step, a ``RequestFinished`` when a request ends,
and ACK every plan. The run stops once ``requests`` requests have finished;
memory is sampled every 0.2 s and at each checkpoint (by default 10k, 25k,
50k and 100k requests).

What must hold: per-worker request tracking is bounded (the LRU of
``max_active_requests``; finished requests leave it), so after start-up the
controller's memory stops growing with the number of requests served.
``soak.json`` holds the checkpoints, the whole series and the growth of the
first and second half of the run; ``soak.png`` plots RSS and peak RSS
against requests served.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import grpc

from bench.controller import GET_STATUS, STREAMS_PER_CHANNEL, GenStats, WireLoadWorker, _worker
from protos.speculation.v1 import controller_pb2

SAMPLE_S = 0.2
READY_TIMEOUT_S = 60.0
DEFAULT_CHECKPOINTS = (10_000, 25_000, 50_000, 100_000)


class SoakError(RuntimeError):
    pass


def memory_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of process ``pid`` in MiB, from /proc."""
    values = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) / 1024.0  # kB
    return values["VmRSS"], values["VmHWM"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServeProcess:
    """``specctl serve`` as a child process with a config of its own."""

    config_yaml: str
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    workdir: tempfile.TemporaryDirectory | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "ServeProcess":
        self.workdir = tempfile.TemporaryDirectory(prefix="specctl-soak-")
        config = Path(self.workdir.name) / "controller.yaml"
        config.write_text(f"listen: 127.0.0.1:{self.port}\n{self.config_yaml}")
        self.proc = subprocess.Popen([sys.executable, "-m", "specctl.cli", "serve", "--config", str(config)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=self.workdir.name)
        deadline = time.monotonic() + READY_TIMEOUT_S
        with grpc.insecure_channel(self.target) as channel:
            status = channel.unary_unary(GET_STATUS)
            while True:
                if self.proc.poll() is not None:
                    raise SoakError(f"specctl serve exited with {self.proc.returncode}: "
                                    f"{self.proc.stderr.read().decode()[-2000:]}")
                try:
                    status(controller_pb2.GetStatusRequest().SerializeToString(), timeout=1.0)
                    return self
                except grpc.RpcError:
                    if time.monotonic() > deadline:
                        raise SoakError(f"specctl serve did not answer on {self.target} within "
                                        f"{READY_TIMEOUT_S:.0f} s") from None
                    time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.workdir is not None:
            self.workdir.cleanup()


class ChurnWorker(WireLoadWorker):
    """``bench.controller.WireLoadWorker`` with short request lives (4-12 steps)."""

    def _new_request(self) -> list:
        slot = super()._new_request()
        slot[3] = self.rng.randint(4, 12)
        return slot

    @property
    def finished(self) -> int:
        return self.next_request - len(self.slots)


async def churn(target: str, pid: int, workers: int, requests: int, steps_per_s: float,
                checkpoints: tuple[int, ...], report: Callable[[int], None] | None = None) -> dict:
    """Drive ``workers`` workers until ``requests`` requests finished; sample the controller's memory."""
    loop = asyncio.get_running_loop()
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(target, options=options)
                for _ in range(max(1, min(16, -(-workers // STREAMS_PER_CHANNEL))))]
    fleet = [ChurnWorker(i, steps_per_s, seed=7) for i in range(workers)]
    stats, plans, stop = GenStats(), [], asyncio.Event()
    series: list[dict] = []
    marks: list[dict] = []
    pending_marks = sorted(c for c in checkpoints if c <= requests) or [requests]
    if pending_marks[-1] != requests:
        pending_marks.append(requests)
    rss0, _ = memory_mb(pid)
    t0 = time.monotonic()
    tasks = []
    try:
        connects = [ch.stream_stream("/speculation.v1.SpeculationController/Connect") for ch in channels]
        load_t0 = loop.time()
        for i, w in enumerate(fleet):
            tasks.append(asyncio.create_task(_worker(w, connects[i % len(connects)](), stats, plans, load_t0, stop)))
        while True:
            await asyncio.sleep(SAMPLE_S)
            done = sum(w.finished for w in fleet)
            rss, hwm = memory_mb(pid)
            row = {"t_s": round(time.monotonic() - t0, 3), "requests": done, "rss_mb": rss, "hwm_mb": hwm,
                   "steps_sent": stats.sent_steps}
            series.append(row)
            while pending_marks and done >= pending_marks[0]:
                marks.append(dict(row, checkpoint=pending_marks.pop(0)))
            if report is not None:
                report(done)
            if stats.stream_errors:
                raise SoakError(f"a worker stream failed: {stats.last_error}")
            if not pending_marks:
                break
    finally:
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for ch in channels:
            await ch.close(grace=None)
    return {"series": series, "checkpoints": marks, "rss_before_load_mb": rss0, "plans_received": stats.plans,
            "steps_sent": stats.sent_steps, "rejections": stats.rejections, "last_rejection": stats.last_rejection,
            "requests_finished": sum(w.finished for w in fleet), "seconds": round(time.monotonic() - t0, 2)}


def summarize(result: dict, workers: int, requests: int) -> dict:
    """Growth of RSS over the first and the second half of the requests."""
    series = result["series"]
    half = next(r for r in series if r["requests"] >= requests / 2)
    start, end = series[0], series[-1]
    first = half["rss_mb"] - result["rss_before_load_mb"]
    second = end["rss_mb"] - half["rss_mb"]
    return {
        "workers": workers,
        "requests": requests,
        "rss_before_load_mb": round(result["rss_before_load_mb"], 1),
        "rss_first_sample_mb": round(start["rss_mb"], 1),
        "rss_at_half_mb": round(half["rss_mb"], 1),
        "rss_end_mb": round(end["rss_mb"], 1),
        "peak_rss_mb": round(max(r["hwm_mb"] for r in series), 1),
        "growth_first_half_mb": round(first, 2),
        "growth_second_half_mb": round(second, 2),
        "growth_per_10k_requests_second_half_mb": round(10_000 * second / max(1, end["requests"] - half["requests"]),
                                                         3),
        "checkpoints": [{"requests": m["checkpoint"], "requests_finished": m["requests"], "rss_mb": round(m["rss_mb"], 1),
                         "peak_rss_mb": round(m["hwm_mb"], 1), "t_s": m["t_s"]} for m in result["checkpoints"]],
    }


def run_soak(workers: int = 200, requests: int = 100_000, steps_per_s: float = 25.0,
             checkpoints: tuple[int, ...] = DEFAULT_CHECKPOINTS, config_yaml: str = 'store: {path: ""}\n',
             report: Callable[[int], None] | None = None) -> dict:
    """Start ``specctl serve``, churn, stop it; return the summary with the raw series."""
    serve = ServeProcess(config_yaml).start()
    try:
        result = asyncio.run(churn(serve.target, serve.proc.pid, workers, requests, steps_per_s, checkpoints,
                                   report))
        if serve.proc.poll() is not None:
            raise SoakError(f"specctl serve exited with {serve.proc.returncode} during the soak")
    finally:
        serve.stop()
    summary = summarize(result, workers, requests)
    summary.update({k: result[k] for k in ("requests_finished", "steps_sent", "plans_received", "rejections",
                                           "last_rejection", "seconds")})
    summary["series"] = result["series"]
    return summary


def write_plot(path: Path, summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = summary["series"]
    x = [r["requests"] / 1000 for r in series]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(x, [r["rss_mb"] for r in series], color="#1f77b4", lw=1.6, label="RSS (VmRSS)")
    ax.plot(x, [r["hwm_mb"] for r in series], color="#d62728", lw=1.2, ls="--", label="peak RSS (VmHWM)")
    for c in summary["checkpoints"]:
        ax.annotate(f"{c['peak_rss_mb']:.0f} MiB", (c["requests_finished"] / 1000, c["peak_rss_mb"]),
                    textcoords="offset points", xytext=(0, 8), ha="center", fontsize=8)
        ax.plot([c["requests_finished"] / 1000], [c["peak_rss_mb"]], "o", color="#d62728", ms=4)
    ax.axhline(summary["rss_before_load_mb"], color="#7f7f7f", lw=0.8, ls=":", label="before the load")
    ax.set_xlabel("requests served (thousands)")
    ax.set_ylabel("controller memory (MiB)")
    ax.set_ylim(0, max(r["hwm_mb"] for r in series) * 1.15)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(f"Soak: {summary['workers']} workers churn {summary['requests']:,} requests "
                 f"(second half: {summary['growth_second_half_mb']:+.1f} MiB)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_soak_bench(out_dir: str | os.PathLike, workers: int = 200, requests: int = 100_000,
                   steps_per_s: float = 25.0) -> int:
    """``specctl bench soak``: write ``soak.json`` and ``soak.png`` into ``out_dir``."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task(f"{workers} workers churning requests", total=requests)
        try:
            summary = run_soak(workers, requests, steps_per_s,
                               report=lambda done: progress.update(task, completed=min(done, requests)))
        except SoakError as err:
            console.print(f"[red]specctl bench soak: {err}")
            return 1
    (out / "soak.json").write_text(json.dumps(summary, indent=1))
    write_plot(out / "soak.png", summary)
    for c in summary["checkpoints"]:
        console.print(f"{c['requests']:>8,} requests: RSS {c['rss_mb']:7.1f} MiB, peak {c['peak_rss_mb']:7.1f} MiB")
    console.print(f"growth: first half {summary['growth_first_half_mb']:+.1f} MiB, second half "
                  f"{summary['growth_second_half_mb']:+.1f} MiB; wrote {out / 'soak.json'} and {out / 'soak.png'}")
    return 0
