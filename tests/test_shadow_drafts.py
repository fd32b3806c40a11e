"""Shadow drafts (``speculation.v1.ShadowDraft``): acceptance evidence from
requests that do not draft.

- the SDK's bookkeeping (``worker.sdk.shadow``);
- the reference engine: every shadow it reports is what prompt lookup would
  have proposed at that point, judged against the tokens emitted after it
  (recomputed here from the final outputs with a fresh drafter); shadows
  change no output, greedy or sampled;
- the controller: a model fitted on traffic the drafter cannot follow says
  off; live traffic it can follow switches the plan on through shadows alone,
  and stays off without them; malformed shadows are refused naming the field,
  through a raw gRPC client; a relaxed row's shadow is counted, not used.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
import torch

from controller.config import PlanSettings, ServerConfig
from controller.core import Controller
from controller.protocol import validate_request_step
from controller.server import start_server
from policies.presets import load_preset
from policies.table import Decision, DecisionTable
from protos.speculation.v1 import plan_pb2, worker_pb2
from tests.support import TRUTH, free_port, make_hello, wait_for
from tests.test_integration_raw import RawStream, get_status, reports
from worker.reference.drafters.ngram import NgramDrafter
from worker.reference.engine.engine import Engine, static_decide
from worker.reference.models import tiny_llama
from worker.sdk.agent import compile_plan, step_to_proto
from worker.sdk.shadow import ShadowDrafts, ShadowOutcome
from worker.sdk.telemetry import RequestTelemetry, StepTelemetry

NEW = 40


# ------------------------------------------------------------ bookkeeping

def test_shadows_follow_the_trajectory_of_a_drafting_request() -> None:
    shadows = ShadowDrafts(depth=3)
    assert shadows.wants("a")
    shadows.start("a", 10, [1, 2, 3, 4, 5])  # cut to the depth
    assert not shadows.wants("a") and shadows.wants("b")  # one open per request
    with pytest.raises(ValueError, match="already has a shadow"):
        shadows.start("a", 11, [1])
    assert shadows.emitted("a", [1]) == [] and shadows.emitted("a", [2]) == []
    assert shadows.emitted("a", [9]) == [ShadowOutcome(10, 3, 3, 2)]  # 9 is not 3
    assert shadows.wants("a")  # the next off step proposes again
    # Matched whole: the step after is the bonus token's, which proposes nothing.
    shadows.start("a", 13, [7, 8])  # lookup found two tokens: a chain of two
    assert shadows.emitted("a", [7]) == [] and shadows.emitted("a", [8]) == [ShadowOutcome(13, 3, 2, 2)]
    assert not shadows.wants("a") and shadows.wants("a")
    # Tokens after a full match in the same emission include the bonus: no step skipped.
    shadows.start("a", 16, [4])
    assert shadows.emitted("a", [4, 6]) == [ShadowOutcome(16, 3, 1, 1)] and shadows.wants("a")
    # A request that finishes mid-shadow: what matched so far, as a chain that deep accepted whole.
    shadows.start("a", 18, [4, 4, 4])
    assert shadows.emitted("a", [4]) == []
    assert shadows.finish("a") == [ShadowOutcome(18, 3, 1, 1)]
    shadows.start("a", 19, [4, 4, 4])
    assert shadows.finish("a") == []  # nothing matched: no evidence
    shadows.start("b", 5, [1])
    shadows.drop("b")  # it drafts for real
    assert shadows.wants("b") and shadows.emitted("b", [1]) == [] and shadows.open_count() == 0
    assert shadows.started == 6 and shadows.resolved == 4
    with pytest.raises(ValueError, match="depth"):
        ShadowDrafts(0)
    with pytest.raises(ValueError, match="accepted <= depth"):
        ShadowOutcome(1, 3, 1, 2)


def _trajectory_holds(shadows: list[ShadowOutcome]) -> None:
    """A request's shadows, in order, are proposals of a request drafting chains: a chain
    proposed at context c that accepts a emits a + 1 tokens (the accepted, then the
    target's own), so the next proposal is at c + a + 1 or later (later: steps that drafted)."""
    for prev, nxt in zip(shadows, shadows[1:]):
        assert nxt.context_len >= prev.context_len + prev.accepted + 1, (prev, nxt)


# ------------------------------------------------------------ the engine

class Recorder:
    def __init__(self) -> None:
        self.steps: list[StepTelemetry] = []

    def observe(self, step: StepTelemetry) -> None:
        self.steps.append(step)

    def finish(self, summary) -> None:
        pass


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    model, vocab = tiny_llama(seed=0)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (12, 5, 9, 16)]
    prompts[0] = prompts[0][:6] * 2  # something for prompt lookup to find
    prompts[3] = prompts[3][:4] * 4
    return model, prompts


