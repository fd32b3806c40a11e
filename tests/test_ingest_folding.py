"""Acceptance evidence folded per interval, not per message (issue #30).

Ingest buffers acceptance evidence per drafter version (``WorkerState.evidence``,
shared by the version's workers) and :func:`controller.core.ingest.fold_evidence`
folds the buffers before any read of the acceptance models and at each
acceptance tick. These tests feed two controllers the same mixed telemetry (chains,
trees, offers, the typical rule, request classes, several workers and drafter
versions, ticks in between): one folds after every message, as ingest did
before the buffer; the other only when something reads. They must learn the
same thing.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from controller.config import ServerConfig
from controller.core.controller import Controller
from policies.presets import load_preset_text
from protos.speculation.v1 import plan_pb2, worker_pb2
from tests.support import make_hello

TYPICAL = plan_pb2.ACCEPTANCE_RULE_TYPICAL
POLICY = """
policy: static
classes:
  chat: {weight: 2}
  bulk: {weight: 1, acceptance: typical, typical_epsilon: 0.2, typical_delta: 0.5}
default_class: chat
"""
# (worker id, drafter version, max_depth, max_width): two workers share a version.
WORKERS = [("w0", "v1", 4, 2), ("w1", "v1", 4, 2), ("w2", "v2", 5, 1)]


def _request(rng: random.Random, rid: str, max_depth: int, max_width: int) -> worker_pb2.RequestStep:
    """A valid request-step of a random shape: off, a chain (τ shorthand), or a tree with its ranks;
    with or without the decision asked for, in a random class and acceptance rule."""
    ctx = rng.choice([100, 900, 3000, 9000, 20000])
    cls = rng.choice(["", "chat", "bulk", "bulk", "nightly"])  # "nightly": unknown, the default class
    rule = TYPICAL if rng.random() < 0.3 else 0  # typical for "chat" or "" is a violation
    shape = rng.choice(["off", "chain", "chain", "tree"] if max_width > 1 else ["off", "chain", "chain"])
    asked = rng.random() < 0.6
    if shape == "off":
        requested = rng.randint(1, max_depth) if asked else 0
        return worker_pb2.RequestStep(request_id=rid, context_len=ctx, requested_depth=requested,
                                      requested_width=rng.randint(1, max_width) if requested else 0,
                                      request_class=cls, acceptance_rule=rule)
    depth = rng.randint(1, max_depth)
    accepted = rng.randint(0, depth)
    width = rng.randint(1, max_width) if shape == "tree" else 1
    step = worker_pb2.RequestStep(request_id=rid, context_len=ctx, depth=depth, width=width, accepted=accepted,
                                  request_class=cls, acceptance_rule=rule)
    if shape == "tree":
        reached = accepted + 1 if accepted < depth else depth
        cands = [rng.randint(1, width) for _ in range(reached)]
        step.level_candidates.extend(cands)
        step.accepted_rank.extend(rng.randint(1, c) if i < accepted else 0 for i, c in enumerate(cands))
        step.nodes = min(sum(cands) + depth - reached, depth * max_width)
    else:
        step.nodes = depth
    if asked:
        step.requested_depth = rng.randint(depth, max_depth)
        step.requested_width = rng.randint(width, max_width)
        step.requested_nodes = rng.randint(step.nodes, max_depth * max_width)
    return step


def _telemetry(seed: int, messages: int) -> list[tuple[int, float, worker_pb2.StepReports]]:
    """(worker index, clock, message) in arrival order; the clock crosses several acceptance ticks."""
    rng = random.Random(seed)
    step_ids = [0] * len(WORKERS)
    out, now = [], 100.0
    for m in range(messages):
        w = rng.randrange(len(WORKERS))
        _, _, max_depth, max_width = WORKERS[w]
        now += rng.choice([0.01, 0.05, 0.3, 1.2])
        steps = []
        for _ in range(rng.randint(1, 5)):
            step_ids[w] += 1
            ids = rng.sample(range(12), rng.randint(1, 8))  # rotating ids; a request may sit a step out
            requests = [_request(rng, f"r{m // 40}-{i}", max_depth, max_width) for i in ids]
            steps.append(worker_pb2.StepReport(step_id=step_ids[w], timestamp=now, batch_size=len(requests) + 2,
                                               draft_ms=1.0, verify_ms=10.0 + len(requests), requests=requests))
        out.append((w, now, worker_pb2.StepReports(steps=steps)))
    return out


def _controller() -> tuple[Controller, list]:
    clock = [100.0]
    ctl = Controller(ServerConfig(), load_preset_text(POLICY), clock=lambda: clock[0])
    for worker_id, version, depth, width in WORKERS:
        ctl.hello(make_hello(worker_id, max_depth=depth, max_width=width, version=version))
    return ctl, clock


def _feed(ctl: Controller, clock: list, telemetry, fold_each: bool) -> None:
    states = [ctl.workers[w[0]] for w in WORKERS]
    for w, now, message in telemetry:
        clock[0] = now
        assert ctl.ingest(states[w], message) == []
        if fold_each:
            ctl.fold_evidence()


def _models(ctl: Controller) -> dict:
    """Every posterior of every acceptance model, without folding (the raw arrays)."""
    models = {"pooled": ctl.acceptance, "typical": ctl.acceptance_typical,
              **{f"state{s}": m for s, m in ctl.acceptance_by_state.models.items()}}
    return {name: {key: [(p.succ, p.fail, p.asked, p.offered, p.observations, p.updated_at) for p in buckets]
                   for key, buckets in model._strata.items()}
            for name, model in models.items()}


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].keys() == b[name].keys(), name
        for key in a[name]:
            for pa, pb in zip(a[name][key], b[name][key]):
                for xa, xb in zip(pa, pb):
                    assert np.allclose(xa, xb, rtol=1e-12, atol=1e-12), (name, key)


def test_deferred_folding_learns_what_folding_every_message_learns() -> None:
    telemetry = _telemetry(seed=3, messages=400)
    each, each_clock = _controller()
    deferred, deferred_clock = _controller()
    _feed(each, each_clock, telemetry, fold_each=True)
    _feed(deferred, deferred_clock, telemetry, fold_each=False)
    deferred.fold_evidence()
    got, want = _models(deferred), _models(each)
    assert want["typical"] and want["state1"] and want["pooled"][("eagle", "v1")][0][2]  # trees, offers, states
    _assert_same(got, want)
    assert deferred.accept_counts == each.accept_counts and sum(map(len, each.accept_counts.values())) > 10
    for w in WORKERS:
        a, b = deferred.workers[w[0]], each.workers[w[0]]
        assert a.counters.typical_request_steps == b.counters.typical_request_steps > 0
        assert a.counters.typical_violations == b.counters.typical_violations > 0


def test_a_read_of_the_models_folds_pending_evidence_first() -> None:
    telemetry = _telemetry(seed=5, messages=60)
    each, each_clock = _controller()
    deferred, deferred_clock = _controller()
    _feed(each, each_clock, telemetry, fold_each=True)
    _feed(deferred, deferred_clock, telemetry[:-1], fold_each=False)
    deferred_clock[0] = each_clock[0]  # the last message lands within the tick: nothing decays now
    w, _, last = telemetry[-1]
    state = deferred.workers[WORKERS[w][0]]
    deferred.ingest(state, last)
    assert state.evidence.first  # its version's buffer holds evidence the models lack
    # A status answer reads the models: it sees every step.
    status = {ws.hello.worker_id: ws for ws in deferred.status().workers}
    assert not state.evidence.first
    want = {ws.hello.worker_id: ws for ws in each.status().workers}
    for worker_id, ws in status.items():
        assert ws.acceptance == want[worker_id].acceptance
    _assert_same(_models(deferred), _models(each))
    # So does a plan: the observation the policy decides on.
    again, again_clock = _controller()
    _feed(again, again_clock, telemetry, fold_each=False)
    for worker_id, *_ in WORKERS:
        got = again.observation(again.workers[worker_id], again_clock[0])
        ref = each.observation(each.workers[worker_id], each_clock[0])
        assert [np.allclose(x, y) for x, y in zip(got.acceptance._params[0], ref.acceptance._params[0])] == [True] * 2
        assert got.acceptance_by_state.keys() == ref.acceptance_by_state.keys()
        for s, view in got.acceptance_by_state.items():
            assert np.allclose(view._params[1][0], ref.acceptance_by_state[s]._params[1][0])
    assert again.accept_counts == each.accept_counts


def test_class_sums_of_a_step_with_mixed_classes_are_per_request_step() -> None:
    """Rows of one class are summed per run; a step that alternates classes (and unknown names) sums
    to what adding each request-step on its own gives."""
    ctl, _ = _controller()
    state = ctl.workers["w2"]
    names = ["chat", "chat", "bulk", "", "nightly", "nightly", "other", "bulk", "chat"]
    accepted = [0, 1, 2, 3, 1, 0, 2, 3, 1]
    requests = [worker_pb2.RequestStep(request_id=f"r{i}", context_len=500, depth=3 if i % 4 else 0,
                                       width=1 if i % 4 else 0, nodes=3 if i % 4 else 0,
                                       accepted=a if i % 4 else 0, request_class=n)
                for i, (n, a) in enumerate(zip(names, accepted))]
    step = worker_pb2.StepReport(step_id=1, timestamp=1.0, batch_size=len(requests), draft_ms=1.0, verify_ms=10.0,
                                 requests=requests)
    assert ctl.ingest(state, worker_pb2.StepReports(steps=[step])) == []
    want: dict[str, list[float]] = {}
    for r in requests:
        cls = "bulk" if r.request_class == "bulk" else "chat"  # "", unknown names: the default class
        sums = want.setdefault(cls, [0.0] * 5)
        for i, v in enumerate((1, 1 + r.accepted, 11.0, 1 if r.depth else 0, r.accepted)):
            sums[i] += v
    for cls, (steps, tokens, step_ms, drafted, acc) in want.items():
        cs = state.classes.stats[cls]
        assert (cs.steps, cs.tokens, cs.drafted, cs.accepted) == (steps, tokens, drafted, acc), cls
        assert cs.step_ms == pytest.approx(step_ms)
    assert state.counters.unknown_class_request_steps == 3  # "nightly" twice, "other" once
    assert state.classes.last_unknown == "other"


def test_a_version_widened_within_a_fold_keeps_the_evidence_buffered_before() -> None:
    """The one deliberate difference from folding every message: two workers of one drafter
    version with different limits, folded together, both keep their evidence in the widened
    strata (remade for the wider drafter at its first ingest, as then); folded one message at a
    time, that remade strata would hold only what came after."""
    ctl, clock = _controller()
    narrow = ctl.hello(make_hello("n", max_depth=3, version="v9"))
    wide = ctl.hello(make_hello("m", max_depth=6, version="v9"))
    # The first ingest ticks (and so folds) at once: another worker's, so that the two land in one fold.
    for i, state in enumerate((ctl.workers["w2"], narrow, wide)):
        clock[0] = 100.0 + 0.1 * i
        step = worker_pb2.StepReport(step_id=1, timestamp=1.0, batch_size=2, draft_ms=1.0, verify_ms=10.0, requests=[
            worker_pb2.RequestStep(request_id=f"{state.worker_id}-{j}", context_len=200, depth=3, width=1, nodes=3,
                                   accepted=j) for j in range(2)])
        assert ctl.ingest(state, worker_pb2.StepReports(steps=[step])) == []
    buckets = ctl.acceptance.peek(("eagle", "v9"))  # a read: folds both workers' buffers
    assert buckets[0].max_depth == 6 and buckets[0].updated_at == pytest.approx(100.2)
    assert buckets[0].observations == 4  # both workers' two request-steps
    assert ctl.accept_counts[("n", "eagle", "v9")] == {(0, 3, 0): 1, (0, 3, 1): 1}


def test_a_stratum_made_by_a_fold_starts_when_its_first_evidence_came() -> None:
    """As when each message was folded at once: a drafter version's strata start at the clock of the
    ingest that first brought evidence for each model (their first decay spans from then), not at the fold."""
    ctl, clock = _controller()
    first = ctl.hello(make_hello("a", max_depth=3, version="v7"))
    for worker_id, at, rule, cls in (("w2", 100.0, 0, ""), ("a", 100.3, 0, ""), ("a", 100.6, TYPICAL, "bulk")):
        clock[0] = at  # the first ingest ticks at once (w2's); the others land within that tick
        state = ctl.workers[worker_id]
        state_step = state.session.last_step_id + 1
        step = worker_pb2.StepReport(step_id=state_step, timestamp=1.0, batch_size=1, draft_ms=1.0, verify_ms=10.0,
                                     requests=[worker_pb2.RequestStep(request_id=f"{worker_id}-r", context_len=200,
                                                                      depth=3, width=1, nodes=3, accepted=1,
                                                                      request_class=cls, acceptance_rule=rule)])
        assert ctl.ingest(state, worker_pb2.StepReports(steps=[step])) == []
    clock[0] = 100.9
    assert first.evidence.first  # nothing folded yet
    assert ctl.acceptance.peek(("eagle", "v7"))[0].updated_at == 100.3  # a read folds
    assert ctl.acceptance_typical.peek(("eagle", "v7"))[0].updated_at == 100.6
    assert ctl.acceptance_by_state.models[0].peek(("eagle", "v7"))[0].updated_at == 100.3
