"""Controller logic without gRPC: the cost fit against the simulator's
roofline, and plan pushes that neither flap nor exceed the interval."""

from __future__ import annotations

import numpy as np
import pytest

from controller.models.acceptance import offer_slots
from controller.config import PlanSettings, ServerConfig
from controller.core import Controller
from controller.models.cost import CostParams, StepCostModel
from policies.presets import load_preset
from tests.support import SyntheticWorker, make_hello
from worker.sdk.agent import compile_plan, step_to_proto
from worker.sim.hardware import CostModel
from policies.table import Decision, DecisionTable, bucket_index
from protos.speculation.v1 import plan_pb2, worker_pb2


@pytest.mark.parametrize("hardware", ["H100-SXM", "H200"])
def test_cost_fit_reproduces_the_simulators_three_regimes(hardware: str) -> None:
    truth = CostModel(hardware=hardware, noise_sigma=0.03)
    rng = np.random.default_rng(0)
    model = StepCostModel(prior=CostParams.from_hardware(3350, 989, 16e9, 131072, 8e9))
    for _ in range(3000):
        batch = int(rng.choice([1, 2, 4, 8, 16, 32, 64, 128, 256]))
        tokens = batch * int(rng.integers(1, 6))
        ctx = float(rng.choice([500, 2000, 8000, 32000]))
        model.observe_verify(tokens, batch * ctx, truth.noisy(truth.verify_ms(tokens, batch * ctx), rng))
    fit = model.refit()
    for batch, per_request, ctx in [(1, 1, 500), (1, 5, 500), (256, 1, 500), (256, 4, 500), (64, 4, 32000)]:
        tokens, kv = batch * per_request, batch * ctx
        assert fit.verify_ms(tokens, kv) == pytest.approx(truth.verify_ms(tokens, kv), rel=0.08), (batch, per_request, ctx)
    # The regimes: verifying 5 tokens at batch 1 is nearly free; at batch 256 and
    # short context each extra token costs; at long context it is nearly free again.
    assert fit.verify_ms(5, 500) / fit.verify_ms(1, 500) < 1.05
    assert fit.verify_ms(1024, 256 * 500) / fit.verify_ms(256, 256 * 500) > 2.0
    assert fit.verify_ms(256, 64 * 32000) / fit.verify_ms(64, 64 * 32000) < 1.05


def test_steady_telemetry_does_not_flap_plans() -> None:
    clock = [0.0]
    config = ServerConfig(plan=PlanSettings(recompute_interval_s=0.5, min_push_interval_s=5.0, hysteresis=0.02))
    ctl = Controller(config, load_preset("goodput"), clock=lambda: clock[0])
    state = ctl.hello(make_hello("steady", max_depth=6))
    worker = SyntheticWorker(lambda ctx: 0.75, seed=5)
    pushes: list[float] = []
    table, applied = DecisionTable.uniform(Decision.off()), 0
    for i in range(3000):  # 300 s of steps at 10 per second
        clock[0] = i * 0.1
        batch = 4 + (i % 3)  # small, steady jitter in batch size
        step = worker.step(lambda rid, ctx, b: table.lookup(b, ctx), batch, 700)
        ctl.ingest(state, worker_pb2.StepReports(steps=[step_to_proto(step)]))
        for msg in ctl.plan_updates(state):
            if isinstance(msg, plan_pb2.Plan):
                table, applied = compile_plan(msg, state.hello, applied), msg.version
                pushes.append(clock[0])
    assert pushes, "no plan at all"
    gaps = np.diff(pushes)
    assert (gaps >= 5.0).all(), gaps  # never more often than min_push_interval_s
    assert len(pushes) <= 6, pushes  # settles: a handful of refinements, then quiet
    assert max(pushes) < 150.0, pushes  # the second half of the run pushed nothing


def test_draft_fit_follows_an_autoregressive_drafter_at_long_context() -> None:
    truth = CostModel(hardware="H200", drafter="eagle", noise_sigma=0.02)
    rng = np.random.default_rng(1)
    model = StepCostModel()
    for _ in range(2000):
        batch = int(rng.choice([1, 4, 16, 64]))
        depth = int(rng.integers(1, 7))
        ctx = float(rng.choice([500, 8000, 64000]))
        draft = truth.noisy(truth.draft_ms([depth] * batch, [1] * batch, [ctx] * batch), rng)
        model.observe_draft(depth, batch * depth, batch * depth * ctx, draft)
    fit = model.refit()
    for batch, depth, ctx in [(1, 2, 500), (16, 4, 8000), (64, 6, 64000)]:
        expected = truth.draft_ms([depth] * batch, [1] * batch, [ctx] * batch)
        got = fit.draft_ms(depth, batch * depth, batch, batch * depth * ctx)
        assert got == pytest.approx(expected, rel=0.15), (batch, depth, ctx)
    assert fit.draft_ms_per_level_kv_token > 0