def _alternating(period: int):
    """Off, except every ``period``-th call of each request: a depth-3 chain."""
    calls: dict[str, int] = {}

    def decide(rid: str, ctx: int, batch: int) -> Decision:
        calls[rid] = calls.get(rid, 0) + 1
        return Decision.chain(3) if calls[rid] % period == 0 else Decision.off()

    return decide


def _prefix_match(draft: list[int], emitted: list[int]) -> int:
    n = 0
    while n < len(draft) and n < len(emitted) and draft[n] == emitted[n]:
        n += 1
    return n


@pytest.mark.model
@pytest.mark.parametrize("temperature", [0.0, 0.05])
def test_engine_shadows_are_what_lookup_would_have_offered_judged_by_the_tokens_emitted(tiny, temperature):
    model, prompts = tiny
    outputs = {}
    for shadows in (False, True):
        rec = Recorder()
        engine = Engine(model, NgramDrafter(max_depth=5), _alternating(2), observer=rec, max_batch=3,
                        temperature=temperature, seed=3, shadows=shadows)
        reqs = [engine.submit(p, NEW, request_id=f"q{i}") for i, p in enumerate(prompts)]
        engine.run()
        outputs[shadows] = [r.output for r in reqs]
    # Shadows change nothing the requests emit (no sampling draw, no cache write).
    assert outputs[True] == outputs[False]
    if temperature == 0.0:
        with torch.inference_mode():
            assert outputs[True] == [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW)[
                0, len(p):].tolist() for p in prompts]

    tokens = {f"q{i}": p + out for i, (p, out) in enumerate(zip(prompts, outputs[True]))}
    fresh = NgramDrafter(max_depth=5)
    from worker.reference.drafters.base import DraftContext

    limits = fresh.limits
    off_steps = {(r.request_id, r.context_len) for step in rec.steps for r in step.requests if not r.requested_depth}
    found = accepted = 0
    by_request: dict[str, list[ShadowOutcome]] = {}
    for step in rec.steps:
        proto = step_to_proto(step)
        for r, p in zip(step.requests, proto.requests):
            validate_request_step(p, limits, "step", step.step_id)  # what the controller accepts
            assert [(s.depth, s.accepted) for s in p.shadows] == [(s.depth, s.accepted) for s in r.shadows]
            assert len(r.shadows) <= 1 and not (r.shadows and r.requested_depth)  # drafting drops them
            for s in r.shadows:
                assert (r.request_id, s.context_len) in off_steps  # proposed at a step that did not draft
                by_request.setdefault(r.request_id, []).append(s)
                # Committed tokens when it was proposed: the KV's context and the root.
                seen = tokens[r.request_id][: s.context_len + 1]
                draft = fresh.propose([DraftContext(r.request_id, seen)], [Decision.chain(5)])[0].tokens
                fresh.release(r.request_id)
                emitted = tokens[r.request_id][s.context_len + 1:]
                matched = _prefix_match(draft, emitted)
                assert s.requested_depth == 5
                if matched == len(emitted) < len(draft):  # the request ended first: censored at what matched
                    assert (s.depth, s.accepted) == (matched, matched)
                else:
                    assert (s.depth, s.accepted) == (len(draft), matched)
                found += 1
                accepted += s.accepted
    for outcomes in by_request.values():
        _trajectory_holds(outcomes)
    assert found >= 20 and found == engine.stats.shadow_drafts
    assert accepted > 0  # the repeated prompts give lookup something to match
    assert engine.stats.shadow_s > 0.0


