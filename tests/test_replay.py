"""Telemetry recording and offline replay: the censored estimator, and a
record -> replay round trip through a real server on a loopback port."""

from __future__ import annotations

import asyncio
import gzip
import time

import numpy as np
import pytest

from bench.replay import censored_tau, recorded_outcome, replay_file, subtree_value
from controller.config import PlanSettings, ServerConfig
from controller.observe.recorder import TelemetryRecorder, read_recording, step_from_dict, step_to_dict
from controller.server import start_server
from policies.presets import load_preset_text
from policies.table import Decision
from protos.speculation.v1 import worker_pb2
from tests.support import SyntheticWorker, free_port, make_hello, wait_for
from worker.sdk.agent import SpeculationAgent
from worker.sim.tree import build_tree, chain_tree
from worker.sdk.telemetry import RequestSummary

ALPHA = np.array([[0.8], [0.7], [0.6], [0.5], [0.4], [0.3]])  # chain q: one rank per position


# ----------------------------------------------------------- the estimator
CHAIN_CASES = [(d, t, depth) for d in range(1, 7) for t in range(d + 1) for depth in range(1, 7)]


@pytest.mark.parametrize("recorded_depth,tau,depth", CHAIN_CASES)
def test_chain_censoring_rule(recorded_depth, tau, depth):
    ranks = [1] * tau + ([0] if tau < recorded_depth else [])
    estimate, exact = censored_tau(chain_tree(depth), ALPHA, ranks, [1] * len(ranks))
    if tau < recorded_depth:  # rejected at tau + 1: nothing past it is known, nor needed
        assert exact and estimate == min(tau, depth)
    elif depth <= tau:  # tau = recorded depth, shorter or equal depth: exact
        assert exact and estimate == depth
    else:  # tau = recorded depth < depth: positions tau+1..depth from the model
        alpha = ALPHA[tau:depth, 0]
        assert not exact
        assert estimate == pytest.approx(tau + float(np.cumprod(alpha).sum()))


def test_a_step_that_did_not_speculate_is_all_model():
    estimate, exact = censored_tau(chain_tree(3), ALPHA, [], [])
    assert not exact and estimate == pytest.approx(0.8 + 0.8 * 0.7 + 0.8 * 0.7 * 0.6)


def test_trees_use_the_recorded_rank_and_condition_untested_ranks():
    q = np.array([[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.5, 0.2, 0.1]])
    wide = build_tree(q, depth=2, width=3, max_nodes=6)  # root: 3 children; best child: 2 or 3
    # Recorded: a chain of 2; rank 1 accepted, then nothing at level 2 (1 offered).
    estimate, exact = censored_tau(wide, q, [1, 0], [1, 1])
    offered = int(wide.child_count[int(wide.first_child[0])])
    # Level 2 offers `offered` candidates; rank 1 failed, so ranks 2.. get q / (1 - q[1, 1]).
    expected = 1.0 + sum(q[1, r] / (1 - q[1, 0]) for r in range(1, offered))
    assert not exact and estimate == pytest.approx(expected)
    # Recorded: the target took rank 2 at level 1 (of 3 offered), then rejected at level 2.
    estimate, exact = censored_tau(wide, q, [2, 0], [3, 1])
    node = int(wide.first_child[0]) + 1
    extra = sum(q[1, r] / (1 - q[1, 0]) for r in range(1, int(wide.child_count[node])))
    assert estimate == pytest.approx(1.0 + extra)
    # A chain cannot hold rank 2: rejected at level 1, exactly.
    assert censored_tau(chain_tree(2), q, [2, 0], [3, 1]) == (0.0, True)
    # Nothing of the recorded level-1 outcome is unknown when the tree offers no more than was tested.
    assert censored_tau(build_tree(q, 1, 2, 2), q, [0], [3]) == (0.0, True)


def test_subtree_value_is_the_sum_of_path_products():
    q = np.array([[0.6, 0.2], [0.5, 0.2]])
    tree = build_tree(q, depth=2, width=2, max_nodes=4)
    assert tree.nodes == 4
    values = [0.6, 0.6 * 0.5, 0.2, 0.6 * 0.2]  # best-first nodes: path products
    assert subtree_value(tree, q, 0, 0) == pytest.approx(sum(values))


def test_recorded_outcome_of_chain_shorthand():
    r = worker_pb2.RequestStep(request_id="a", context_len=10, depth=4, width=1, nodes=4, accepted=2)
    assert recorded_outcome(r) == ([1, 1, 0], [1, 1, 1])
    r.accepted = 4
    assert recorded_outcome(r) == ([1, 1, 1, 1], [1, 1, 1, 1])


# ------------------------------------------------------------ the recording
def test_step_round_trips_through_json():
    step = worker_pb2.StepReport(step_id=3, timestamp=1.5, batch_size=2, draft_ms=0.5, verify_ms=9.0,
                                 catch_up_ms=2.25)
    step.requests.add(request_id="a", context_len=100, depth=3, width=2, nodes=5, accepted=1,
                      accepted_rank=[2, 0], level_candidates=[2, 1], domain="code", requested_depth=3,
                      requested_width=2, requested_nodes=6, caught_up_tokens=40)
    step.requests.add(request_id="b", context_len=200, requested_depth=2)  # asked, no draft offered
    # Off, with a shadow draft resolved, a class and a rule: all kept.
    step.requests.add(request_id="c", context_len=300, request_class="bulk", acceptance_rule=2,
                      shadows=[worker_pb2.ShadowDraft(context_len=297, requested_depth=6, depth=4, accepted=2),
                               worker_pb2.ShadowDraft(context_len=298, requested_depth=6, depth=0)])
    assert step_from_dict(step_to_dict(step)) == step


