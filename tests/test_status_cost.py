"""What an operator's status read costs the fleet.

An all-workers ``GetStatus`` (and the status page, ``/status.json``) used to be
built in one go on the controller's event loop, refitting every worker's cost
model on every read: at 256 workers the loop stood still for 0.4-1 s, and with
it telemetry ingest and plan pushes. Now the response is built in slices that
yield to the loop between workers, and a worker's fitted cost model and plan
in force are rebuilt only when their inputs changed. These tests check the
behaviour (who runs when, what is recomputed), never a duration.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np

from controller.config import ServerConfig
from controller.core import Controller
from controller.observe import history
from controller.observe.history import StatusHistory
from controller.observe.http import Request
from controller.observe.web import StatusSite, render_page
from controller.service import SpeculationControllerServicer
from policies.outcome import FIRST_STATES, STATE_NAMES
from policies.presets import load_preset
from protos.speculation.v1 import controller_pb2, plan_pb2, worker_pb2
from tests.support import TRUTH, make_hello
from tests.test_request_states import _spans_controller

WORKERS = 6


def _step(state, clock: list[float], step_id: int, batch: int = 8, context_len: int = 900) -> worker_pb2.StepReports:
    requests = [worker_pb2.RequestStep(request_id=f"{state.worker_id}-r{i}", context_len=context_len + step_id,
                                       depth=3, width=1, nodes=3, accepted=(step_id + i) % 4)
                for i in range(batch)]
    return worker_pb2.StepReports(steps=[worker_pb2.StepReport(
        step_id=step_id, timestamp=clock[0], batch_size=batch, draft_ms=TRUTH.draft_ms(3, batch * 3),
        verify_ms=TRUTH.verify_ms(batch * 4, batch * (context_len + step_id)), requests=requests)])


def _fleet(workers: int = WORKERS, steps: int = 40) -> tuple[Controller, list[float]]:
    """A controller with ``workers`` workers, ``steps`` steps each, every one with an acknowledged plan."""
    clock = [1000.0]
    ctl = Controller(ServerConfig(), load_preset("goodput"), clock=lambda: clock[0])
    for w in range(workers):
        state = ctl.hello(make_hello(f"w{w}"))
        for i in range(1, steps + 1):
            clock[0] += 0.02
            assert not ctl.ingest(state, _step(state, clock, i))
        for update in ctl.plan_updates(state, force=True):
            if isinstance(update, plan_pb2.Plan):
                assert ctl.ack(state, worker_pb2.Ack(version=update.version, nonce=update.nonce)) is None
    return ctl, clock


class _CountingRefit:
    """Wraps one worker's ``StepCostModel.refit`` and counts the calls."""

    def __init__(self, cost) -> None:
        self.calls = 0
        self._refit = cost.refit
        cost.refit = self

    def __call__(self):
        self.calls += 1
        return self._refit()


# ------------------------------------------------------- the loop goes on
async def test_all_workers_status_lets_a_step_report_in_while_it_is_built():
    """A step report that arrives while an all-workers status is being built
    is ingested before the build ends: the workers built after it show it."""
    ctl, clock = _fleet()
    last = ctl.workers[f"w{WORKERS - 1}"]
    before = last.steps_ingested
    ran_during_build = []

    async def report_arrives() -> None:
        clock[0] += 0.02
        assert not ctl.ingest(last, _step(last, clock, before + 1))
        ran_during_build.append(True)

    task = asyncio.get_running_loop().create_task(report_arrives())
    response = await ctl.status_async("", slice_s=0.0)  # yield after every worker
    assert ran_during_build == [True], "the report waited for the whole status to be built"
    await task
    [entry] = [w for w in response.workers if w.hello.worker_id == last.worker_id]
    assert entry.steps_ingested == before + 1
    assert len(response.workers) == WORKERS


