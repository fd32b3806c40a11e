"""Shared helpers for tests: a synthetic worker with a known cost and
acceptance truth, Hello builders and polling."""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from controller.models.cost import CostParams
from protos.speculation.v1 import worker_pb2
from worker.sdk.telemetry import RequestTelemetry, StepTelemetry

# A GPU-like truth: ~10 ms weight read, compute-bound above ~170-220 batch tokens.
TRUTH = CostParams(mem_ms=10.0, mem_ms_per_kv_token=2.5e-5, compute_ms=0.0, compute_ms_per_token=0.06,
                   draft_fixed_ms=0.3, draft_ms_per_level=0.4, draft_ms_per_node=0.002)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_hello(worker_id: str = "w0", max_depth: int = 6, max_width: int = 1, max_nodes: int | None = None,
               version: str = "v1", kind: int = worker_pb2.DRAFTER_KIND_EAGLE) -> worker_pb2.Hello:
    return worker_pb2.Hello(
        worker_id=worker_id,
        engine="test",
        model="llama-3-8b",
        hardware=worker_pb2.Hardware(accelerator="H100-SXM", count=1, memory_bandwidth_gb_s=3350,
                                     peak_tflops=989, weight_bytes=16e9, kv_bytes_per_token=131072, params=8e9),
        drafter=worker_pb2.Drafter(kind=kind, version=version, max_depth=max_depth, max_width=max_width,
                                   max_tree_nodes=max_nodes or max_depth * max_width, trained_context_len=8192),
        max_batch_size=256,
    )


@dataclass
class SyntheticWorker:
    """Steps from a known truth: chain acceptance ``alpha(context_len)`` per
    position and the ``TRUTH`` step cost. Deterministic for a seed."""

    alpha: Callable[[int], float]
    seed: int = 0
    step_id: int = 0
    rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    def step(self, decide, batch: int, context_len: int, prefix: str = "r") -> StepTelemetry:
        requests = []
        for i in range(batch):
            rid = f"{prefix}{i}"
            d = decide(rid, context_len, batch)
            accepted = 0
            while accepted < d.depth and self.rng.random() < self.alpha(context_len):
                accepted += 1
            requests.append(RequestTelemetry(rid, context_len, d.depth, d.width if d.depth else 0,
                                             d.depth if d.depth else 0, accepted))
        batch_tokens = sum(1 + r.nodes for r in requests)
        kv = batch * context_len
        self.step_id += 1
        return StepTelemetry(
            step_id=self.step_id,
            timestamp=time.time(),
            batch_size=batch,
            draft_ms=TRUTH.draft_ms(max(r.depth for r in requests), sum(r.nodes for r in requests)),
            verify_ms=TRUTH.verify_ms(batch_tokens, kv),
            requests=requests,
        )


async def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(interval)


async def http_get(url: str, timeout: float = 10.0) -> tuple[int, str, bytes]:
    """(status, content type, body) of a GET. The blocking call runs in a
    thread: the server under test serves on this test's own event loop."""
    import urllib.error
    import urllib.request

    def get() -> tuple[int, str, bytes]:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:
                return r.status, r.headers.get("Content-Type", ""), r.read()
        except urllib.error.HTTPError as err:
            return err.code, err.headers.get("Content-Type", ""), err.read()

    return await asyncio.to_thread(get)


async def feed(agent, worker: SyntheticWorker, loads: list[tuple[int, int]], rounds: int, decide=None,
               pause_s: float = 0.01) -> list[StepTelemetry]:
    """``rounds`` × one step per (batch, context) of ``loads`` through ``agent``
    (decisions from ``decide`` or the agent's plan); returns the steps sent."""
    sent = []
    for _ in range(rounds):
        for batch, ctx in loads:
            step = worker.step(decide or agent.decide, batch, ctx, prefix=f"b{batch}c{ctx}-")
            agent.observe(step)
            sent.append(step)
        await asyncio.sleep(pause_s)
    return sent
