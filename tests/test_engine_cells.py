"""The engine benchmark's three lost cells (issue #28, run D), each reduced to
the rule that lost it, on hand-built observations and recordings.

- EAGLE at batch 8: the batch-8 row of a worker of at most 8 requests was
  solved at 9.4 requests, where the cost curve has no data; at a mean batch
  between 7 and 8 a depth-1 chain was charged a whole RMSE of caution for a
  shape (7 requests) that only part of the steps have; and one Thompson probe
  of eight drafting on a padded worker made every row pay its block.
- Replay, the tool that measured these: it priced a padded worker's steps
  packed (a step where one request of eight drafted looked nearly free) and
  valued prompt lookup's unmatched requests as if they had drafted.
"""

from __future__ import annotations

import numpy as np
import pytest

from bench.replay import Replayer
from controller.models.cost import CostParams
from policies.base import DrafterLimits, LoadProfile, Observation
from policies.goodput import GoodputConfig, GoodputPolicy
from policies.presets import load_preset_text
from policies.table import DEFAULT_BATCH_EDGES, DEFAULT_CONTEXT_EDGES, Decision
from protos.speculation.v1 import worker_pb2
from tests.support import make_hello
from tests.test_goodput_policy import FixedAcceptance

CONTEXT = 300


def padded_observation(cost: CostParams, q: np.ndarray, mean_batch: float, max_batch: int = 8,
                       active: dict[str, int] | None = None) -> Observation:
    return Observation(now=0.0, worker_id="w", drafter=DrafterLimits("eagle", "", q.shape[0], q.shape[1], 2, 0),
                       batch_edges=DEFAULT_BATCH_EDGES, context_edges=DEFAULT_CONTEXT_EDGES,
                       acceptance=FixedAcceptance(q), cost=cost,
                       load=LoadProfile(mean_batch_size=mean_batch, context_share=(1.0,) + (0.0,) * 8,
                                        context_mean=(float(CONTEXT),) + (0.0,) * 8),
                       active_requests=active or {}, max_batch_size=max_batch, padded_verify=True)


def test_the_row_of_the_largest_batch_is_solved_at_a_batch_the_worker_runs():
    """A CPU worker of at most 8 requests, padded: a forward of 8 tokens costs
    100 ms, 16 tokens 124 ms (both measured), and the curve rises 4 ms a token
    past 10 tokens, flat between 8 and 10 where no step has been. α = 0.3: a
    depth-1 chain for all 8 requests makes 1.3x the tokens for 1.24x the time,
    +4.8 %. Batch 8 falls in the bucket [8, 12), whose middle is 9.4: priced
    there the chain costs 1.35x a plain forward and loses. The worker never
    runs 9.4 requests, so the row is solved at 8 and drafts."""
    cost = CostParams(mem_ms=0.0, compute_ms=60.0, compute_ms_per_token=4.0,
                      compute_knots=(1.0, 8.0, 10.0, 16.0, 20.0), compute_rise_ms=(0.0, 40.0, 40.0, 64.0, 80.0),
                      draft_ms_per_level=0.0)
    q = np.array([[0.3]])
    policy = GoodputPolicy(GoodputConfig(probe_fraction=0.0, cost_caution=0.0))
    # The mean batch is 4: the batch-8 row is solved at its bucket's representative size.
    plan, _ = policy.decide((0, 0), padded_observation(cost, q, mean_batch=4.0, max_batch=8))
    assert plan.table.lookup(8, CONTEXT) == Decision.chain(1)
    # A worker that may run 9-11 requests is planned at the bucket's middle, as before.
    wide, _ = policy.decide((0, 0), padded_observation(cost, q, mean_batch=4.0, max_batch=256))
    assert wide.table.lookup(8, CONTEXT) == Decision.off()


