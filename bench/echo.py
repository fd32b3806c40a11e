"""The floor for ``specctl bench controller``: a bare grpc.aio server.

It serves the controller's ``Connect`` method name, parses every
``WorkerMessage`` it receives (so the floor pays the same deserialisation the
controller does), counts the steps and never answers on the stream. A unary
``GetStatus`` reports the per-worker step counts in the controller's own
``GetStatusResponse`` shape, so the load generator measures both servers
with the same code.

Also here: the plumbing both benchmark server children share (a sampler of
process CPU time and event-loop lag, and a stop signal read from a
``multiprocessing`` pipe).
"""

from __future__ import annotations

import asyncio
import resource
import time
from typing import Callable

import grpc

from protos.speculation.v1 import controller_pb2, worker_pb2

SERVICE = "speculation.v1.SpeculationController"
SAMPLE_INTERVAL_S = 0.25


class Sampler:
    """Every ``SAMPLE_INTERVAL_S``: (wall time, process CPU seconds, loop lag ms, extra counters).

    Lag is how late the sampler's own sleep woke up: a direct reading of how
    long the event loop is busy between two turns.
    """

    def __init__(self, counters: Callable[[], dict] | None = None) -> None:
        self.samples: list[dict] = []
        self.counters = counters or (lambda: {})

    def sample(self, lag_ms: float) -> None:
        row = {"t": time.time(), "cpu": time.process_time(), "lag_ms": lag_ms}
        row.update(self.counters())
        self.samples.append(row)

    async def run(self) -> None:
        self.sample(0.0)
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + SAMPLE_INTERVAL_S
            await asyncio.sleep(SAMPLE_INTERVAL_S)
            self.sample(max(0.0, (loop.time() - due) * 1000.0))


async def wait_for_stop(conn) -> None:
    """Return once the parent sends anything on ``conn`` (or closes it)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def readable() -> None:
        stop.set()

    loop.add_reader(conn.fileno(), readable)
    try:
        await stop.wait()
    finally:
        loop.remove_reader(conn.fileno())
    try:
        if conn.poll():
            conn.recv()
    except (EOFError, OSError):
        pass


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


class EchoServicer:
    """Consumes Connect streams; counts parsed steps per worker."""

    def __init__(self) -> None:
        self.steps: dict[str, int] = {}
        self.last_at: dict[str, float] = {}
        self.messages = 0
        self.acks = 0

    async def Connect(self, request_iterator, context):
        worker_id = ""
        async for msg in request_iterator:
            self.messages += 1
            kind = msg.WhichOneof("payload")
            if kind == "reports":
                self.steps[worker_id] = self.steps.get(worker_id, 0) + len(msg.reports.steps)
                self.last_at[worker_id] = time.time()
            elif kind == "hello":
                worker_id = msg.hello.worker_id
                self.steps.setdefault(worker_id, 0)
            elif kind == "ack":
                self.acks += 1
        return
        yield  # an async generator that never sends

    async def GetStatus(self, request, context):
        out = controller_pb2.GetStatusResponse(policy="bare-echo")
        for wid, n in self.steps.items():
            out.workers.add(hello=worker_pb2.Hello(worker_id=wid), connected=True, steps_ingested=n,
                            last_report_at=self.last_at.get(wid, 0.0))
        return out


async def start_echo_server(listen: str = "127.0.0.1:0") -> tuple[grpc.aio.Server, EchoServicer, int]:
    servicer = EchoServicer()
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    handlers = {
        "Connect": grpc.stream_stream_rpc_method_handler(
            servicer.Connect,
            request_deserializer=worker_pb2.WorkerMessage.FromString,
            response_serializer=lambda m: m,
        ),
        "GetStatus": grpc.unary_unary_rpc_method_handler(
            servicer.GetStatus,
            request_deserializer=controller_pb2.GetStatusRequest.FromString,
            response_serializer=controller_pb2.GetStatusResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    await server.start()
    return server, servicer, port


async def _echo_main(conn) -> None:
    server, servicer, port = await start_echo_server()
    sampler = Sampler(lambda: {"steps": sum(servicer.steps.values()), "messages": servicer.messages})
    sampler_task = asyncio.create_task(sampler.run())
    conn.send(("ready", port))
    try:
        await wait_for_stop(conn)
    finally:
        sampler_task.cancel()
        sampler.sample(0.0)
        await server.stop(0)
    conn.send(("stats", {"samples": sampler.samples, "peak_rss_mb": peak_rss_mb(),
                         "messages": servicer.messages, "acks": servicer.acks,
                         "steps": sum(servicer.steps.values())}))


def echo_child(conn) -> None:
    """``multiprocessing`` target: serve until the parent says stop, then send stats."""
    try:
        asyncio.run(_echo_main(conn))
    except Exception as err:  # noqa: BLE001 - report, then exit non-zero
        try:
            conn.send(("error", f"{type(err).__name__}: {err}"))
        except OSError:
            pass
        raise
    finally:
        conn.close()
