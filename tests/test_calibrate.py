"""Start-up calibration on a real (tiny, seeded) model: the engine's own verify
step timed at every shape of the grid."""

from __future__ import annotations

import pytest
import torch

from worker.reference.engine import calibrate
from worker.reference.engine.calibrate import calibrate_verify, calibration_grid
from worker.reference.models import tiny_llama


def test_every_shape_of_the_grid_is_timed_through_the_engine():
    torch.set_num_threads(1)
    model, _ = tiny_llama(seed=0)
    timings = calibrate_verify(model, max_batch=4, max_nodes=5, context_len=16, repeats=2, progress=False)
    grid = calibration_grid(4, 5)
    assert [(t.batch_size, t.batch_tokens) for t in timings] == [(b, b * (1 + n)) for b, n in grid]
    assert all(t.verify_ms > 0 and t.repeats == 2 for t in timings)
    # Every request holds its prompt (16 tokens) and what the steps before committed.
    assert all(t.kv_tokens >= 16 * t.batch_size for t in timings)


def test_each_round_steps_every_shape_once_in_a_fresh_seeded_order(monkeypatch):
    torch.set_num_threads(1)
    model, _ = tiny_llama(seed=0)
    seen: list[int] = []
    propose = calibrate._ChainDrafter.propose

    def spy(self, contexts, decisions):  # the node count each calibration step asks for
        seen.append(decisions[0].max_nodes if decisions[0].depth else 0)
        return propose(self, contexts, decisions)

    monkeypatch.setattr(calibrate._ChainDrafter, "propose", spy)
    calibrate_verify(model, max_batch=1, max_nodes=5, context_len=16, repeats=4, progress=False)
    shapes = [n for _, n in calibration_grid(1, 5)]
    rounds = [seen[i:i + len(shapes)] for i in range(0, len(seen), len(shapes))]
    assert len(rounds) == 5  # the warm-up round and four timed ones
    assert all(sorted(r) == shapes for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1, rounds
    # No shape always follows the same one (a fixed order put 0 after the largest every round).
    after_zero = {r[r.index(0) - 1] if r.index(0) else None for r in rounds}
    assert len(after_zero) > 1, rounds
    first = list(seen)
    seen.clear()
    calibrate_verify(model, max_batch=1, max_nodes=5, context_len=16, repeats=4, progress=False)
    assert seen == first  # seeded: the same sequence of shapes again


def test_bad_grid_arguments_are_refused():
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        calibration_grid(0, 4)
    model, _ = tiny_llama(seed=0)
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        calibrate_verify(model, 1, 1, repeats=0)
