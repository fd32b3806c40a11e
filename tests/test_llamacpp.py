"""llama.cpp (llama-cpp-python, SmolLM2-135M GGUF) under a real ``specctl serve``
on loopback, through the SDK's adapter (worker/sdk/integrations/llamacpp.py).

Every depth below is one the controller chose: the plan it pushed after a
policy reload (SIGHUP), or the goodput policy's own. Outputs are compared
token for token with llama.cpp's plain greedy decoding of the same prompts.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

from bench.llamacpp import ServeProcess, greedy as greedy_tokens, prompt_ids
from controller.client import fetch_status
from controller.observe.recorder import read_recording
from policies.presets import PRESET_DIR
from policies.table import Decision
from worker.reference.models import gguf_file
from worker.sdk.agent import AgentOptions, SpeculationAgent
from worker.sdk.integrations.llamacpp import ControlledPromptLookup, calibrate, llamacpp_hello

pytestmark = pytest.mark.timeout(600)

# Prompts whose answers repeat what they were given, so prompt lookup finds continuations.
PROMPTS = [
    "Repeat this list exactly, then add one more item in the same style: apples, pears, plums, figs, "
    "apples, pears, plums, figs.",
    "Rewrite this Python function with type hints and keep the body unchanged:\n"
    "def area(width, height):\n    result = width * height\n    return result\n",
    "Summarise in one sentence: The committee met on Monday. The committee approved the budget. "
    "The committee will meet again on Monday.",
]
MAX_TOKENS = 40
LLAMA_KW = dict(n_ctx=1024, n_threads=2, verbose=False, flash_attn=True, seed=0)


def greedy(llm: Llama, ids: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    return greedy_tokens(llm, ids, max_tokens)  # from an empty cache, EOS excluded


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(gguf_file("smollm2-135m"))


@pytest.fixture(scope="module")
def plain(model_path):
    """llama.cpp's own greedy output per prompt (no draft model)."""
    llm = Llama(model_path=model_path, **LLAMA_KW)
    ids = [prompt_ids(llm, p) for p in PROMPTS]
    return ids, [greedy(llm, i) for i in ids]


def serve_policy(tmp: Path, policy_text: str) -> ServeProcess:
    """``specctl serve`` with this policy file text, recording its telemetry."""
    policy = tmp / "policy.yaml"
    policy.write_text(policy_text)
    return ServeProcess(tmp, policy)


def controlled(model_path: str, target: str, worker_id: str, **adapter_kw):
    draft = ControlledPromptLookup(max_depth=8, keep_records=True, **adapter_kw)
    llm = Llama(model_path=model_path, draft_model=draft, logits_all=True, **LLAMA_KW)
    hello = llamacpp_hello(llm, worker_id, max_depth=8,
                           calibration=calibrate(llm, max_tokens=9, contexts=(64,), repeats=2))
    agent = SpeculationAgent(hello, target, AgentOptions(fallback=Decision.off(), flush_interval_s=0.05,
                                                         backoff_max_s=0.5)).start()
    draft.attach(llm, agent)
    return llm, draft, agent