def test_caution_at_a_fractional_mean_batch_is_that_of_the_batches_the_worker_runs():
    """A batch of 8 filling up: the mean is 7.8. Plain forwards and 8 × 2 tokens
    (a depth-1 chain at batch 8) are measured hundreds of times, 7 × 2 = 14
    tokens never (the worker reached 8 requests before it drafted). With
    α = 0.3 the chain gains 8 % in expectation. A mean of 7.8 requests is 80 %
    steps of 8 and 20 % steps of 7, so the price is a fifth as unsure as an
    unmeasured one: 2.8 ms of caution and the chain is drafted. Read at the
    15.6 tokens no step has, it carried the whole 12 ms RMSE and stayed off;
    at a mean of 7.1 (nearly all steps of 7, never measured) it still does."""
    cost = CostParams(mem_ms=0.0, compute_ms=60.0, compute_ms_per_token=4.0,
                      compute_knots=(1.0, 7.0, 8.0, 14.0, 16.0, 20.0),
                      compute_rise_ms=(0.0, 35.0, 40.0, 52.0, 60.0, 76.0), draft_ms_per_level=0.0,
                      compute_evidence=(500.0, 500.0, 500.0, 0.0, 500.0, 0.0), verify_rmse_ms=12.0)
    q = np.array([[0.3]])
    policy = GoodputPolicy(GoodputConfig(probe_fraction=0.0, cost_caution=1.0))
    filling, _ = policy.decide((0, 0), padded_observation(cost, q, mean_batch=7.8))
    assert filling.table.lookup(8, CONTEXT) == Decision.chain(1)
    mostly_seven, _ = policy.decide((0, 0), padded_observation(cost, q, mean_batch=7.1))
    assert mostly_seven.table.lookup(7, CONTEXT) == Decision.off()
    # Without caution the chain wins at either mean: caution alone made the difference.
    bold = GoodputPolicy(GoodputConfig(probe_fraction=0.0, cost_caution=0.0))
    assert bold.decide((0, 0), padded_observation(cost, q, mean_batch=7.1))[0].table.lookup(7, CONTEXT) \
        == Decision.chain(1)


def test_a_padded_workers_probe_is_the_whole_batch():
    """Thompson probes on a padded worker of 8 requests whose plan is off (an
    untried 16-token forward, one RMSE of caution): one request drafting while
    seven do not makes all eight pay its block, so a probe decides every
    active request or none. Over many policy runs about ``probe_fraction`` of
    them probe. A packed worker keeps its fixed slice of request ids. (Price
    probes, which would try the unmeasured 16 tokens too, are off here.)"""
    cost = CostParams(mem_ms=0.0, compute_ms=75.0, compute_ms_per_token=3.125, compute_knots=(1.0, 8.0, 16.0, 24.0),
                      compute_rise_ms=(0.0, 0.0, 25.0, 50.0), draft_ms_per_level=0.0,
                      compute_evidence=(500.0, 500.0, 0.0, 0.0), verify_rmse_ms=12.0)
    q = np.array([[0.42]])
    active = {f"req-{i}": CONTEXT for i in range(8)}
    policy = GoodputPolicy(GoodputConfig(probe_fraction=0.3, cost_caution=1.0, price_probe_fraction=0.0))
    padded = [policy.decide((seed, 0), padded_observation(cost, q, 8.0, active=active))[0] for seed in range(60)]
    assert all(p.table.lookup(8, CONTEXT) == Decision.off() for p in padded)
    probed = [p.overrides for p in padded if p.overrides]
    assert probed, "some probe runs draw a cost error that lets the chain through"
    assert all(set(o) == set(active) and set(o.values()) == {Decision.chain(1)} for o in probed)
    assert len(probed) < 0.3 * len(padded) + 8  # no more runs than probe_fraction (those drawn are not all drafts)
    # A packed worker: the probes are the fixed slice of ids, whatever the run.
    packed_ids = set()
    for seed in range(60):
        obs = padded_observation(cost, q, 8.0, active=active)
        obs = Observation(**{**obs.__dict__, "padded_verify": False})
        packed_ids |= set(policy.decide((seed, 0), obs)[0].overrides)
    assert packed_ids and packed_ids < set(active)