def test_a_restarted_worker_may_number_its_steps_from_one_again() -> None:
    ctl = Controller(ServerConfig(), load_preset("goodput"))
    worker = SyntheticWorker(lambda ctx: 0.7, seed=2)
    state = ctl.hello(make_hello("w-restart"))
    steps = [step_to_proto(worker.step(lambda *_: Decision.chain(2), 2, 100)) for _ in range(5)]
    assert ctl.ingest(state, worker_pb2.StepReports(steps=steps)) == []
    stale = ctl.ingest(state, worker_pb2.StepReports(steps=steps[:1]))  # same stream: stale, refused
    assert [r.reason for r in stale] == [plan_pb2.REJECT_REASON_STALE_STEP]
    state = ctl.hello(make_hello("w-restart"))  # the process restarted: new Hello, ids from 1
    assert ctl.ingest(state, worker_pb2.StepReports(steps=steps[:2])) == []
    assert state.steps_ingested == 7


def test_workers_disconnected_long_enough_are_forgotten() -> None:
    now = [1000.0]
    ctl = Controller(ServerConfig(forget_worker_after_s=60), load_preset("goodput"), clock=lambda: now[0])
    for wid in ("gone", "back", "live"):
        ctl.hello(make_hello(wid))
    ctl.disconnect(ctl.workers["gone"])
    ctl.disconnect(ctl.workers["back"])
    now[0] += 30
    assert ctl.forget_idle_workers() == []
    ctl.hello(make_hello("back"))  # reconnected in time
    now[0] += 31
    assert ctl.forget_idle_workers() == ["gone"]
    assert sorted(ctl.workers) == ["back", "live"]
    assert not any(key[0] == "gone" for key in ctl.accept_counts)


def test_a_padded_worker_is_priced_by_the_tokens_its_forward_computes() -> None:
    """A worker whose forward pads every request's block to the largest: one
    request drafting 6 nodes in a batch of 4 costs what 4 × 7 tokens cost. The
    controller fits on batch · (1 + max nodes), so it predicts those steps; fed
    the same steps as a ragged worker (Σ (1 + nodes)), it could not."""
    def truth(tokens: float) -> float:
        return 50.0 + 2.0 * max(tokens - 4.0, 0.0)

    rng = np.random.default_rng(2)
    fits = {}
    for layout in (worker_pb2.VERIFY_LAYOUT_PADDED, worker_pb2.VERIFY_LAYOUT_PACKED):
        hello = make_hello(f"pad-{layout}", max_depth=6)
        hello.verify_layout = layout
        ctl = Controller(ServerConfig(), load_preset("goodput"), clock=lambda: 0.0)
        state = ctl.hello(hello)
        for i in range(600):
            batch = int(rng.choice([2, 4, 8]))
            deep = int(rng.integers(0, 7))  # only the first request drafts
            step = worker_pb2.StepReport(step_id=i + 1, timestamp=1.0, batch_size=batch, draft_ms=0.5,
                                         verify_ms=truth(batch * (1 + deep)) * rng.normal(1.0, 0.01))
            for j in range(batch):
                d = deep if j == 0 else 0
                step.requests.add(request_id=f"r{i}-{j}", context_len=300, depth=d, width=1 if d else 0, nodes=d,
                                  accepted=0)
            assert not ctl.ingest(state, worker_pb2.StepReports(steps=[step]))
        state.cost.refit()
        fits[layout] = state.cost
    padded = fits[worker_pb2.VERIFY_LAYOUT_PADDED].params
    for batch, deep in ((2, 3), (4, 6), (8, 1), (8, 6)):
        tokens = batch * (1 + deep)
        assert padded.verify_ms(tokens, batch * 300, tokens * 300) == pytest.approx(truth(tokens), rel=0.05)
    assert fits[worker_pb2.VERIFY_LAYOUT_PACKED].rmse_ms > 5 * fits[worker_pb2.VERIFY_LAYOUT_PADDED].rmse_ms


