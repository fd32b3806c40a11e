"""The monitor off the ingest path: a hashed subset of requests kept whole, a
bounded buffer, a CPU budget with overruns paid back, a subset that shrinks to
the budget and grows back; watchers that fall behind are ended, not waited
for. Time is a fake clock the fake monitor advances, so nothing here depends
on the machine's speed."""

from __future__ import annotations

from types import SimpleNamespace

from controller.alerts.alerting import DriftAlerting, MonitorFeed, WatcherOverflow, is_sampled
from controller.alerts.sinks import LogSink
from controller.alerts.store import StateStore
from controller.drift import AcceptanceDriftMonitor
from controller.protocol import RequestRow
from tests.test_drift_monitor import FAST
from tests.test_store import make_alert

LIMITS = SimpleNamespace(kind="eagle", version="v1", max_depth=6, max_width=1, trained_context_len=8192)


class CostlyMonitor:
    """Records what it is fed; each request-step costs ``cost_s`` on the fake timer."""

    def __init__(self, cost_s: float = 10e-6) -> None:
        self.now = 0.0
        self.cost_s = cost_s
        self.seen: list[tuple] = []
        self.clock = lambda: 1234.0
        self.calibration_s = 0.0  # CPU seconds calibrating (AcceptanceDriftMonitor's): none here

    def timer(self) -> float:
        return self.now

    def observe_request(self, limits, ctx, accepted, depth, ranks, cands, domain, now, worker) -> None:
        self.now += self.cost_s
        self.seen.append((worker, ctx, accepted, depth, ranks, cands, domain, now))


def step_of(request_ids: list[str], step_id: int, domain: str = "chat"):
    """A StepReport stand-in and its validated rows (depth-3 chains)."""
    rows = [RequestRow(rid, 100 + step_id, 3, 1, 3, step_id % 4, None, None, 3, 1, 3, 0, domain=domain)
            for rid in request_ids]
    step = SimpleNamespace(timestamp=float(step_id))
    return step, rows


def offer(feed: MonitorFeed, request_ids: list[str], steps: range, worker: str = "w0") -> None:
    state = SimpleNamespace(limits=LIMITS, worker_id=worker)
    for s in steps:
        feed.on_rows(state, *step_of(request_ids, s))


def test_a_hashed_subset_of_requests_is_monitored_with_every_one_of_its_steps() -> None:
    mon = CostlyMonitor()
    feed = MonitorFeed(mon, sample_fraction=0.25, timer=mon.timer, wall=mon.timer)
    ids = [f"req-{i}" for i in range(400)]
    offer(feed, ids, range(1, 11))
    assert feed.drain(budget_s=1.0) == feed.observed == len(mon.seen)
    kept = {rid for rid in ids if is_sampled(rid, 0.25)}
    assert 70 < len(kept) < 130
    assert len(mon.seen) == 10 * len(kept)  # every step of every kept request, nothing else
    assert mon.seen[0] == ("w0", 101, 1, 3, (), (), "chat", 1.0)  # rows reach observe_request in its order


def test_the_buffer_is_bounded_and_the_budget_is_kept_with_overruns_paid_back() -> None:
    unit = 2.0 ** -17  # ~7.6 µs, exact in binary so the sums below are exact
    mon = CostlyMonitor(cost_s=unit)
    full = MonitorFeed(mon, max_buffered=500, timer=mon.timer, wall=mon.timer)
    offer(full, [f"r{i}" for i in range(10)], range(1, 101))  # 1000 request-steps
    assert (full.buffered, full.dropped) == (500, 500)  # the oldest steps went
    feed = MonitorFeed(mon, adapt_every_s=1e9, timer=mon.timer, wall=mon.timer)
    offer(feed, [f"r{i}" for i in range(10)], range(1, 101))
    budget = 100 * unit
    assert feed.drain(budget) == 100  # whole steps until the budget is spent
    # One step costing 5 budgets (a recalibration) overruns: the next four ticks pay it back.
    mon.cost_s = 50 * unit
    assert feed.drain(budget) == 10
    mon.cost_s = unit
    assert [feed.drain(budget) for _ in range(5)] == [0, 0, 0, 0, 100]


