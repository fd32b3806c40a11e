"""What sharing state through Redis costs a replica: CPU per 1,000 ingested steps.

Two measurements:

* :func:`bench_replica_cpu` — a whole ``specctl serve`` process under the
  same gRPC load with the embedded store and with ``state: {backend: redis}``
  (everything a replica does for the fleet: merges, directory, leases, the
  alert feed, the policy bus), its process CPU per 1,000 ingested steps;
* :func:`bench_acceptance_sync` — the acceptance sync path alone, in process,
  at rates a 2-core machine cannot drive over gRPC.

:func:`bench_acceptance_sync` runs ``replicas`` in-process replicas (an
:class:`~controller.models.acceptance.AcceptanceModel` and an
:class:`~controller.fleet.acceptance_sync.AcceptanceSync` each) against one
Redis, on a simulated clock: every simulated second each replica ingests
``steps_per_s`` worker steps of ``requests_per_step`` requests (their
acceptance chains folded in per stratum, as ``controller.core.ingest`` folds a
message's), ticks its model and merges once. It measures, on the thread
that does it, the CPU of

* the merge rounds (prepare, the Redis round trip's client side, install);
* the ledger's share of the ticks (the same ticks on a twin model without
  sharing, subtracted);

and the Redis server's CPU over the run (``INFO cpu``). The merge cost does
not grow with steps, only with strata and merges, so the per-step figure is
for the stated rate; ``merge_ms`` gives the per-round cost to scale it.
``specctl bench fleet`` may call either.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from controller.fleet.acceptance_sync import AcceptanceSync
from controller.fleet.store import FleetStore
from controller.models.acceptance import AcceptanceModel


def _redis_cpu_s(store: FleetStore) -> float:
    info = store.call("bench_info", lambda r: r.info("cpu"))
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def bench_acceptance_sync(url: str, *, replicas: int = 2, versions: int = 4,
                          context_edges: tuple[int, ...] = (0, 1024, 4096, 16384, 65536), depth: int = 8,
                          width: int = 4, steps_per_s: int = 12_800, requests_per_step: int = 8,
                          seconds: int = 30, half_life_s: float = 120.0, max_evidence: float = 2000.0,
                          fleet: str = "bench", seed: int = 0) -> dict[str, Any]:
    """Measure the sync path; returns a JSON-able dict.

    Parameters
    ----------
    url : str
        A Redis to use (the ``fleet`` namespace is written to and left there).
    replicas : int
        Replicas merging into the same totals.
    versions, context_edges, depth, width
        Strata per replica: ``versions × len(context_edges)`` of ``depth × width`` cells.
    steps_per_s, requests_per_step : int
        Each replica's ingest rate (the default: 256 workers at 50 steps/s).
    seconds : int
        Simulated seconds (one merge per replica each).
    half_life_s, max_evidence : float
        The acceptance model's settings.
    fleet : str
        Namespace in Redis (distinct per run, or the totals carry over).
    seed : int
        Seed of the simulated acceptance.

    Returns
    -------
    dict
        ``cpu_per_1k_steps_ms`` (sync CPU per 1,000 steps, client side, the
        figure the <= 10 % goal compares with ingest),
        ``redis_cpu_per_1k_steps_ms``, ``merge_ms_p50``/``p99`` (wall time of a
        merge round), ``merge_cpu_ms_mean`` (client CPU of a round),
        ``merge_loop_cpu_ms_mean`` (its part on the event loop: prepare and
        install; the round trip runs on a store thread),
        ``tick_extra_cpu_ms_mean`` and the configuration.
    """
    rng = np.random.default_rng(seed)
    keys = [("eagle", f"v{i}") for i in range(versions)]
    alphas = rng.uniform(0.5, 0.9, size=(versions, len(context_edges)))
    stores = [FleetStore(url, fleet=fleet, replica_id=f"bench-{i}", op_timeout_s=2.0, connect_timeout_s=2.0)
              for i in range(replicas)]
    try:
        models = [AcceptanceModel(context_edges, half_life_s=half_life_s, max_evidence=max_evidence)
                  for _ in range(replicas)]
        twins = [AcceptanceModel(context_edges, half_life_s=half_life_s, max_evidence=max_evidence)
                 for _ in range(replicas)]
        syncs = [AcceptanceSync(m, s, seed_grace_s=0.0) for m, s in zip(models, stores)]
        for m in (*models, *twins):
            for key in keys:
                m.strata(key, depth, width, 0.0)
        redis_cpu0 = _redis_cpu_s(stores[0])
        merge_wall, merge_cpu, loop_cpu, tick_extra = [], [], [], []
        steps = 0
        # Spread requests over strata and chain lengths as a fold of the evidence buffer would (controller.core.ingest.fold_evidence).
        strata = versions * len(context_edges)
        for second in range(seconds):
            now = float(second)
            for r in range(replicas):
                counts = rng.multinomial(steps_per_s * requests_per_step, np.full(strata, 1.0 / strata))
                for flat, n in enumerate(counts):
                    v, bucket = divmod(flat, len(context_edges))
                    # Accepted length of a chain of `depth`: geometric, cut at depth.
                    taus = np.minimum(rng.geometric(1.0 - alphas[v, bucket], size=n) - 1, depth)
                    tally = np.bincount(taus, minlength=depth + 1)
                    for m in (models[r], twins[r]):
                        post = m.strata(keys[v], depth, width, now)[bucket]
                        for tau, c in enumerate(tally):
                            if c:
                                post.observe_chain(depth, tau, float(c))
                steps += steps_per_s
                t0 = time.thread_time()
                models[r].tick(now + 0.99)
                t1 = time.thread_time()
                twins[r].tick(now + 0.99)
                t2 = time.thread_time()
                tick_extra.append((t1 - t0) - (t2 - t1))
                sync = syncs[r]
                w0, c0 = time.perf_counter(), time.thread_time()
                job = sync.prepare()
                c1 = time.thread_time()
                reply = stores[r].call("acceptance_merge", lambda client: sync.exchange(job, client))
                c2 = time.thread_time()
                ok = sync.install(reply)
                c3 = time.thread_time()
                merge_wall.append(time.perf_counter() - w0)
                merge_cpu.append(c3 - c0)
                loop_cpu.append((c1 - c0) + (c3 - c2))
                if not ok and second > 1:  # the first round of a new fleet seeds it
                    raise RuntimeError(f"merge failed in the benchmark: {stores[r].health()['last_error']}")
        redis_cpu = _redis_cpu_s(stores[0]) - redis_cpu0
        client_cpu = sum(merge_cpu) + max(sum(tick_extra), 0.0)
        per_k = 1000.0 / steps
        return {
            "replicas": replicas, "strata_per_replica": strata, "cells_per_stratum": depth * width,
            "steps_per_s_per_replica": steps_per_s, "requests_per_step": requests_per_step, "seconds": seconds,
            "steps": steps, "merges": len(merge_wall),
            "cpu_per_1k_steps_ms": client_cpu * per_k * 1000.0,
            "redis_cpu_per_1k_steps_ms": redis_cpu * per_k * 1000.0,
            "merge_cpu_ms_mean": float(np.mean(merge_cpu) * 1000.0),
            "merge_loop_cpu_ms_mean": float(np.mean(loop_cpu) * 1000.0),
            "tick_extra_cpu_ms_mean": float(np.mean(tick_extra) * 1000.0),
            "merge_ms_p50": float(np.percentile(merge_wall, 50) * 1000.0),
            "merge_ms_p99": float(np.percentile(merge_wall, 99) * 1000.0),
            "payload_bytes_per_merge": strata * depth * width * 4 * 8,
        }
    finally:
        for s in stores:
            s.close()


# ----------------------------------------------------------------------------------------------------------
# One replica's CPU per 1,000 ingested steps, embedded store against Redis

def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid``, every thread (Linux ``/proc``)."""
    import os

    fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _drive(address: str, workers: int, steps_per_s: float, steps_per_message: int, requests_per_step: int,
                 warmup_s: float, measure_s: float, seed: int) -> dict[str, float]:
    """Raw streams of ``workers`` workers at ``steps_per_s`` each; the steps the replica ingested over the
    measured window (from GetStatus) and the window's bounds (monotonic)."""
    import asyncio

    import grpc

    from protos.speculation.v1 import controller_pb2, controller_pb2_grpc, plan_pb2, worker_pb2

    rng = np.random.default_rng(seed)
    channel = grpc.aio.insecure_channel(address)
    stub = controller_pb2_grpc.SpeculationControllerStub(channel)
    stop = asyncio.Event()

    def templates(worker_id: str) -> list[worker_pb2.StepReports]:
        out = []
        for k in range(8):  # a few distinct messages per worker, cycled (the drift monitor needs variety)
            steps = []
            for j in range(steps_per_message):
                ctx = int(rng.choice((500, 1500)))
                accepted = np.minimum(rng.geometric(0.2, size=requests_per_step) - 1, 6)
                steps.append(worker_pb2.StepReport(
                    batch_size=requests_per_step, draft_ms=1.5, verify_ms=14.0, timestamp=0.0,
                    requests=[worker_pb2.RequestStep(request_id=f"{worker_id}-{k}-{j}-{i}", context_len=ctx,
                                                     depth=6, width=1, nodes=6, accepted=int(a))
                              for i, a in enumerate(accepted)]))
            out.append(worker_pb2.StepReports(steps=steps))
        return out

    async def worker(index: int) -> None:
        worker_id = f"bench-w{index}"
        hello = worker_pb2.Hello(
            worker_id=worker_id, engine="bench", model="bench-model",
            hardware=worker_pb2.Hardware(accelerator="bench-gpu", count=1, memory_bandwidth_gb_s=3350,
                                         peak_tflops=989, weight_bytes=16e9, kv_bytes_per_token=131072,
                                         params=8e9),
            drafter=worker_pb2.Drafter(kind=worker_pb2.DRAFTER_KIND_EAGLE, version="bench", max_depth=6,
                                       max_width=1, max_tree_nodes=6, trained_context_len=8192),
            max_batch_size=256)
        messages = templates(worker_id)
        call = channel.stream_stream("/speculation.v1.SpeculationController/Connect",
                                     request_serializer=lambda b: b,
                                     response_deserializer=plan_pb2.ControllerMessage.FromString)()
        acks: list[worker_pb2.WorkerMessage] = []

        async def read() -> None:
            try:
                async for msg in call:
                    if msg.WhichOneof("payload") == "plan":
                        acks.append(worker_pb2.WorkerMessage(ack=worker_pb2.Ack(version=msg.plan.version,
                                                                                nonce=msg.plan.nonce)))
            except grpc.aio.AioRpcError:
                pass

        await call.write(worker_pb2.WorkerMessage(hello=hello).SerializeToString())
        reader = asyncio.create_task(read())
        period = steps_per_message / steps_per_s
        next_at = asyncio.get_running_loop().time() + period * (index / workers)  # spread the senders
        step_id = 0
        try:
            while not stop.is_set():
                await asyncio.sleep(max(0.0, next_at - asyncio.get_running_loop().time()))
                next_at += period
                while acks:  # one write at a time on a stream
                    await call.write(acks.pop().SerializeToString())
                message = messages[step_id // steps_per_message % len(messages)]
                for s in message.steps:
                    step_id += 1
                    s.step_id = step_id
                await call.write(worker_pb2.WorkerMessage(reports=message).SerializeToString())
        finally:
            call.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def ingested() -> int:
        status = await stub.GetStatus(controller_pb2.GetStatusRequest(), timeout=10.0)
        return sum(w.steps_ingested for w in status.workers)

    tasks = [asyncio.create_task(worker(i)) for i in range(workers)]
    try:
        await asyncio.sleep(warmup_s)
        loop = asyncio.get_running_loop()
        n0, t0 = await ingested(), loop.time()
        await asyncio.sleep(measure_s)
        n1, t1 = await ingested(), loop.time()
        return {"n0": n0, "t0": t0, "n1": n1, "t1": t1}
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await channel.close()


def bench_replica_cpu(redis_url: str, *, workers: int = 64, steps_per_s: float = 50.0, steps_per_message: int = 10,
                      requests_per_step: int = 8, warmup_s: float = 4.0, measure_s: float = 10.0,
                      rounds: int = 2, seed: int = 0) -> dict[str, Any]:
    """A ``specctl serve`` process under the same raw-gRPC load with the embedded store and with
    ``state: {backend: redis}``, alternately; its CPU per 1,000 ingested steps each way.

    Parameters
    ----------
    redis_url : str
        A Redis the redis phases use (namespace ``bench-cpu-<n>``, left there).
    workers, steps_per_s, steps_per_message, requests_per_step
        The load: ``workers`` streams each reporting ``steps_per_s`` steps a second in messages of
        ``steps_per_message`` steps of ``requests_per_step`` depth-6 chain requests. The load
        generator runs in this process, so the controller shares the machine's cores with it.
    warmup_s, measure_s : float
        Load before the CPU window (every worker planned, the drift baselines learning), and the window.
    rounds : int
        Embedded/redis pairs, alternated so that a machine getting busier weighs on both alike.
    seed : int

    Returns
    -------
    dict
        ``cpu_per_1k_steps_embedded`` / ``cpu_per_1k_steps_redis`` (the replica process's user +
        system CPU, every thread, in ms per 1,000 steps ingested: medians over the rounds),
        ``redis_overhead`` (their ratio minus one; the goal is at most 0.10), ``redis_server_cpu_per_1k_steps``
        (Redis's own, from ``INFO``), the runs and the configuration.
    """
    import asyncio
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    import grpc
    import redis as redis_py
    import yaml

    from protos.speculation.v1 import controller_pb2, controller_pb2_grpc

    redis_client = redis_py.Redis.from_url(redis_url)

    def redis_cpu() -> float:
        info = redis_client.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    runs: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="specctl-bench-cpu-") as tmp:
            for r in range(rounds):
                for backend in ("embedded", "redis"):
                    port = _free_port()
                    config: dict[str, Any] = {"listen": f"127.0.0.1:{port}", "store": {"path": ""}}
                    if backend == "redis":
                        config["state"] = {"backend": "redis", "url": redis_url, "fleet": f"bench-cpu-{r}",
                                           "replica_id": "bench"}
                    path = Path(tmp) / f"{backend}-{r}.yaml"
                    path.write_text(yaml.safe_dump(config))
                    proc = subprocess.Popen([sys.executable, "-m", "specctl.cli", "serve", "--config", str(path)],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp,
                                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
                    try:
                        with grpc.insecure_channel(config["listen"]) as channel:
                            grpc.channel_ready_future(channel).result(timeout=60)
                            controller_pb2_grpc.SpeculationControllerStub(channel).GetStatus(
                                controller_pb2.GetStatusRequest(), timeout=30)
                        marks: dict[str, float] = {}

                        async def measured() -> dict[str, float]:
                            drive = _drive(config["listen"], workers, steps_per_s, steps_per_message,
                                           requests_per_step, warmup_s, measure_s, seed + r)
                            task = asyncio.ensure_future(drive)
                            # The CPU window is the driver's GetStatus window, give or take a poll.
                            await asyncio.sleep(warmup_s)
                            marks["cpu0"], marks["redis0"] = _proc_cpu_s(proc.pid), redis_cpu()
                            await asyncio.sleep(measure_s)
                            marks["cpu1"], marks["redis1"] = _proc_cpu_s(proc.pid), redis_cpu()
                            return await task

                        window = asyncio.run(measured())
                    finally:
                        proc.terminate()
                        try:
                            proc.wait(20)
                        except subprocess.TimeoutExpired:
                            proc.kill()
                            proc.wait(5)
                    steps = window["n1"] - window["n0"]
                    if steps <= 0 or proc.returncode not in (0, -15):
                        raise RuntimeError(f"{backend} replica ingested {steps} steps (exit {proc.returncode}): "
                                           f"{proc.stderr.read().decode()[-2000:]}")
                    run = {"backend": backend, "round": r, "steps": steps,
                           "steps_per_s": steps / (window["t1"] - window["t0"]),
                           "cpu_s": marks["cpu1"] - marks["cpu0"],
                           "cpu_per_1k_steps_ms": (marks["cpu1"] - marks["cpu0"]) * 1e6 / steps}
                    if backend == "redis":
                        run["redis_server_cpu_per_1k_steps_ms"] = (marks["redis1"] - marks["redis0"]) * 1e6 / steps
                    runs.append(run)
    finally:
        redis_client.close()

    def median(backend: str, key: str = "cpu_per_1k_steps_ms") -> float:
        return float(np.median([run[key] for run in runs if run["backend"] == backend]))

    embedded, shared = median("embedded"), median("redis")
    return {
        "cpu_per_1k_steps_embedded": embedded, "cpu_per_1k_steps_redis": shared,
        "redis_overhead": shared / embedded - 1.0,
        "redis_server_cpu_per_1k_steps": median("redis", "redis_server_cpu_per_1k_steps_ms"),
        "runs": runs,
        "config": {"workers": workers, "steps_per_s_per_worker": steps_per_s, "steps_per_message": steps_per_message,
                   "requests_per_step": requests_per_step, "warmup_s": warmup_s, "measure_s": measure_s,
                   "rounds": rounds},
    }