def test_the_controller_learns_how_often_a_drafter_offers_a_draft() -> None:
    """Prompt lookup offers a draft for 30 % of the requests that ask for one: the
    acceptance view's offer rate follows; requests that did not ask (depth 0,
    requested 0) do not count, and a worker that never says what it asked
    for keeps a rate of 1."""
    rng = np.random.default_rng(3)
    ctl = Controller(ServerConfig(), load_preset("goodput"), clock=lambda: 0.0)
    lookup = ctl.hello(make_hello("lookup", kind=worker_pb2.DRAFTER_KIND_NGRAM, version="ngram"))
    silent = ctl.hello(make_hello("silent", version="eagle-x"))
    for i in range(1500):
        for state, asks in ((lookup, True), (silent, False)):
            step = worker_pb2.StepReport(step_id=i + 1, timestamp=1.0, batch_size=2, draft_ms=0.1, verify_ms=10.0)
            offered = rng.random() < 0.3
            step.requests.add(request_id=f"a{i}", context_len=300, depth=2 if offered else 0, width=1 if offered else 0,
                              nodes=2 if offered else 0, accepted=1 if offered else 0,
                              requested_depth=2 if asks else 0)
            step.requests.add(request_id=f"b{i}", context_len=300)  # off, never asked
            assert not ctl.ingest(state, worker_pb2.StepReports(steps=[step]))
    view = ctl.acceptance.view(lookup.drafter_key, 6, 1)
    assert view.offer_rate(0) == pytest.approx(0.3, abs=0.04)
    assert ctl.acceptance.view(silent.drafter_key, 6, 1).offer_rate(0) == 1.0


def test_the_controller_learns_which_candidate_slots_a_drafter_fills() -> None:
    """Asked for d4 w4 n12 trees, a prompt-lookup worker finds one continuation
    (a chain of 4, accepting 2) 90 % of the time and two that part at level 1
    and end at level 2 the rest (2 + 2 nodes, both accepted along the second).
    The offer cells follow: a second candidate at level 1 for 10 % of the
    steps, never a third; a first one at level 2 whenever level 2 is reached,
    at level 3 only on the chain. A worker whose trees spend
    their node budget tells nothing about the slots it left out, and one that
    does not report the width asked for keeps every cell at 1."""
    rng = np.random.default_rng(5)
    ctl = Controller(ServerConfig(), load_preset("goodput"), clock=lambda: 0.0)
    lookup = ctl.hello(make_hello("lookup", max_width=4, max_nodes=16, kind=worker_pb2.DRAFTER_KIND_NGRAM,
                                  version="ngram"))
    heads = ctl.hello(make_hello("heads", max_width=4, max_nodes=16, version="eagle-x"))
    silent = ctl.hello(make_hello("silent", max_width=4, max_nodes=16, version="eagle-y"))
    asked = dict(requested_depth=4, requested_width=4, requested_nodes=12)
    for i in range(1, 1001):
        def step(**request) -> worker_pb2.StepReports:
            s = worker_pb2.StepReport(step_id=i, timestamp=1.0, batch_size=1, draft_ms=0.1, verify_ms=10.0)
            s.requests.add(request_id=f"r{i}", context_len=300, **request)
            return worker_pb2.StepReports(steps=[s])

        if rng.random() < 0.9:
            assert not ctl.ingest(lookup, step(depth=4, width=1, nodes=4, accepted=2, **asked))
        else:
            assert not ctl.ingest(lookup, step(depth=2, width=2, nodes=4, accepted=2, accepted_rank=[2, 1],
                                               level_candidates=[2, 1], **asked))
        # Budget spent (12 of 12): the missing siblings are not evidence.
        spent = dict(depth=4, width=4, nodes=12, accepted=0, accepted_rank=[0], level_candidates=[3])
        assert not ctl.ingest(heads, step(**spent, **asked))
        assert not ctl.ingest(silent, step(depth=4, width=4, nodes=12, accepted=0, accepted_rank=[0],
                                           level_candidates=[3], requested_depth=4))
    offer = ctl.acceptance.view(lookup.drafter_key, 4, 4).offer_probs(0)
    assert offer[0, 0] == pytest.approx(1.0)
    assert offer[0, 1] == pytest.approx(0.1, abs=0.03)
    assert offer[0, 2] < 0.01 and offer[0, 3] < 0.01
    assert offer[1, 0] == pytest.approx(1.0)
    assert offer[2, 0] == pytest.approx(0.9, abs=0.03)  # under the accepted leaf at level 2: nothing
    assert offer[1, 1] < 0.01
    assert offer[3, 0] == pytest.approx(1.0)  # level 4 never reached: untested
    assert np.allclose(ctl.acceptance.view(heads.drafter_key, 4, 4).offer_probs(0), 1.0)
    assert np.allclose(ctl.acceptance.view(silent.drafter_key, 4, 4).offer_probs(0), 1.0)