@pytest.mark.model
def test_a_perfect_drafters_shadows_accept_whole_and_skip_the_bonus_step(tiny):
    """A drafter that knows the target's greedy continuation, allowed shadows for the
    test: every shadow is accepted whole (or up to the request's end), and they follow
    the trajectory of a request drafting chains of 4 (4 matched, the bonus token's
    step skipped, the next proposed), with the output plain greedy's."""
    from worker.reference.drafters.oracle import OracleDrafter

    class ShadowedOracle(OracleDrafter):
        shadows = True

    model, prompts = tiny
    with torch.inference_mode():
        refs = [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW)[0, len(p):].tolist()
                for p in prompts]
    rec = Recorder()
    engine = Engine(model, ShadowedOracle({tuple(p): r for p, r in zip(prompts, refs)}, max_depth=4),
                    static_decide(Decision.off()), observer=rec, max_batch=2)
    assert engine.generate(prompts, NEW) == refs
    by_request: dict[str, list[ShadowOutcome]] = {}
    for step in rec.steps:
        for r in step.requests:
            by_request.setdefault(r.request_id, []).extend(r.shadows)
    for outcomes in by_request.values():
        assert all(s.accepted == s.depth >= 1 for s in outcomes)
        # Off all along: each next shadow starts right after the last one's bonus token.
        assert [b.context_len - a.context_len for a, b in zip(outcomes, outcomes[1:])] == [5] * (len(outcomes) - 1)
        assert sum(s.depth for s in outcomes) + len(outcomes) >= NEW - 5
    assert engine.stats.shadow_drafts == sum(len(v) for v in by_request.values()) >= 4 * (NEW // 5)


@pytest.mark.model
def test_shadows_only_for_cheap_deterministic_drafters_and_never_for_relaxed_rows(tiny):
    model, prompts = tiny
    from worker.reference.drafters.oracle import OracleDrafter

    with pytest.raises(ValueError, match="shadows = True"):
        Engine(model, OracleDrafter({}, max_depth=4), shadows=True)
    assert Engine(model, OracleDrafter({}, max_depth=4)).shadows is None  # default: only when the drafter says
    assert Engine(model, NgramDrafter()).shadows is not None
    assert Engine(model, NgramDrafter(), shadows=False).shadows is None
    rec = Recorder()
    engine = Engine(model, NgramDrafter(), static_decide(Decision.off()), observer=rec, max_batch=2,
                    classes={"bulk": ("typical", 0.3, 0.5)})
    engine.submit(prompts[0], 12, request_class="bulk")
    engine.submit(prompts[3], 12)
    engine.run()
    rows = [r for s in rec.steps for r in s.requests]
    assert any(r.shadows for r in rows if r.request_class == "")
    assert not any(r.shadows for r in rows if r.request_class == "bulk")


# ------------------------------------------------------------ the controller

def _shadow_step(step_id: int, rng: np.random.Generator, alpha: float, batch: int, ctx: int,
                 table: DecisionTable, shadows: bool) -> worker_pb2.StepReport:
    """A step of ``batch`` rows at ``ctx``, each decided by ``table``; a drafting row's chain and
    an off row's shadow (depth 4) accept each position with probability ``alpha``."""
    requests = []
    for i in range(batch):
        d = table.lookup(batch, ctx)
        depth = d.depth if d.depth else (4 if shadows else 0)
        accepted = 0
        while accepted < depth and rng.random() < alpha:
            accepted += 1
        if d.depth:
            requests.append(RequestTelemetry(f"r{i}", ctx, d.depth, 1, d.depth, accepted, requested_depth=d.depth,
                                             requested_width=1, requested_nodes=d.depth))
        else:
            requests.append(RequestTelemetry(f"r{i}", ctx, shadows=[ShadowOutcome(ctx, 4, 4, accepted)]
                                             if shadows else ()))
    drafted = [r for r in requests if r.depth]
    step = StepTelemetry(step_id, time.time(), batch,
                         TRUTH.draft_ms(max((r.depth for r in drafted), default=0), sum(r.nodes for r in drafted)),
                         TRUTH.verify_ms(sum(1 + r.nodes for r in requests), batch * ctx), requests)
    return step_to_proto(step)


def _run(ctl: Controller, state, clock: list[float], rng, alpha: float, steps: int, table: DecisionTable,
         shadows: bool, first_id: int) -> DecisionTable:
    applied = state.plans.acked_version
    for i in range(steps):
        clock[0] += 0.05
        step = _shadow_step(first_id + i, rng, alpha, 8, 600, table, shadows)
        assert ctl.ingest(state, worker_pb2.StepReports(steps=[step])) == []
        for msg in ctl.plan_updates(state):
            if isinstance(msg, plan_pb2.Plan):
                table, applied = compile_plan(msg, state.hello, applied), msg.version
                ctl.ack(state, worker_pb2.Ack(version=msg.version, nonce=msg.nonce))
    return table


@pytest.mark.parametrize("shadows", [True, False])
def test_a_model_that_says_off_switches_on_through_shadows_alone(shadows: bool) -> None:
    """Fitted on traffic the drafter cannot follow, the plan says off. Live traffic
    that it follows well then switches the plan on through shadow drafts alone;
    without them the plan stays off (an off request yields no evidence)."""
    clock = [0.0]
    config = ServerConfig(plan=PlanSettings(recompute_interval_s=0.2, min_push_interval_s=0.5, hysteresis=0.02))
    ctl = Controller(config, load_preset("goodput"), clock=lambda: clock[0])
    state = ctl.hello(make_hello("w-shadow", max_depth=6))
    rng = np.random.default_rng(4)
    # The draft costs as much as a verify token here, so a drafter that accepts nothing does not pay.
    table = _run(ctl, state, clock, rng, 0.0, 600, DecisionTable.uniform(Decision.chain(3)), shadows, 1)
    assert table.lookup(8, 600) == Decision.off(), table.lookup(8, 600)
    table = _run(ctl, state, clock, rng, 0.9, 600, table, shadows, 601)
    if shadows:
        assert table.lookup(8, 600).depth >= 2, table.lookup(8, 600)
        assert state.counters.shadow_drafts > 1000
    else:
        assert table.lookup(8, 600) == Decision.off()
        assert state.counters.shadow_drafts == 0


def test_a_relaxed_rows_shadow_is_counted_not_used() -> None:
    clock = [100.0]
    from policies.presets import load_preset_text

    ctl = Controller(ServerConfig(), load_preset_text(
        "policy: goodput\nclasses:\n  chat: {}\n  bulk: {acceptance: typical}\ndefault_class: chat\n"),
        clock=lambda: clock[0])
    state = ctl.hello(make_hello("w-relaxed"))
    rows = [worker_pb2.RequestStep(request_id="t", context_len=50, request_class="bulk",
                                   acceptance_rule=plan_pb2.ACCEPTANCE_RULE_TYPICAL,
                                   shadows=[worker_pb2.ShadowDraft(context_len=50, requested_depth=4, depth=4,
                                                                   accepted=4)]),
            worker_pb2.RequestStep(request_id="s", context_len=50, request_class="chat",
                                   shadows=[worker_pb2.ShadowDraft(context_len=50, requested_depth=4, depth=4,
                                                                   accepted=1)])]
    step = worker_pb2.StepReport(step_id=1, timestamp=time.time(), batch_size=2, verify_ms=10.0, requests=rows)
    assert ctl.ingest(state, worker_pb2.StepReports(steps=[step])) == []
    view = ctl.acceptance.view(state.drafter_key, 6, 1)
    bucket = 0
    # One chain of four accepting one: evidence at positions 1 and 2 only.
    assert view.effective_samples(bucket).tolist() == pytest.approx([1, 1, 0, 0, 0, 0], abs=1e-6)
    assert view.offer_rate(bucket) > 0.5  # asked once, offered once (beside the prior)
    # And in the model of the request's state (a first step: the default state), as a verified chain's.
    default = ctl.acceptance_by_state.models[0].view(state.drafter_key, 6, 1)
    assert default.effective_samples(bucket).tolist() == pytest.approx([1, 1, 0, 0, 0, 0], abs=1e-6)
    assert sum(state.accept_counts.values()) == 0  # the per-position counters: verified drafts only
    ws = ctl.worker_status(state)
    assert (ws.shadow_drafts, ws.shadow_drafts_ignored) == (1, 1)
    assert ctl.typical_view(state) is None  # the relaxed row's shadow fed no model


# ------------------------------------------------------------ raw gRPC

async def test_raw_client_shadows_counted_and_malformed_ones_refused_naming_the_field() -> None:
    config = ServerConfig(listen=f"127.0.0.1:{free_port()}",
                          plan=PlanSettings(recompute_interval_s=0.05, min_push_interval_s=0.05, hysteresis=1.0))
    running = await start_server(config)
    channel = grpc.aio.insecure_channel(running.address)
    try:
        stream = await RawStream(channel, make_hello("w-raw-shadow", kind=worker_pb2.DRAFTER_KIND_NGRAM)).open()

        def shadow_step(step_id: int, count: int = 1, **shadow) -> worker_pb2.StepReport:
            row = worker_pb2.RequestStep(request_id="r", context_len=300,
                                         shadows=[worker_pb2.ShadowDraft(**shadow)] * count)
            return worker_pb2.StepReport(step_id=step_id, timestamp=time.time(), batch_size=1, verify_ms=10.0,
                                         requests=[row])

        await stream.send(reports(shadow_step(1, context_len=299, requested_depth=4, depth=3, accepted=2),
                                  shadow_step(2, 6, context_len=300, requested_depth=4, depth=0, accepted=0)))
        # A drafting step may carry shadows proposed at earlier off steps.
        drafted = worker_pb2.RequestStep(request_id="r", context_len=302, depth=2, width=1, nodes=2, accepted=1,
                                         shadows=[worker_pb2.ShadowDraft(context_len=301, requested_depth=4, depth=4,
                                                                         accepted=4)])
        await stream.send(reports(worker_pb2.StepReport(step_id=3, timestamp=time.time(), batch_size=1,
                                                        verify_ms=10.0, requests=[drafted])))
        bad = [
            (dict(context_len=299, requested_depth=4, depth=3, accepted=4), "shadows[0].accepted",
             "4 must be in 0..depth"),
            (dict(context_len=301, requested_depth=4, depth=3, accepted=0), "shadows[0].context_len", "301"),
            (dict(context_len=10, requested_depth=9, depth=3, accepted=0), "shadows[0].requested_depth",
             "9 must be in 1..6"),
            (dict(context_len=10, requested_depth=2, depth=3, accepted=0), "shadows[0].depth",
             "3 must be in 0..requested"),
            # More than max_depth (6) resolved in one step.
            (dict(count=7, context_len=10, requested_depth=2, depth=1, accepted=0), "shadows", "has 7 entries"),
        ]
        for i, (fields, name, detail) in enumerate(bad):
            await stream.send(reports(shadow_step(4 + i, **fields)))
        await wait_for(lambda: len(stream.of("rejection")) == len(bad))
        details = [(r.field, r.detail) for r in stream.of("rejection")]
        for (_, name, detail), (field, text) in zip(bad, details):
            assert field.endswith(f"requests[0].{name}") and detail in text, (name, detail, field, text)
        w = (await get_status(channel, "w-raw-shadow")).workers[0]
        assert (w.shadow_drafts, w.shadow_drafts_ignored, w.steps_ingested) == (8, 0, 3)
        await stream.close()
    finally:
        await channel.close()
        await running.stop(0)
