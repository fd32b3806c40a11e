"""What ingest keeps per request in flight (issue #30).

Each active request has one record (:class:`controller.core.state.ActiveRequest`):
its context length, how far its drafter has seen it, its class and the request
state its last step left it in. Ingest finds all of it with one lookup a
request-step; the observation, ``finished`` and the LRU bound read the same
records. The drift monitor's ``domain`` travels on the validated row.
"""

from __future__ import annotations

from controller.alerts.alerting import MonitorFeed
from controller.config import ServerConfig
from controller.core.controller import Controller
from controller.protocol import validate_step
from policies.outcome import AFTER_HIT, AFTER_MISS, DEFAULT, RESTING, pack_state
from policies.presets import load_preset_text
from protos.speculation.v1 import worker_pb2
from tests.support import make_hello

POLICY = """
policy: static
classes:
  chat: {weight: 2}
  bulk: {weight: 1}
default_class: chat
"""


def _controller(max_active: int = 8192) -> tuple[Controller, list[float]]:
    clock = [0.0]
    config = ServerConfig(max_active_requests=max_active)
    ctl = Controller(config, load_preset_text(POLICY), clock=lambda: clock[0])
    return ctl, clock


def _step(step_id: int, *requests: worker_pb2.RequestStep, catch_up_ms: float = 0.0) -> worker_pb2.StepReports:
    return worker_pb2.StepReports(steps=[worker_pb2.StepReport(
        step_id=step_id, timestamp=float(step_id), batch_size=len(requests), draft_ms=1.0, verify_ms=10.0,
        catch_up_ms=catch_up_ms, requests=list(requests))])


def _chain(rid: str, ctx: int, depth: int, accepted: int, cls: str = "", **extra) -> worker_pb2.RequestStep:
    return worker_pb2.RequestStep(request_id=rid, context_len=ctx, depth=depth, width=1 if depth else 0,
                                  nodes=depth, accepted=accepted, request_class=cls, **extra)


def test_a_request_record_follows_its_steps() -> None:
    ctl, clock = _controller()
    state = ctl.hello(make_hello("w", max_depth=4))
    # "a" drafts and misses, "p" runs plain with an unknown class name (served as the default class).
    assert not ctl.ingest(state, _step(1, _chain("a", 100, 4, 0, "bulk"), _chain("p", 50, 0, 0, "nightly")))
    a, p = state.requests.active["a"], state.requests.active["p"]
    assert (a.context_len, a.drafted_through, a.class_name, a.state) == (100, 101, "bulk", AFTER_MISS)
    assert (p.context_len, p.drafted_through, p.class_name, p.state) == (50, 0, "chat", DEFAULT)
    # Its next steps: a plain step after a miss rests, and the record is the same object, updated.
    clock[0] = 1.0
    assert not ctl.ingest(state, _step(2, _chain("a", 101, 0, 0, "chat"), _chain("p", 51, 3, 3)))
    assert state.requests.active["a"] is a
    assert (a.context_len, a.drafted_through, a.class_name, a.state) == (101, 101, "chat", pack_state(RESTING, 1))
    assert (p.context_len, p.drafted_through, p.state) == (51, 55, AFTER_HIT)
    # The observation reads the records: contexts, classes and (a drafter that catches up) what is owed.
    assert not ctl.ingest(state, _step(3, _chain("a", 109, 2, 1, "chat", requested_depth=2, caught_up_tokens=8),
                                       _chain("p", 60, 0, 0), catch_up_ms=4.0))
    obs = ctl.observation(state, 2.0)
    assert dict(obs.active_requests) == {"a": 109, "p": 60}
    assert dict(obs.active_classes) == {"a": "chat", "p": "chat"}
    assert dict(obs.catch_up_owed) == {"a": 0, "p": 5}  # "p" drafted through 55 at step 2, plain since
    # A finished request is forgotten, and a report about it is refused.
    assert ctl.finished(state, worker_pb2.RequestFinished(request_id="a", generated_tokens=8, steps=3)) is None
    assert list(state.requests.active) == ["p"]
    assert ctl.ingest(state, _step(4, _chain("a", 112, 0, 0)))


def test_past_max_active_requests_the_least_recently_reported_goes() -> None:
    ctl, _ = _controller(max_active=16)
    state = ctl.hello(make_hello("w", max_depth=4))
    for i in range(16):
        assert not ctl.ingest(state, _step(i + 1, _chain(f"r{i}", 100, 2, 1)))
    # r0 is reported again (most recent now); two new ones push out r1 and r2, the least recent.
    assert not ctl.ingest(state, _step(17, _chain("r0", 103, 2, 2), _chain("n0", 10, 0, 0), _chain("n1", 10, 0, 0)))
    active = state.requests.active
    assert len(active) == 16 and "r1" not in active and "r2" not in active
    assert list(active)[-3:] == ["r0", "n0", "n1"]
    assert active["r0"].state == AFTER_HIT and active["r0"].context_len == 103


def test_the_domain_reaches_the_drift_feed_on_the_validated_row() -> None:
    requests = [_chain("x", 300, 3, 2, domain="code"), _chain("y", 300, 3, 1)]
    step = worker_pb2.StepReport(step_id=1, timestamp=1.0, batch_size=2, verify_ms=10.0, requests=requests)
    ctl, _ = _controller()
    state = ctl.hello(make_hello("w", max_depth=4))
    rows = validate_step(step, state.limits, "steps[0]", 0)
    assert [r.domain for r in rows] == ["code", ""]

    class Seen:
        cpu_clock = calibration_s = 0.0

    feed = MonitorFeed(Seen(), timer=lambda: 0.0, wall=lambda: 0.0)
    ctl.on_step_rows.append(feed.on_rows)
    assert not ctl.ingest(state, worker_pb2.StepReports(steps=[step]))
    [(_, worker, _, kept)] = feed._buffer
    assert worker == "w" and [k[-1] for k in kept] == ["code", ""]


def test_a_bad_request_is_named_by_its_index_in_the_step() -> None:
    ctl, _ = _controller()
    state = ctl.hello(make_hello("w", max_depth=4))
    bad = _chain("z", 300, 3, 2)
    bad.accepted_rank.extend([1, 1, 0])  # ranks on a width-1 chain: the full check, not the fast path
    bad.level_candidates.extend([1, 1, 1])
    bad.context_len = -1
    step = worker_pb2.StepReport(step_id=1, timestamp=1.0, batch_size=3, verify_ms=10.0,
                                 requests=[_chain("x", 300, 3, 2), _chain("y", 300, 0, 0), bad])
    [rejection] = ctl.ingest(state, worker_pb2.StepReports(steps=[step]))
    assert rejection.field.startswith("steps[0].requests[2].") and "-1" in rejection.detail, rejection