def test_offer_slots_of_each_step_shape() -> None:
    """Which asked-for slots a step tells about, and what it says."""
    # Asked d3 w2 n6, nothing offered: neither candidate at level 1.
    assert offer_slots(0, 0, 0, None, None, 3, 2, 6) == [(0, 1, False)]
    # A tree whose path took rank 2 at level 1 and ended at a leaf there.
    assert offer_slots(2, 1, 3, [2], [2], 3, 2, 6) == [(0, 1, True), (1, 0, False), (1, 1, False)]
    # Refused at level 2 of three with one candidate there: rank 2 was missing.
    assert offer_slots(3, 1, 4, [1, 0], [2, 1], 3, 2, 6) == [(0, 1, True), (1, 0, True), (1, 1, False)]
    # The same with the budget spent: only what was offered counts.
    assert offer_slots(3, 1, 6, [1, 0], [2, 1], 3, 2, 6) == [(0, 1, True), (1, 0, True)]
    # Width not reported (an older worker), or a chain asked for depth 1: nothing past a draft at all.
    assert offer_slots(3, 1, 4, [1, 0], [2, 1], 3, 0, 0) == []
    assert offer_slots(1, 1, 1, None, None, 1, 1, 1) == []


def test_a_calibrated_worker_starts_from_its_own_cost_curve() -> None:
    """A worker whose forward costs 60 ms up to 6 tokens and 72 ms from the 7th
    sends those times in its Hello. Before any step the controller prices 6
    tokens at 60 ms and 7 at 72 (a roofline prior cannot know the step), and
    says it is sure of both; a reconnect does not count them again. A sample
    with a bad field refuses the Hello, naming it."""
    from controller.protocol import Invalid, validate_hello

    def truth(tokens: int) -> float:
        return 60.0 if tokens <= 6 else 72.0 + 2.0 * (tokens - 7)

    hello = make_hello("cal", max_depth=6)
    shapes = [(1, n) for n in range(1, 13)] + [(4, 4), (4, 8), (4, 12)]
    for batch, tokens in shapes:
        hello.calibration.add(batch_size=batch, batch_tokens=tokens, kv_tokens=batch * 128,
                              verify_ms=truth(tokens), repeats=3)
    ctl = Controller(ServerConfig(), load_preset("goodput"), clock=lambda: 0.0)
    state = ctl.hello(hello)
    fit = state.cost.refit()
    assert state.cost.calibration_samples == len(shapes) and state.cost.samples == 0
    for tokens in (1, 6, 7, 12):
        assert fit.verify_ms(tokens, 128, 128 * tokens) == pytest.approx(truth(tokens), rel=0.03)
    knots = list(fit.compute_knots)
    assert fit.compute_evidence[knots.index(6.0)] == 3 and fit.compute_evidence[knots.index(40.0)] == 0
    assert fit.verify_sd_ms(6) == pytest.approx(fit.verify_rmse_ms / 2) and fit.verify_sd_ms(40) == fit.verify_rmse_ms
    assert ctl.hello(hello) is state and state.cost.calibration_samples == len(shapes)

    bad = make_hello("cal-bad", max_depth=6)
    bad.calibration.add(batch_size=1, batch_tokens=1, kv_tokens=10, verify_ms=50.0, repeats=1)
    bad.calibration.add(batch_size=4, batch_tokens=2, kv_tokens=10, verify_ms=50.0, repeats=1)
    with pytest.raises(Invalid) as err:
        validate_hello(bad)
    assert err.value.field == "hello.calibration[1].batch_tokens" and "2 must be in batch_size (4)" in err.value.detail
    bad.calibration[1].batch_tokens = 8
    bad.calibration[1].verify_ms = float("nan")
    with pytest.raises(Invalid, match="nan"):
        ctl.hello(bad)
    assert "cal-bad" not in ctl.workers