def test_a_recording_cut_short_reads_to_its_last_flush(tmp_path):
    path = tmp_path / "rec.jsonl.gz"
    recorder = TelemetryRecorder(path, flush_interval_s=0.01)
    recorder.hello(make_hello("w"))
    step = worker_pb2.StepReport(step_id=1, timestamp=1.0, batch_size=1, draft_ms=0.1, verify_ms=5.0)
    step.requests.add(request_id="a", context_len=100, depth=2, width=1, nodes=2, accepted=1)
    for _ in range(50):
        recorder.steps("w", worker_pb2.StepReports(steps=[step]))
    time.sleep(0.1)
    recorder.steps("w", worker_pb2.StepReports(steps=[step]))
    # A controller killed now: copy what is on disk without the gzip trailer.
    partial = tmp_path / "partial.jsonl.gz"
    partial.write_bytes(path.read_bytes())
    recorder.close()
    whole = list(read_recording(path))
    assert [r["kind"] for r in whole[:2]] == ["header", "hello"] and len(whole) == 53
    cut = list(read_recording(partial))
    assert 2 <= len(cut) <= len(whole) and cut == whole[: len(cut)]
    assert gzip.decompress(path.read_bytes()).count(b"\n") == 53


# ------------------------------------------------------------ round trip
async def test_record_then_replay_on_a_real_server(tmp_path):
    path = tmp_path / "telemetry.jsonl.gz"
    config = ServerConfig(listen=f"127.0.0.1:{free_port()}", record=str(path),
                          plan=PlanSettings(recompute_interval_s=0.05, min_push_interval_s=0.05, hysteresis=0.0))
    running = await start_server(config)
    agent = SpeculationAgent(make_hello("w-rec", max_depth=6), running.address).start()
    worker = SyntheticWorker(lambda ctx: 0.75, seed=4)
    rounds, batch = 40, 4
    try:
        for n in range(rounds):
            step = worker.step(lambda rid, ctx, b: Decision.chain(4), batch, 600, prefix=f"r{n}-")
            agent.observe(step)
            for r in step.requests:
                agent.finish(RequestSummary(r.request_id, r.accepted + 1, 1, r.accepted, time.time()))
            await asyncio.sleep(0.005)
        await wait_for(lambda: running.controller.workers.get("w-rec") is not None
                       and running.controller.workers["w-rec"].steps_ingested == rounds)
        await wait_for(lambda: not running.controller.workers["w-rec"].requests.active)
    finally:
        agent.close()
        await running.stop(0)
    records = list(read_recording(path))
    kinds = [r["kind"] for r in records]
    assert kinds[0] == "header" and "hello" in kinds
    assert sum(len(r["steps"]) for r in records if r["kind"] == "steps") == rounds
    assert kinds.count("finished") == rounds * batch
    recorded_tokens = sum(r.accepted + 1 for s in worker_steps(records) for r in s.requests)

    # The policy that ran: the estimate is the recording itself, all exact.
    same, _ = replay_file(path, load_preset_text("policy: static\ndepth: 4\n"))
    assert same["exact_fraction"] == 1.0 and same["estimated_tokens"] == recorded_tokens
    assert same["vs_recorded"] == pytest.approx(1.0)

    # A shorter depth: exact, τ' = min(τ, 2) once its plan is in force (recorded before).
    short, replayer = replay_file(path, load_preset_text("policy: static\ndepth: 2\n"), delay_steps=1,
                                  keep_details=True)
    details = replayer.workers["w-rec"].details
    assert short["exact_fraction"] == 1.0 and len(details) == rounds * batch
    for _rid, depth, accepted, decision, tau, exact in details:
        assert exact and tau == (accepted if decision is None else min(accepted, decision.depth))
    assert any(d[3] is not None for d in details)
    assert short["estimated_tokens"] < recorded_tokens

    # A longer depth needs the model past position 4, only where τ = 4.
    long, replayer = replay_file(path, load_preset_text("policy: static\ndepth: 6\n"), keep_details=True)
    details = replayer.workers["w-rec"].details
    for _rid, depth, accepted, decision, tau, exact in details:
        if decision is not None:
            assert exact == (accepted < depth)
            assert tau >= accepted
    assert long["estimated_tokens"] > recorded_tokens and long["exact_fraction"] < 1.0

    # Any preset replays (here the product), with a fitted cost model behind its step times.
    product, _ = replay_file(path, load_preset_text("policy: goodput\nprobe_fraction: 0.0\n"))
    assert product["estimated_goodput_tok_s"] > 0 and product["steps"] == rounds


def worker_steps(records):
    for r in records:
        if r["kind"] == "steps":
            for d in r["steps"]:
                yield step_from_dict(d)