# --------------------------------------------------------------- replay
def padded_hello(kind: int = worker_pb2.DRAFTER_KIND_EAGLE) -> worker_pb2.Hello:
    hello = make_hello("w0", max_depth=2, max_width=1, kind=kind)
    hello.max_batch_size = 8
    hello.verify_layout = worker_pb2.VERIFY_LAYOUT_PADDED
    return hello


def row(i: int, ctx: int, depth: int = 0, accepted: int = 0, requested: int = 0) -> worker_pb2.RequestStep:
    r = worker_pb2.RequestStep(request_id=f"req-{i}", context_len=ctx, depth=depth, width=1 if depth else 0,
                               nodes=depth, accepted=accepted, requested_depth=requested,
                               requested_width=1 if requested else 0, requested_nodes=requested)
    if depth:
        reached = min(accepted + 1, depth)
        r.accepted_rank.extend([1] * accepted + [0] * (reached - accepted))
        r.level_candidates.extend([1] * reached)
    return r


def test_replay_prices_a_padded_workers_step_by_its_widest_block():
    """A padded worker at batch 8: plain steps take 100 ms, steps where one
    request of eight drafts a depth-1 chain 125 ms (every row carries its
    2-token block: 16 tokens). Replayed, the recorded decisions' modelled step
    time is the measured one; priced packed (9 tokens) it was 17 % short."""
    replay = Replayer(load_preset_text("policy: static\ndepth: 0\nwidth: 1\n"), delay_steps=1)
    replay.on_hello(padded_hello())
    worker = replay.workers["w0"]
    for s in range(400):
        mixed = s % 2 == 1
        drafting = [mixed and i == 0 for i in range(8)]
        rows = [row(i, 100 + s, depth=int(d), accepted=int(d and s % 4 == 1), requested=int(d)) for i, d in enumerate(drafting)]
        replay.now = s * 0.2
        replay.on_step(worker, worker_pb2.StepReport(step_id=s + 1, timestamp=replay.now, batch_size=8,
                                                     verify_ms=125.0 if mixed else 100.0, requests=rows))
    result = replay.result()["workers"]["w0"]
    assert result["recorded_goodput_model_tok_s"] == pytest.approx(result["recorded_goodput_measured_tok_s"], rel=0.02)
    _, recorded_ms = replay.step_ms(worker)
    assert recorded_ms[1::2].mean() == pytest.approx(125.0, rel=0.02)
    # The off policy's steps are plain forwards of 8 tokens.
    off_ms, _ = replay.step_ms(worker)
    assert off_ms.mean() == pytest.approx(100.0, rel=0.02)


def test_replay_gives_nothing_to_a_request_the_drafter_had_no_draft_for():
    """Prompt lookup asked for a depth-2 draft finds no match for most
    requests (``requested_depth`` 2, ``depth`` 0). Replaying the same static
    chain on its own recording reproduces the recorded tokens exactly: an
    unmatched request gets nothing under any decision, where it was valued at
    the model's α as if it had drafted."""
    replay = Replayer(load_preset_text("policy: static\ndepth: 2\nwidth: 1\n"), delay_steps=1)
    replay.on_hello(padded_hello(worker_pb2.DRAFTER_KIND_NGRAM))
    worker = replay.workers["w0"]
    rng = np.random.default_rng(0)
    for s in range(300):
        matched = rng.random() < 0.4
        accepted = int(rng.integers(0, 3)) if matched else 0
        replay.now = s * 0.1
        replay.on_step(worker, worker_pb2.StepReport(
            step_id=s + 1, timestamp=replay.now, batch_size=1, verify_ms=60.0 if not matched else 66.0,
            requests=[row(0, 50 + s, depth=2 if matched else 0, accepted=accepted, requested=2)]))
    result = replay.result()["workers"]["w0"]
    assert result["exact_fraction"] == 1.0
    assert result["estimated_tokens"] == pytest.approx(result["recorded_tokens"])