def test_a_load_jump_gets_the_new_row_pushed_before_the_mean_batch_catches_up() -> None:
    """Hours at batch 4, then the batch jumps to 8. The new plan differs from
    the one in force only in the batch-8 row. Judged at the mean batch alone
    (still ~4) the two tables are equal and the stale batch-8 row would keep
    running until the mean caught up; judged at the last step's batch too, the
    new plan is pushed at the first step of batch 8, and not before."""
    from policies.base import PlanDraft, Policy

    class Scripted(Policy):
        name = "scripted"
        model_based = True

        def __init__(self) -> None:
            super().__init__(None)
            self.table = DecisionTable.uniform(Decision.off())

        def initial_state(self, seed: int = 0):
            return None

        def decide(self, state, obs):
            return PlanDraft(self.table), state

    clock = [0.0]
    policy = Scripted()
    ctl = Controller(ServerConfig(plan=PlanSettings(recompute_interval_s=0.0, min_push_interval_s=0.0,
                                                    hysteresis=0.02)), policy, clock=lambda: clock[0])
    state = ctl.hello(make_hello("jump", max_depth=6))
    worker = SyntheticWorker(lambda ctx: 0.8, seed=1)

    def step(batch: int) -> list:
        clock[0] += 0.1
        ctl.ingest(state, worker_pb2.StepReports(steps=[step_to_proto(worker.step(lambda *_: Decision.off(), batch,
                                                                                     500))]))
        return [m for m in ctl.plan_updates(state) if isinstance(m, plan_pb2.Plan)]

    pushed = [m for _ in range(300) for m in step(4)]
    assert len(pushed) == 1  # the first plan: off everywhere
    edges, contexts = state.plans.current.table.batch_edges, state.plans.current.table.context_edges
    eight = bucket_index(edges, 8)
    policy.table = DecisionTable.from_rows(
        [[Decision.chain(2) if b == eight else Decision.off() for _ in contexts] for b in range(len(edges))],
        edges, contexts)
    assert bucket_index(edges, 4) != eight
    assert step(4) == []  # at batch 4 the new row changes nothing
    [plan] = step(8)
    assert state.load.batch_ema < 5 and state.plans.current.table.lookup(8, 500) == Decision.chain(2)


def test_catch_up_is_fitted_per_token_counted_in_step_time_and_owed_per_request() -> None:
    """A worker whose drafter catches up (EAGLE) reports the tokens and the ms;
    the controller fits ms per token, counts the ms in the step's time (the
    observed goodput), and tells the policy what each active request owes:
    its context since its last drafting step, all of it if it never drafted."""
    ctl = Controller(ServerConfig(), load_preset("goodput"), clock=lambda: 0.0)
    state = ctl.hello(make_hello("eagle", max_width=2, max_nodes=8, version="eagle-c"))
    steps = worker_pb2.StepReports()
    # Step 1: both requests off. Step 2: "a" switches on and catches up on its
    # 120-token context in 6 ms. Step 3: "a" drafts again, nothing to catch up.
    for sid, (a_depth, a_caught, catch_ms) in enumerate([(0, 0, 0.0), (2, 120, 6.0), (2, 0, 0.0)], start=1):
        s = steps.steps.add(step_id=sid, timestamp=float(sid), batch_size=2, draft_ms=1.0, verify_ms=20.0,
                            catch_up_ms=catch_ms)
        ctx_a = 119 + sid
        a = s.requests.add(request_id="a", context_len=ctx_a, requested_depth=a_depth, caught_up_tokens=a_caught)
        if a_depth:
            a.depth, a.width, a.nodes, a.accepted = 2, 1, 2, 0
        s.requests.add(request_id="b", context_len=50 + sid)
    assert not ctl.ingest(state, steps)
    assert state.cost.refit().catch_up_ms_per_token == pytest.approx(6.0 / 120)
    assert state.counters.step_ms_total == pytest.approx(3 * 21.0 + 6.0)
    assert sum(s.catch_up_ms for s in state.requests.recent_steps) == pytest.approx(6.0)
    status = ctl.worker_status(state)
    assert status.cost_model.catch_up_ms_per_token == pytest.approx(0.05)
    # "a" drafted at context 122 and accepted nothing: its drafter holds 123
    # tokens; one more step off at context 125 owes 2. "b" never drafted.
    more = worker_pb2.StepReports()
    s = more.steps.add(step_id=4, timestamp=4.0, batch_size=2, draft_ms=0.0, verify_ms=20.0)
    s.requests.add(request_id="a", context_len=125)
    s.requests.add(request_id="b", context_len=54)
    assert not ctl.ingest(state, more)
    obs = ctl.observation(state, 4.0)
    assert dict(obs.catch_up_owed) == {"a": 2, "b": 54}
    medusa = ctl.hello(make_hello("medusa", version="medusa-c"))  # drafts without catching up
    assert not ctl.ingest(medusa, worker_pb2.StepReports(steps=[worker_pb2.StepReport(
        step_id=1, timestamp=1.0, batch_size=1, verify_ms=20.0,
        requests=[worker_pb2.RequestStep(request_id="m", context_len=80)])]))
    assert ctl.observation(medusa, 1.0).catch_up_owed == {}
    assert obs.cost.catch_up_ms(100) == pytest.approx(5.0)
    ctl.finished(state, worker_pb2.RequestFinished(request_id="a", generated_tokens=6, steps=4, timestamp=5.0))
    assert "a" not in state.requests.active and "a" not in ctl.observation(state, 5.0).catch_up_owed
    # Refused: more tokens than the context, or tokens with no draft asked for.
    bad = worker_pb2.StepReports()
    s = bad.steps.add(step_id=5, timestamp=5.0, batch_size=1, verify_ms=20.0)
    s.requests.add(request_id="b", context_len=55, requested_depth=2, caught_up_tokens=56)
    s = bad.steps.add(step_id=6, timestamp=6.0, batch_size=1, verify_ms=20.0)
    s.requests.add(request_id="b", context_len=55, caught_up_tokens=3)
    [over, unasked] = ctl.ingest(state, bad)
    assert over.field == "steps[0].requests[0].caught_up_tokens" and "56" in over.detail
    assert unasked.field == "steps[1].requests[0].caught_up_tokens" and "requested_depth" in unasked.detail


