"""Start-up calibration on a real (tiny, seeded) model: the engine's own verify
step timed at every shape of the grid."""

from __future__ import annotations

import pytest
import torch

from worker.reference.engine.calibrate import calibrate_verify, calibration_grid
from worker.reference.models import tiny_llama


def test_every_shape_of_the_grid_is_timed_through_the_engine():
    torch.set_num_threads(1)
    model, _ = tiny_llama(seed=0)
    timings = calibrate_verify(model, max_batch=4, max_nodes=5, context_len=16, repeats=2, progress=False)
    grid = calibration_grid(4, 5)
    assert [(t.batch_size, t.batch_tokens) for t in timings] == [(b, b * (1 + n)) for b, n in grid]
    assert all(t.verify_ms > 0 and t.repeats == 2 for t in timings)
    # Every request holds its prompt (16 tokens) and what the steps before committed: the
    # shapes of one batch size take turns, each step adds a token per row, so later shapes
    # of a round read more context.
    assert all(t.kv_tokens >= 16 * t.batch_size for t in timings)
    for batch in (1, 2, 4):
        kv = [t.kv_tokens for t in timings if t.batch_size == batch]
        assert all(a < b for a, b in zip(kv, kv[1:])), (batch, kv)


def test_bad_grid_arguments_are_refused():
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        calibration_grid(0, 4)
    model, _ = tiny_llama(seed=0)
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        calibrate_verify(model, 1, 1, repeats=0)