async def test_get_status_rpc_yields_to_the_loop_between_workers():
    """The gRPC handler builds its answer the same way: another coroutine runs
    before ``GetStatus`` returns, and the answer is the one ``status`` gives."""
    ctl, _ = _fleet()
    servicer = SpeculationControllerServicer(ctl)
    turns = []

    async def other_work() -> None:
        for _ in range(3):
            turns.append(len(turns))
            await asyncio.sleep(0)

    task = asyncio.get_running_loop().create_task(other_work())
    response = await servicer.GetStatus(controller_pb2.GetStatusRequest(), None)
    assert turns, "GetStatus held the event loop until it was done"
    await task
    assert response == ctl.status("")
    one = await servicer.GetStatus(controller_pb2.GetStatusRequest(worker_id="w2"), None)
    assert [w.hello.worker_id for w in one.workers] == ["w2"]


async def test_a_status_build_yields_after_the_worker_in_hand_while_a_plan_waits_for_its_writer():
    """With a slice far longer than the whole build, an all-workers status
    holds the loop to the end, unless a plan is waiting for its stream's
    writer (``Controller.plan_waiting``, the servicer's plans on the way):
    then it yields after the worker in hand, so the writer goes before the
    rest of the build."""
    ctl, _ = _fleet()

    async def turns_during_build(waiting: bool) -> list[int]:
        ctl.plan_waiting = lambda: waiting
        seen: list[int] = []
        built = [0]

        async def writer() -> None:  # stands for the writer: notes how far the build had got
            for _ in range(WORKERS):
                seen.append(built[0])
                await asyncio.sleep(0)

        task = asyncio.get_running_loop().create_task(writer())
        async for i, _ in ctl.in_slices(list(ctl.workers.values()), slice_s=1e9):
            built[0] = i + 1
        task.cancel()
        return seen

    assert await turns_during_build(False) == []  # ran only once the build was done
    assert (await turns_during_build(True))[0] == 1  # right after the first worker
    servicer = SpeculationControllerServicer(ctl)
    assert ctl.plan_waiting() is False  # the servicer's plans on the way: none yet
    servicer.on_the_way.streams.add(object())
    assert ctl.plan_waiting() is True


async def test_a_worker_that_leaves_during_the_build_is_skipped():
    ctl, _ = _fleet()

    async def leaves() -> None:
        del ctl.workers[f"w{WORKERS - 1}"]

    task = asyncio.get_running_loop().create_task(leaves())
    response = await ctl.status_async("", slice_s=0.0)
    await task
    assert [w.hello.worker_id for w in response.workers] == [f"w{i}" for i in range(WORKERS - 1)]


async def test_status_json_is_built_in_slices_too(monkeypatch):
    """``/status.json`` (and the page, same snapshot) yields between workers."""
    ctl, clock = _fleet()
    site = StatusSite(ctl)
    site.history.sample_due(5.0, 10.0)
    last = ctl.workers[f"w{WORKERS - 1}"]
    before = last.counters.steps_total

    async def report_arrives() -> None:
        clock[0] += 0.02
        assert not ctl.ingest(last, _step(last, clock, last.steps_ingested + 1))

    monkeypatch.setattr(history, "SNAPSHOT_SLICE_S", 0.0)  # yield after every worker
    task = asyncio.get_running_loop().create_task(report_arrives())
    response = await site.status_json(Request("GET", "/status.json", {}, {}))
    await task
    [entry] = [w for w in json.loads(response.body)["workers"] if w["worker_id"] == last.worker_id]
    assert entry["steps"] == before + 1