def test_a_drafter_with_a_catch_up_window_owes_at_most_the_window() -> None:
    """A drafter that runs only the newest ``Drafter.catch_up_window`` tokens
    it skipped (the reference EAGLE drafter's ``catch_up_window``) owes at
    most that many on a switch-on, however long the request was off; a
    window wider than the gap changes nothing. Without a window (0) the
    whole gap is owed (the test above)."""
    ctl = Controller(ServerConfig(), load_preset("goodput"), clock=lambda: 0.0)
    hello = make_hello("eagle", max_width=2, max_nodes=8, version="eagle-w")
    hello.drafter.catch_up_window = 16
    state = ctl.hello(hello)
    assert state.limits.catch_up_window == 16
    steps = worker_pb2.StepReports()
    s = steps.steps.add(step_id=1, timestamp=1.0, batch_size=3, draft_ms=1.0, verify_ms=20.0, catch_up_ms=1.6)
    a = s.requests.add(request_id="a", context_len=300, requested_depth=2, caught_up_tokens=16)
    a.depth, a.width, a.nodes, a.accepted = 2, 1, 2, 1
    s.requests.add(request_id="b", context_len=200)
    s.requests.add(request_id="c", context_len=10)
    s = steps.steps.add(step_id=2, timestamp=2.0, batch_size=3, verify_ms=20.0)
    for rid, ctx in (("a", 309), ("b", 201), ("c", 11)):
        s.requests.add(request_id=rid, context_len=ctx)
    assert not ctl.ingest(state, steps)
    # "a" holds 302 tokens (300 + 1 accepted + the root) and is at 309: 7 < 16.
    # "b" never drafted: 201 tokens skipped, 16 owed. "c": 11 < 16.
    assert dict(ctl.observation(state, 2.0).catch_up_owed) == {"a": 7, "b": 16, "c": 11}


def test_a_catch_up_window_out_of_range_is_refused_naming_the_field() -> None:
    from controller.protocol import MAX_CATCH_UP_WINDOW, Invalid, validate_hello

    hello = make_hello("eagle", version="eagle-w")
    hello.drafter.catch_up_window = MAX_CATCH_UP_WINDOW + 1
    with pytest.raises(Invalid) as err:
        validate_hello(hello)
    assert err.value.field == "hello.drafter.catch_up_window" and str(MAX_CATCH_UP_WINDOW + 1) in err.value.detail
    hello.drafter.catch_up_window = MAX_CATCH_UP_WINDOW
    validate_hello(hello)
