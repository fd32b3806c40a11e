"""Torch's thread count reaches the threads that run a model: MKL keeps its
count per thread, so a thread started later runs MKL on every core unless it
applies the process's count itself (``worker.reference.threads.inherit_threads``)."""

from __future__ import annotations

import ctypes
import os
import threading

import pytest
import torch

from worker.reference.drafters.ngram import NgramDrafter
from worker.reference.load import generate_request
from worker.reference.models import tiny_llama
from worker.reference.server import ReferenceWorker, WorkerOptions
from worker.reference.threads import inherit_threads, set_threads


def _mkl_max_threads():
    """MKL's thread count in the calling thread (torch links MKL in ``libtorch_cpu``), or None."""
    try:
        return ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")).mkl_get_max_threads
    except (OSError, AttributeError):
        return None


MKL = _mkl_max_threads()


def _in_new_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


@pytest.fixture
def one_thread():
    if MKL is None:
        pytest.skip("this torch build has no MKL")
    before = torch.get_num_threads()
    set_threads(1)
    if _in_new_thread(MKL) == 1:
        pytest.skip("MKL defaults to one thread here: nothing to inherit")
    yield
    torch.set_num_threads(before)


def test_a_new_thread_runs_mkl_on_the_process_count_once_it_inherits(one_thread):
    assert MKL() == 1  # a thread without inherit_threads gets more (the fixture skips where it would not)
    assert _in_new_thread(lambda: (inherit_threads(), MKL())[1]) == 1


@pytest.mark.model
def test_the_workers_engine_thread_runs_mkl_on_the_process_count(one_thread):
    model, _ = tiny_llama(seed=0)
    seen = []
    base = getattr(model, model.base_model_prefix)
    hook = base.register_forward_pre_hook(lambda *_: seen.append((threading.current_thread().name, MKL())))
    worker = ReferenceWorker(model, None, NgramDrafter(), "tiny",
                             WorkerOptions(listen="127.0.0.1:0", drafter="ngram", static="2")).start()
    try:
        out = generate_request(worker.address, {"prompt_ids": [5, 9, 14, 5, 9], "max_new_tokens": 4})
    finally:
        worker.stop()
        hook.remove()
    assert out["generated_tokens"] == 4
    assert seen and {name for name, _ in seen} == {"specctl-engine"}
    assert {count for _, count in seen} == {1}


@pytest.mark.model
@pytest.mark.parametrize("runner", ["engine", "transformers"])
def test_the_engine_benchs_runners_run_mkl_on_the_process_count(one_thread, runner):
    from bench.engine import _SteppedEngine, _SteppedGenerate
    from worker.reference.engine.engine import Engine

    model, _ = tiny_llama(seed=1)
    seen = []
    hook = model.model.register_forward_pre_hook(lambda *_: seen.append(MKL()))  # the decoder: both run it
    if runner == "engine":
        engine = Engine(model, max_batch=1)
        engine.submit([1, 2, 3, 4], 3)
        stepped = _SteppedEngine(engine, "engine-plain")
    else:
        stepped = _SteppedGenerate(model, [[1, 2, 3, 4]], 3, 0)
    try:
        while stepped.has_work():
            stepped.step()
    finally:
        stepped.close()
        hook.remove()
    assert len(seen) == 3 and set(seen) == {1}  # prefill + two steps, or generate's three forwards
