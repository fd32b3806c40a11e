"""A worker rolls to a new drafter version on its live stream: outcomes
observed before the roll stay with the old version, the controller learns
the new version from the steps after it, and decisions stay in the new
drafter's limits throughout."""

from __future__ import annotations

import asyncio

import pytest

from controller.config import PlanSettings, ServerConfig
from controller.server import start_server
from tests.support import SyntheticWorker, free_port, make_hello, wait_for
from policies.table import Decision
from worker.sdk.agent import AgentOptions, SpeculationAgent

def chain3(request_id: str, context_len: int, batch_size: int) -> Decision:
    return Decision.chain(3)  # what the engine ran, whatever the plan: the test is about attribution


FAST = PlanSettings(recompute_interval_s=0.05, min_push_interval_s=0.05, hysteresis=0.0)


@pytest.fixture
async def server():
    running = await start_server(ServerConfig(listen=f"127.0.0.1:{free_port()}", plan=FAST, store={"path": ""}))
    yield running
    await running.stop(0)


def effective_samples(server, version: str) -> float:
    """Samples of ``version`` the controller holds for w-roll (0 until its Hello is in:
    the agent counts as connected once the stream is open, a moment before that)."""
    workers = server.controller.status("w-roll").workers
    return sum(sum(s.effective_samples) for w in workers for s in w.acceptance if s.drafter_version == version)


async def test_roll_drafter_moves_telemetry_to_the_new_version_on_the_same_stream(server):
    agent = SpeculationAgent(make_hello("w-roll", max_depth=5, version="heads-a"), server.address,
                             AgentOptions(fallback=Decision.chain(4))).start()
    try:
        worker = SyntheticWorker(lambda ctx: 0.3, seed=3)
        await wait_for(lambda: agent.stats.connected)
        for _ in range(40):
            agent.observe(worker.step(chain3, 4, 300))
        await wait_for(lambda: effective_samples(server, "heads-a") > 0, timeout=30)
        await wait_for(lambda: agent.plan_version >= 1, timeout=30)
        reconnects = agent.stats.reconnects
        version_at_roll = agent.plan_version

        new = make_hello("w-roll", max_depth=3, version="heads-b").drafter
        for _ in range(10):  # observed before the roll, sent after it is called
            agent.observe(worker.step(chain3, 4, 300))
        before_b = effective_samples(server, "heads-b")
        agent.roll_drafter(new)
        assert all(d.depth <= 3 for d in agent.table.decisions)  # clamped at once, before any new plan
        await wait_for(lambda: server.controller.workers["w-roll"].hello.drafter.version == "heads-b", timeout=30)
        assert before_b == 0 and effective_samples(server, "heads-b") == 0  # nothing of the old drafter's

        worker.alpha = lambda ctx: 0.9
        for _ in range(40):
            agent.observe(worker.step(chain3, 4, 300))
            await asyncio.sleep(0.005)
        await wait_for(lambda: effective_samples(server, "heads-b") > 0, timeout=30)
        state = server.controller.workers["w-roll"]
        assert state.limits.max_depth == 3
        assert agent.stats.reconnects == reconnects  # the same stream carried the roll
        # A plan for the new drafter arrives, within its limits.
        await wait_for(lambda: agent.plan_version > version_at_roll, timeout=30)
        assert all(d.depth <= 3 for d in agent.table.decisions)
    finally:
        agent.close()


def test_reading_a_stratum_before_any_evidence_does_not_erase_the_first_evidence():
    """Found with the roll test: a status read created the stratum with clock
    0, so the first forgetting tick decayed the first batch of evidence by
    decades of half-lives."""
    from controller.models.acceptance import AcceptanceModel

    model = AcceptanceModel((0, 1024), half_life_s=120.0)
    model.view(("eagle", "v1"), 4, 1)  # an operator's status read, before any telemetry
    now = 1.8e9
    for posterior in model.strata(("eagle", "v1"), 4, 1, now):
        posterior.observe_chain(4, 2, count=50)
    model.tick(now + 1.0)
    assert model.view(("eagle", "v1"), 4, 1).effective_samples(0)[0] > 49
