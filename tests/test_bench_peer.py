"""The engine benchmark's turn-taking runners on the tiny seeded model: the transformers peer, stepped one forward at a time
(``bench.engine._SteppedGenerate``) on the tiny seeded model."""

from __future__ import annotations

import threading

import pytest
import torch

from bench.engine import _SteppedGenerate
from worker.reference.models import tiny_llama

pytestmark = pytest.mark.model


@pytest.mark.parametrize("k", [0, 2])
def test_peer_runs_exactly_one_forward_per_step_and_decodes_as_generate(k):
    model, vocab = tiny_llama(seed=3)
    g = torch.Generator().manual_seed(4)
    ids = [torch.randint(0, vocab, (5,), generator=g).repeat(3).tolist() for _ in range(2)]
    with torch.inference_mode():
        expected = []
        for p in ids:
            x = torch.tensor([p])
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=9,
                               prompt_lookup_num_tokens=k or None)
            expected.append(y[0, len(p):].tolist())
    ran, query_lens = [0], []
    counter = model.register_forward_hook(lambda *_: ran.__setitem__(0, ran[0] + 1))
    lens = model.register_forward_pre_hook(lambda _m, _a, kw: query_lens.append(kw["input_ids"].shape[1]),
                                           with_kwargs=True)
    peer = _SteppedGenerate(model, ids, 9, k)
    try:
        assert ran[0] == 0 and peer.has_work()  # parked before its first forward
        steps, cpu = 0, 0.0
        while peer.has_work():
            before = ran[0]
            secs, step_cpu = peer.step()
            steps += 1
            cpu += step_cpu
            assert ran[0] - before == 1 and secs >= 0 and step_cpu >= 0  # one forward per turn, no more
    finally:
        peer.close()
        counter.remove()
        lens.remove()
    assert peer.outputs == expected
    assert peer.forwards == ran[0] == steps  # the last turn also runs generate out
    assert cpu > 0
    decode_lens = [n for n in query_lens if n <= k + 1]  # past the prefills
    assert (max(decode_lens) == k + 1) if k else (set(decode_lens) == {1})  # lookup drafts reached the target


def test_closing_a_peer_mid_run_stops_it_at_its_next_forward():
    model, vocab = tiny_llama(seed=5)
    ran = [0]
    counter = model.register_forward_hook(lambda *_: ran.__setitem__(0, ran[0] + 1))
    peer = _SteppedGenerate(model, [[1, 2, 3, 4], [5, 6, 7]], 20, 0)
    peer.step()
    peer.close()
    counter.remove()
    assert not peer._thread.is_alive()
    assert not model._forward_pre_hooks
    assert ran[0] == 1 and peer.outputs == []  # the forward it was parked before never ran, nor the rest


def test_engine_runner_takes_one_engine_step_per_turn_in_a_thread_of_its_own():
    from bench.engine import _SteppedEngine
    from policies.table import Decision
    from worker.reference.drafters.ngram import NgramDrafter
    from worker.reference.engine.engine import Engine, static_decide

    model, vocab = tiny_llama(seed=6)
    g = torch.Generator().manual_seed(7)
    ids = [torch.randint(0, vocab, (4,), generator=g).repeat(3).tolist() for _ in range(3)]
    expected = Engine(model, max_batch=2).generate(ids, 8)
    threads = []
    base = getattr(model, model.base_model_prefix)
    hook = base.register_forward_pre_hook(lambda *_: threads.append(threading.current_thread().name))
    engine = Engine(model, NgramDrafter(), static_decide(Decision.chain(2)), max_batch=2)
    reqs = [engine.submit(p, 8) for p in ids]
    runner = _SteppedEngine(engine, "engine-under-test")
    try:
        assert engine.stats.steps == 0 and not threads and runner.has_work()  # parked before its first step
        turns, cpu = 0, 0.0
        while runner.has_work():
            before = engine.stats.steps
            secs, step_cpu = runner.step()
            turns += 1
            cpu += step_cpu
            assert engine.stats.steps - before == 1 and secs >= 0 and step_cpu >= 0
    finally:
        runner.close()
        hook.remove()
        prefill_and_steps = len(threads)
    assert [r.output for r in reqs] == expected
    assert turns == engine.stats.steps == runner.turns and cpu > 0
    assert prefill_and_steps > turns and set(threads) == {"engine-under-test"}  # never the driver's thread


def test_a_failing_engine_step_surfaces_in_the_driver_with_the_runner_named():
    from bench.engine import _SteppedEngine
    from worker.reference.drafters.ngram import NgramDrafter
    from worker.reference.engine.engine import Engine

    def decide(request_id, context_len, batch_size):
        raise ValueError("policy exploded")

    model, _ = tiny_llama(seed=8)
    engine = Engine(model, NgramDrafter(), decide, max_batch=1)
    engine.submit([1, 2, 3, 1, 2], 6)
    runner = _SteppedEngine(engine, "engine-ngram-broken")
    try:
        with pytest.raises(RuntimeError, match="engine-ngram-broken failed") as err:
            runner.step()
        assert "policy exploded" in str(err.value.__cause__)
        assert not runner.has_work()
    finally:
        runner.close()