def wait_for(predicate, timeout: float = 120.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def until_planned(llm, draft, agent, ids, expected: Decision | None = None) -> None:
    """Decode until the controller's first plan is in force: it plans a worker
    once its steps arrive (``plan.steps_before_first_plan``)."""
    for i in range(20):
        if agent.plan_version > 0 and (expected is None or agent.decide("probe", 100, 1) == expected):
            return
        with draft.request(f"warm-{i}"):
            greedy(llm, ids[i % len(ids)], max_tokens=8)
        time.sleep(0.3)
    raise AssertionError(f"no plan in force (version {agent.plan_version}, decision {agent.decide('probe', 100, 1)})")


def static(depth: int) -> str:
    return f"policy: static\ndepth: {depth}\nwidth: 1\n"


def run_prompts(llm, draft, ids, tag: str) -> list[list[int]]:
    outs = []
    for i, prompt in enumerate(ids):
        with draft.request(f"{tag}-{i}", domain="chat"):
            outs.append(greedy(llm, prompt))
    return outs


def recorded_steps(path: Path, worker_id: str) -> list[dict]:
    return [s for rec in read_recording(path) if rec["kind"] == "steps" and rec["worker_id"] == worker_id
            for s in rec["steps"]]


def test_output_is_plain_greedy_at_every_depth_the_controller_pushes(tmp_path, model_path, plain):
    ids, reference = plain
    serve = serve_policy(tmp_path, static(0))
    llm, draft, agent = controlled(model_path, serve.target, "llama-depths")
    try:
        used = {}
        for depth in (0, 1, 2, 4, 8):
            serve.reload(static(depth))
            wait_for(lambda: agent.decide("probe", 100, 1) == Decision.chain(depth), what=f"a plan of depth {depth}")
            before = len(draft.records)
            outs = run_prompts(llm, draft, ids, f"d{depth}")
            assert outs == reference, f"depth {depth}: speculative output differs from llama.cpp's plain greedy"
            new = draft.records[before:]
            assert {r.requested_depth for r in new} == {depth}
            used[depth] = (sum(r.drafted for r in new), sum(r.accepted for r in new))
        assert used[0] == (0, 0)
        for depth in (1, 2, 4, 8):  # the lookup found continuations and the engine kept some of them
            assert used[depth][0] > 0 and used[depth][1] > 0, used
        assert max(r.drafted for r in draft.records) == 8
    finally:
        agent.close()
        serve.stop()


def test_goodput_controller_learns_on_llamacpp_and_stays_lossless(tmp_path, model_path, plain):
    ids, reference = plain
    serve = serve_policy(tmp_path, (PRESET_DIR / "goodput.yaml").read_text())
    llm, draft, agent = controlled(model_path, serve.target, "llama-goodput")
    try:
        for rnd in range(3):
            assert run_prompts(llm, draft, ids, f"g{rnd}") == reference
        status = wait_for(lambda: next((w for w in fetch_status(serve.target).workers
                                        if w.hello.worker_id == "llama-goodput" and w.steps_ingested >= draft.stats.steps
                                        and w.acked_plan_version == agent.plan_version),
                                       None), what="the controller to count every step and the ACK of its plan")
        assert status.hello.engine == "llama.cpp" and status.hello.drafter.max_width == 1
        # the worker decodes on the plan the controller fitted from its steps and holds in force
        # (on this CPU that plan usually turns lookup off: a two-token forward costs ~1.45x
        # one, and lookup's tau is ~0.2)
        assert agent.plan_version >= 1 and len(status.hello.calibration) > 0
        assert status.cost_model.samples > 0
    finally:
        agent.close()
        serve.stop()


def test_depth_zero_makes_no_draft_calls(tmp_path, model_path, plain, monkeypatch):
    ids, reference = plain
    calls = []
    original = LlamaPromptLookupDecoding.find_candidate_pred_tokens

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(LlamaPromptLookupDecoding, "find_candidate_pred_tokens", staticmethod(counting))
    serve = serve_policy(tmp_path, static(0))
    llm, draft, agent = controlled(model_path, serve.target, "llama-off", shadows=False)
    try:
        until_planned(llm, draft, agent, ids, Decision.off())
        assert run_prompts(llm, draft, ids, "off") == reference
        assert calls == [] and draft.stats.lookup_calls == 0 and draft.stats.shadow_lookups == 0
        assert draft.stats.steps > 0 and all(r.drafted == 0 for r in draft.records)
        # the controller still saw every step (plain decode costs are telemetry too)
        wait_for(lambda: agent.stats.steps_confirmed >= draft.stats.steps, what="receipts for every step")
    finally:
        agent.close()
        serve.stop()
    steps = recorded_steps(serve.record, "llama-off")
    assert len(steps) == draft.stats.steps and all(s["requests"][0].get("depth", 0) == 0 for s in steps)


def test_depth_zero_shadow_drafts_are_what_the_lookup_would_have_drafted(tmp_path, model_path, plain):
    """Off, the adapter still looks up the chain it would have drafted at every step,
    returns nothing, and reports how each fared against the tokens llama.cpp then
    emitted: each reported shadow is recomputed here with the binding's lookup on the
    final output, and the controller counts every one as acceptance evidence."""
    ids, reference = plain
    serve = serve_policy(tmp_path, static(0))
    llm, draft, agent = controlled(model_path, serve.target, "llama-shadow")
    try:
        until_planned(llm, draft, agent, ids, Decision.off())
        warm = draft.stats.steps
        assert run_prompts(llm, draft, ids, "shadow") == reference  # shadows change nothing emitted
        assert draft.stats.lookup_calls == 0 and all(r.drafted == 0 for r in draft.records)
        assert 0 < draft.stats.shadow_lookups < draft.stats.steps  # one open at a time (worker/sdk/shadow.py)
        wait_for(lambda: agent.stats.steps_confirmed >= draft.stats.steps, what="receipts for every step")
        status = wait_for(lambda: next((w for w in fetch_status(serve.target).workers
                                        if w.hello.worker_id == "llama-shadow"
                                        and w.shadow_drafts == draft.stats.shadow_drafts), None),
                          what="the controller to count every shadow draft")
        assert status.shadow_drafts_ignored == 0
    finally:
        agent.close()
        serve.stop()
    steps = recorded_steps(serve.record, "llama-shadow")[warm:]
    tokens = {f"shadow-{i}": ids[i] + reference[i] for i in range(len(ids))}
    checked = accepted = 0
    for step in steps:
        row = step["requests"][0]
        for shadow in row.get("shadows", ()):
            full = tokens[row["request_id"]]
            c = shadow["context_len"]
            draft_tokens = LlamaPromptLookupDecoding.find_candidate_pred_tokens(
                input_ids=np.array(full[: c + 1], dtype=np.intc), max_ngram_size=2, num_pred_tokens=8).tolist()
            emitted = full[c + 1:]
            matched = 0
            while matched < len(draft_tokens) and matched < len(emitted) and draft_tokens[matched] == emitted[matched]:
                matched += 1
            assert (shadow.get("depth", 0), shadow.get("accepted", 0), shadow["requested_depth"]) == (
                len(draft_tokens), matched, 8), (row["request_id"], c)
            checked += 1
            accepted += matched
    assert checked >= len(ids) * 5 and accepted > 0


class LoggingLookup(LlamaPromptLookupDecoding):
    """llama.cpp's own prompt lookup at a fixed depth, logging inside the draft
    object what the engine kept between its calls (no adapter involved)."""

    def __init__(self, depth: int) -> None:
        super().__init__(num_pred_tokens=depth)
        self.steps: list[tuple[int, int]] = []  # (drafted, accepted) per credited step
        self._last: tuple[int, int] | None = None  # (input length, drafted) of the previous call

    def new_request(self) -> None:
        self._last = None

    def __call__(self, input_ids, /, **kwargs):
        if self._last is not None:
            length, drafted = self._last
            self.steps.append((drafted, len(input_ids) - length - 1))
        draft = super().__call__(input_ids)
        self._last = (len(input_ids), len(draft))
        return draft


def test_controller_sees_the_accepted_lengths_llamacpp_produced(tmp_path, model_path, plain):
    ids, reference = plain
    depth = 3
    serve = serve_policy(tmp_path, static(depth))
    llm, draft, agent = controlled(model_path, serve.target, "llama-accepts")
    try:
        until_planned(llm, draft, agent, ids, Decision.chain(depth))
        warm = draft.stats.steps
        assert run_prompts(llm, draft, ids, "acc") == reference
        wait_for(lambda: agent.stats.steps_confirmed >= draft.stats.steps, what="receipts for every step")
    finally:
        agent.close()
        serve.stop()
    seen = [(s["requests"][0].get("depth", 0), s["requests"][0].get("accepted", 0))
            for s in recorded_steps(serve.record, "llama-accepts")][warm:]

    logger = LoggingLookup(depth)
    llm2 = Llama(model_path=model_path, draft_model=logger, logits_all=True, **LLAMA_KW)
    logged = []
    for prompt in ids:
        logger.new_request()
        before = len(logger.steps)
        assert greedy(llm2, prompt) == reference[ids.index(prompt)]
        logged += logger.steps[before:]
    assert seen == logged
    assert sum(a for _, a in seen) > 0 and any(d == depth for d, _ in seen)


def test_controller_down_the_adapter_keeps_its_last_plan(tmp_path, model_path, plain):
    ids, reference = plain
    serve = serve_policy(tmp_path, static(4))
    llm, draft, agent = controlled(model_path, serve.target, "llama-cutoff")
    try:
        until_planned(llm, draft, agent, ids, Decision.chain(4))
        serve.stop(kill=True)
        wait_for(lambda: not agent.stats.connected, what="the agent to notice")
        before = len(draft.records)
        assert run_prompts(llm, draft, ids, "cut") == reference
        new = draft.records[before:]
        assert new and {r.requested_depth for r in new} == {4}
        assert sum(r.accepted for r in new) > 0
        assert agent.stats.plan_version >= 1 and not agent.stats.connected
    finally:
        agent.close()
        serve.stop()


def test_adapter_refuses_a_lossy_or_broken_llama(model_path):
    class Quiet:
        def decide(self, request_id, context_len, batch_size):
            return Decision.off()

        def observe(self, step): ...

        def finish(self, summary): ...

    draft = ControlledPromptLookup()
    llm = Llama(model_path=model_path, draft_model=draft, logits_all=True, **{**LLAMA_KW, "flash_attn": False})
    with pytest.raises(ValueError, match="no agent"):
        draft.attach(llm)
    with pytest.raises(ValueError, match="flash_attn"):
        draft.attach(llm, Quiet())
    draft = ControlledPromptLookup(Quiet())
    llm = Llama(model_path=model_path, draft_model=draft, **LLAMA_KW)  # logits_all left False
    with pytest.raises(ValueError, match="logits_all"):
        draft.attach(llm)
    other = ControlledPromptLookup(Quiet())
    with pytest.raises(ValueError, match="draft_model"):
        other.attach(llm)
    with pytest.raises(RuntimeError, match="attach"):
        other(np.arange(5, dtype=np.intc))