def test_an_owner_sheds_inbound_evidence_past_its_limit_and_its_reader_moves_on() -> None:
    """Several replicas: the monitor's owner keeps at most ``inbound_limit`` request-steps queued; the
    oldest beyond it are dropped and counted, and their callbacks still run (the fleet's reader moves
    its cursor past them), so fresh evidence is not stuck behind a backlog."""
    mon = CostlyMonitor(cost_s=10e-6)
    feed = MonitorFeed(mon, timer=mon.timer, wall=mon.timer)
    feed.forward = lambda *args: None
    feed.inbound_limit = 300
    done: list[int] = []
    for i in range(10):  # 10 entries of 100 request-steps
        kept = [(100, 1, 3, (), (), "chat")] * 100
        feed.push_inbound(LIMITS, f"w{i}", float(i), kept, lambda i=i: done.append(i))
    fed = feed.drain(budget_s=1e-3)  # 100 request-steps of work
    assert feed.dropped == 700 and done[:7] == list(range(7))  # the 7 oldest shed, in order
    assert fed == 100 and [w for w, *_ in mon.seen[:1]] == ["w7"]  # then the freshest are observed
    assert feed.inbound_buffered == 200


def test_the_feed_keeps_calibrations_out_of_its_cost_per_step() -> None:
    mon = CostlyMonitor(cost_s=10e-6)
    feed = MonitorFeed(mon, adapt_every_s=0.0, timer=mon.timer, wall=mon.timer)  # a resizing window a drain
    observe = mon.observe_request

    def calibrating(*args) -> None:  # the 50th request-step completes a baseline: 40 ms of calibration
        observe(*args)
        if len(mon.seen) == 50:
            mon.now += 0.04
            mon.calibration_s += 0.04
    mon.observe_request = calibrating
    offer(feed, [f"r{i}" for i in range(10)], range(1, 11))
    feed.drain(budget_s=1.0)
    assert feed.observed == 100
    assert abs(feed.observe_total_s - 100 * 10e-6) < 1e-9  # the calibration is not a price per step
    assert abs(feed.spent_total_s - (100 * 10e-6 + 0.04)) < 1e-9  # but the budget paid for it
    # The price the subset is sized by is that one too (the fleet owner's CapacityEstimate prices a step alike).
    assert feed.cost_s is not None and abs(feed.cost_s - 10e-6) < 1e-12


def test_the_subset_shrinks_to_what_the_budget_affords_and_grows_back() -> None:
    mon = CostlyMonitor(cost_s=10e-6)
    feed = MonitorFeed(mon, sample_fraction=1.0, max_buffered=100_000, adapt_every_s=1.0, timer=mon.timer,
                       wall=mon.timer)
    ids = [f"req-{i}" for i in range(1000)]
    step = 0

    def tick(requests: list[str]) -> None:
        nonlocal step
        step += 1
        offer(feed, requests, range(step, step + 1))
        feed.drain(budget_s=1e-3)  # 1 ms of every 50 ms tick: 100 request-steps
        mon.now += 0.05 - 1e-3

    for _ in range(200):  # 1000 request-steps per tick at full sampling: the budget cannot follow
        tick(ids)
    fed = len(mon.seen)
    for _ in range(40):
        tick(ids)
    per_tick = (len(mon.seen) - fed) / 40
    assert 60 <= per_tick <= 100 and feed.fraction < 0.15  # ~80 % of the 100 the budget affords, of 1000
    assert feed.buffered <= 200 and feed.dropped > 0  # a backlog the budget cannot work off is dropped
    for _ in range(200):  # the load falls to 10 request-steps per tick
        tick(ids[:10])
    assert feed.fraction == 1.0


async def test_a_watcher_that_falls_behind_is_ended_and_the_others_keep_every_event() -> None:
    store = StateStore("")
    alerting = DriftAlerting(AcceptanceDriftMonitor(**FAST), store, [LogSink()], watch_queue_size=2)
    slow, fast = alerting.watch(), alerting.watch()
    got = []
    for i in range(1, 5):
        store.record_event("opened", make_alert(f"drift-{i:06d}").to_dict(), at=float(i))
        assert (await alerting.acknowledge(f"drift-{i:06d}", by="ops")).acked_by == "ops"
        got.append(await fast.get())
    assert [m.id for m in got] == [f"drift-{i:06d}" for i in range(1, 5)]
    assert [(await slow.get()).id for _ in range(2)] == ["drift-000001", "drift-000002"]
    try:
        await slow.get()
        raise AssertionError("the slow watcher should have been ended")
    except WatcherOverflow as err:
        assert "more than 2 events behind" in str(err)
    assert alerting.counts["watchers_overflowed"] == 1 and alerting.counts["acknowledged"] == 4
    # A second acknowledgement changes nothing and sends nothing.
    again = await alerting.acknowledge("drift-000001", by="someone else")
    assert again.acked_by == "ops" and fast.queue.empty()
    assert await alerting.acknowledge("drift-999999", by="ops") is None
    alerting.end_watches()
    assert await fast.get() is None
    await alerting.close()