# ------------------------------------------------ nothing recomputed twice
def test_status_refits_a_cost_model_only_after_new_steps():
    ctl, clock = _fleet(workers=2)
    state = ctl.workers["w0"]
    counter = _CountingRefit(state.cost)
    first = ctl.status("")
    assert counter.calls == 1
    again = ctl.status("")
    one = ctl.status("w0")
    assert counter.calls == 1, "a status read refitted a cost model that had no new evidence"
    assert again == first and one.workers[0] == first.workers[0]

    # A step lands: the next read refits and shows it.
    samples = first.workers[0].cost_model.samples
    clock[0] += 0.02
    assert not ctl.ingest(state, _step(state, clock, state.steps_ingested + 1, context_len=20_000))
    after = ctl.status("w0").workers[0]
    assert counter.calls == 2
    assert after.steps_ingested == first.workers[0].steps_ingested + 1
    # The step is in the fit (it is folded by the refit, so `samples` covers it).
    assert after.cost_model.samples == samples + 1
    assert after.cost_model != first.workers[0].cost_model


def test_cached_entries_equal_a_fresh_build():
    """A read served from the cache is the entry a cold build gives."""
    ctl, _ = _fleet(workers=3)
    ctl.status("")
    warm = ctl.status("")  # every worker's cost model and plan from the cache
    ctl._status_cache.clear()
    assert ctl.status("") == warm


def test_a_new_plan_and_a_new_prior_show_at_the_next_read():
    ctl, clock = _fleet(workers=1, steps=60)
    state = ctl.workers["w0"]
    first = ctl.status("w0").workers[0]
    assert first.plan.version == state.plans.acked_version > 0
    # A new plan acknowledged: the status shows it.
    clock[0] += 30.0
    acked = None
    for update in ctl.plan_updates(state, force=True):
        if isinstance(update, plan_pb2.Plan):
            assert ctl.ack(state, worker_pb2.Ack(version=update.version, nonce=update.nonce)) is None
            acked = update.version
    assert acked is not None and acked != first.plan.version
    assert ctl.status("w0").workers[0].plan.version == acked
    # A new prior (a replica's fleet-wide fit) without a step: refitted and shown.
    counter = _CountingRefit(state.cost)
    from dataclasses import replace
    state.cost.prior = replace(state.cost.prior, draft_fixed_ms=state.cost.prior.draft_fixed_ms + 5.0)
    ctl.status("w0")
    assert counter.calls == 1


def test_forgotten_workers_leave_the_cache():
    ctl, _ = _fleet(workers=3)
    ctl.status("")
    del ctl.workers["w1"]
    ctl.status("")
    assert set(ctl._status_cache) == {"w0", "w2"}


# --------------------------------------------- request-state tables shown
def test_status_json_and_page_show_the_plans_later_state_tables():
    """The plan's per-request-state tables, ``state_tables`` and ``later_state_tables``
    (RESTING, OTHER), are in ``/status.json`` as in ``GetStatus`` and drawn on the page."""
    ctl, state = _spans_controller(correlated=True)
    for update in ctl.plan_updates(state, force=True):
        if isinstance(update, plan_pb2.Plan):
            assert ctl.ack(state, worker_pb2.Ack(version=update.version, nonce=update.nonce)) is None
    proto_plan = ctl.status(state.worker_id).workers[0].plan
    assert proto_plan.later_state_tables, "this controller's plan has no later state tables to show"
    snapshot = StatusHistory(ctl).snapshot(state.worker_id)
    plan = snapshot["workers"][0]["plan"]
    for field in ("state_tables", "later_state_tables"):
        entries = getattr(proto_plan, field)
        assert [t["state"] for t in plan[field]] == [e.state for e in entries], field
        columns = len(plan["context_edges"])
        for shown, sent in zip(plan[field], entries):
            assert shown["name"] == STATE_NAMES[sent.state]
            assert np.ravel(shown["depth"]).tolist() == [d.depth for d in sent.table]
            assert np.ravel(shown["width"]).tolist() == [d.width for d in sent.table]
            assert len(shown["depth"][0]) == columns
    assert all(t["state"] in FIRST_STATES for t in plan["state_tables"])
    assert {t["name"] for t in plan["later_state_tables"]} >= {"other"}
    html = render_page(snapshot)
    for t in plan["state_tables"] + plan["later_state_tables"]:
        assert f'id="state-{t["name"]}-{state.worker_id}"' in html
    assert "(later_state_tables)" in html
