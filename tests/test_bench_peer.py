"""The engine benchmark's transformers peer, stepped one forward at a time
(``bench.engine._SteppedGenerate``) on the tiny seeded model."""

from __future__ import annotations

import pytest
import torch

from bench.engine import _SteppedGenerate
from worker.models import tiny_llama

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
