"""Drive simulated workers in simulated time or in (scaled) real time.

The agent contract (``worker/sdk/agent.py``)::

    agent.decide(request_id, context_len, batch_size) -> Decision
    agent.observe(StepTelemetry) -> None
    agent.finish(RequestSummary) -> None

With request classes in the scenario's traffic (``class_mix``) the worker
asks ``decide(request_id, context_len, batch_size, request_class)`` of a
callable that takes a fourth argument (``SpeculationAgent.decide`` does); a
three-argument one is asked as before, blind to classes.

:func:`run_simulated` accepts either a bare ``decide`` callable or an object
with that contract; :func:`run_fleet_simulated` interleaves several workers in
time order (so a shared controller sees their reports as it would live);
:func:`run_realtime` paces steps with ``asyncio.sleep`` so an agent's
background tasks (telemetry upload, plan updates) run between steps.
"""

from __future__ import annotations

import asyncio
import heapq
import inspect
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from policies.table import Decision
from worker.sim.worker import DecideFn, SimWorker, StepResult, WorkerStats
from worker.sdk.telemetry import RequestSummary, StepTelemetry


class AgentLike(Protocol):
    # request_class: passed (fourth) only when the traffic has request classes and decide takes it.
    def decide(self, request_id: str, context_len: int, batch_size: int, request_class: str = "") -> Decision: ...

    def observe(self, step: StepTelemetry) -> None: ...

    def finish(self, summary: RequestSummary) -> None: ...


@dataclass(slots=True)
class RunResult:
    """What a run did: the worker's totals and where its clock stopped."""

    worker_id: str
    stats: WorkerStats
    end_s: float
    steps: int = 0


def _split(decide: DecideFn | AgentLike) -> tuple[DecideFn, Callable | None, Callable | None]:
    if hasattr(decide, "decide"):
        return decide.decide, getattr(decide, "observe", None), getattr(decide, "finish", None)
    return decide, None, None


def _report(result: StepResult, observe, finish, on_step) -> None:
    if result.telemetry is not None and observe is not None:
        observe(result.telemetry)
    if finish is not None:
        for s in result.finished:
            finish(s)
    if on_step is not None:
        on_step(result)


def run_simulated(
    worker: SimWorker,
    decide: DecideFn | AgentLike,
    until_s: float,
    *,
    start_s: float = 0.0,
    on_step: Callable[[StepResult], None] | None = None,
) -> RunResult:
    """Step ``worker`` from ``start_s`` until its clock reaches ``until_s``.

    Idle gaps jump to the next arrival. With an agent-like ``decide`` its
    ``observe`` / ``finish`` are called after every step; ``on_step`` sees
    every :class:`StepResult` (idle ones too).

    >>> from worker.sim.scenario import load_scenario
    >>> w = SimWorker.fleet(load_scenario("chat-low-load"))[0]
    >>> run_simulated(w, lambda rid, ctx, b: Decision.chain(3), 5.0).stats.tokens > 0
    True
    """
    dec, observe, finish = _split(decide)
    now, steps = start_s, 0
    while now < until_s:
        result = worker.step(now, dec)
        _report(result, observe, finish, on_step)
        if result.idle:
            now = min(result.end, until_s) if math.isfinite(result.end) else until_s
        else:
            now = result.end
            steps += 1
    return RunResult(worker.worker_id, worker.stats, now, steps)


def run_fleet_simulated(
    workers: Sequence[SimWorker],
    decide: DecideFn | AgentLike | Callable[[SimWorker], DecideFn | AgentLike],
    until_s: float,
    *,
    per_worker: bool = False,
    on_step: Callable[[SimWorker, StepResult], None] | None = None,
) -> list[RunResult]:
    """Run several workers in one simulated clock, always stepping the one that is furthest behind.

    Parameters
    ----------
    workers
        The fleet (e.g. ``SimWorker.fleet(scenario)``).
    decide
        One decide callable / agent for all workers, or with ``per_worker=True``
        a factory called once per worker.
    until_s
        Scenario time to stop at.
    """
    handlers = [_split(decide(w) if per_worker else decide) for w in workers]
    clock = [(0.0, i) for i in range(len(workers))]
    heapq.heapify(clock)
    steps = [0] * len(workers)
    ends = [0.0] * len(workers)
    while clock:
        now, i = heapq.heappop(clock)
        if now >= until_s:
            ends[i] = now
            continue
        w = workers[i]
        dec, observe, finish = handlers[i]
        result = w.step(now, dec)
        _report(result, observe, finish, (lambda r, w=w: on_step(w, r)) if on_step else None)
        if result.idle:
            nxt = min(result.end, until_s) if math.isfinite(result.end) else until_s
        else:
            nxt = result.end
            steps[i] += 1
        heapq.heappush(clock, (nxt, i))
    return [RunResult(w.worker_id, w.stats, ends[i], steps[i]) for i, w in enumerate(workers)]


async def _maybe_await(value: Any) -> None:
    if inspect.isawaitable(value):
        await value


async def run_realtime(
    worker: SimWorker,
    agent: AgentLike,
    until_s: float,
    time_scale: float = 1.0,
    *,
    epoch_timestamps: bool = True,
    max_idle_sleep_s: float = 0.25,
    on_step: Callable[[StepResult], None] | None = None,
) -> RunResult:
    """Run ``worker`` against a live ``agent``, sleeping each step's duration x ``time_scale``.

    Parameters
    ----------
    worker
        The simulated worker.
    agent
        Object with ``decide`` / ``observe`` / ``finish`` (awaitable results are awaited).
    until_s
        Scenario seconds to run.
    time_scale
        Wall seconds per simulated second (0.1 runs ten times faster than real).
    epoch_timestamps
        Stamp telemetry with ``time.time()`` at start + scenario seconds.
    max_idle_sleep_s
        Longest single wall sleep while idle, so cancellation stays prompt.

    Sleeps target an absolute wall deadline (start + scenario time x scale),
    so the simulator's own compute time does not accumulate as drift.
    """
    if time_scale < 0:
        raise ValueError(f"time_scale must be >= 0, got {time_scale}")
    if epoch_timestamps:
        worker.time_origin = time.time()
    loop = asyncio.get_running_loop()
    wall0 = loop.time()
    now, steps = 0.0, 0
    while now < until_s:
        result = worker.step(now, agent.decide)
        if result.idle:
            target = min(result.end, until_s) if math.isfinite(result.end) else until_s
            # Sleep in slices while idle so a long gap stays cancellable.
            while now < target:
                now = min(target, now + max_idle_sleep_s / time_scale if time_scale > 0 else target)
                await asyncio.sleep(max(0.0, wall0 + now * time_scale - loop.time()))
            if on_step is not None:
                on_step(result)
            continue
        now = result.end
        steps += 1
        await asyncio.sleep(max(0.0, wall0 + now * time_scale - loop.time()))
        if result.telemetry is not None:
            await _maybe_await(agent.observe(result.telemetry))
        for s in result.finished:
            await _maybe_await(agent.finish(s))
        if on_step is not None:
            on_step(result)
    return RunResult(worker.worker_id, worker.stats, now, steps)
