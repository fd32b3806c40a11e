"""The reference worker off the CPU, checked on a CPU-only machine.

On a GPU every tensor the engine, the drafters, head training and the step
timer build must sit where the model is: one made on torch's default device
(the CPU) and then mixed with the model's features fails there, and nowhere
here, since the model is on the CPU too. So this suite runs each of them
for real (the tiny seeded model, the off-CPU code path: cascade attention,
no tuned kernels) under :class:`DefaultDeviceTrap`, which records every
tensor factory that our code calls without naming a device. A host tensor
says ``device="cpu"`` and is moved on purpose; a device tensor names the
model's device. What it cannot see is a tensor named ``cpu`` and then mixed
with the device's by mistake: on a machine with a GPU the same suite runs
there with ``SPECCTL_TEST_DEVICE=cuda`` (the tiny model on the GPU, the
lossless checks against plain decoding on the same device), the first thing
a session lent one should run (docs/reference-worker.md).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from policies.table import Decision
from worker.reference.drafters.eagle import EagleDrafter
from worker.reference.drafters.medusa import MedusaDrafter
from worker.reference.engine.engine import Engine, static_decide
from worker.reference.heads.modules import EagleHead
from worker.reference.heads.store import HeadsBundle
from worker.reference.models import tiny_llama

DEVICE = torch.device(os.environ.get("SPECCTL_TEST_DEVICE", "cpu"))
WORKER = str(Path(__file__).resolve().parents[1] / "worker" / "reference")
TORCH = str(Path(torch.__file__).resolve().parent)

# Factories whose result lands on the default device unless told otherwise.
FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.tensor, torch.eye, torch.rand,
             torch.randn, torch.randint, torch.randperm, torch.linspace, torch.as_tensor, torch.tril_indices}


class DefaultDeviceTrap(TorchFunctionMode):
    """Records ``file:line factory`` for each tensor factory called from
    ``roots`` without ``device=``. Let through: ``torch.as_tensor`` of a
    tensor (it keeps its device) and a module's ``__init__`` (parameters and
    buffers are made where modules are made and move with ``.to``)."""

    def __init__(self, roots: tuple[str, ...] = (WORKER,)) -> None:
        super().__init__()
        self.roots = roots
        self.hits: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and "device" not in kwargs and not (
                func is torch.as_tensor and args and isinstance(args[0], torch.Tensor)):
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith(TORCH):
                frame = frame.f_back
            if (frame is not None and frame.f_code.co_filename.startswith(self.roots)
                    and not (frame.f_code.co_name == "__init__"
                             and isinstance(frame.f_locals.get("self"), torch.nn.Module))):
                where = f"{Path(frame.f_code.co_filename).relative_to(Path(WORKER).parent.parent)}:{frame.f_lineno}"
                self.hits.append(f"{where} torch.{func.__name__}")
        return func(*args, **kwargs)


def _trapped(run):
    trap = DefaultDeviceTrap()
    with trap:
        result = run()
    return result, sorted(set(trap.hits))


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    model, vocab = tiny_llama(seed=3)
    return model.to(DEVICE), vocab


def _medusa(model, vocab):
    torch.manual_seed(1)
    b = HeadsBundle.build("medusa", {"hidden": model.config.hidden_size, "num_heads": 3}, torch.arange(vocab))
    for p in (b.module.weight, b.module.bias):
        torch.nn.init.normal_(p, std=0.05)
    return MedusaDrafter(b, model, max_width=3, max_tree_nodes=8)


def _eagle(model, vocab):
    torch.manual_seed(2)
    b = HeadsBundle.build("eagle", EagleHead.config_from_target(model.config), torch.arange(vocab))
    for p in b.module.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return EagleDrafter(b, model, max_depth=4, max_width=3, max_tree_nodes=8)


PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9], [40, 41, 42, 43], [7] * 11, [100, 3, 100, 3, 100]]


def test_the_trap_sees_a_factory_without_a_device(tiny):
    """The check itself: a factory from the worker's code without ``device=`` is seen, one with it is not."""
    trap = DefaultDeviceTrap(roots=(str(Path(__file__).resolve()),))
    with trap:
        torch.zeros(2)
        torch.zeros(2, device="cpu")
    assert trap.hits == [f"tests/test_device_discipline.py:{_line_of('torch.zeros(2)')} torch.zeros"]


def _line_of(text: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.strip() == text)


@pytest.mark.parametrize("kind", ["none", "ngram", "medusa", "eagle"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_engine_and_its_drafters_name_every_device(tiny, kind, temperature):
    """Every drafter, greedy and sampled, on the off-CPU path (cascade attention), catch-ups included."""
    from worker.reference.drafters.ngram import NgramDrafter

    model, vocab = tiny
    plain = Engine(model, max_batch=2, cascade=True, temperature=temperature, seed=4).generate(PROMPTS, 14)
    drafter = {"none": lambda: None, "ngram": NgramDrafter, "medusa": lambda: _medusa(model, vocab),
               "eagle": lambda: _eagle(model, vocab)}[kind]()
    calls = [0]

    def decide(request_id, context_len, batch):  # off now and then: EAGLE queues and catches up
        calls[0] += 1
        return Decision.off() if calls[0] % 4 == 0 else Decision(3, 2, 5)

    out, hits = _trapped(lambda: Engine(model, drafter, decide if drafter else None, max_batch=2, cascade=True,
                                        temperature=temperature, seed=4).generate(PROMPTS, 14))
    assert hits == []
    if temperature == 0.0:
        assert out == plain  # lossless on this path too


def test_head_training_names_every_device(tiny):
    """Answers, features, both trainers (EAGLE unrolled, with input noise) and the held-out report."""
    from worker.reference.heads.data import build_distill_set
    from worker.reference.heads.train import TrainConfig, train
    from worker.reference.prompts import Prompt

    model, vocab = tiny
    prompts = [Prompt(f"p{i}", "rand", " ".join(str((7 * i + 3 * j) % vocab) for j in range(4 + i % 5)))
               for i in range(12)]

    def run():
        ds = build_distill_set(model, None, prompts, "tiny", max_new_tokens=8, batch=4, cache=False,
                               show_progress=False, encode=lambda text: [int(x) for x in text.split()])
        medusa = train(model, ds, TrainConfig(kind="medusa", epochs=1, draft_vocab=0, num_heads=2,
                                              batch_positions=32), log=None)
        eagle = train(model, ds, TrainConfig(kind="eagle", epochs=1, draft_vocab=0, num_heads=2,
                                             batch_sequences=4, unroll=2), log=None)
        return medusa, eagle

    (medusa, eagle), hits = _trapped(run)
    assert hits == []
    assert medusa.version.startswith("medusa-") and eagle.version.startswith("eagle-")


def test_step_timers_name_every_device(tiny):
    """``specctl calibrate``'s timer (verify rigs, a draft level) and the worker's start-up calibration."""
    from worker.reference.engine.calibrate import calibrate_verify
    from worker.reference.engine.step_costs import StepGrid, measure_step_table

    model, _ = tiny
    grid = StepGrid(batches=(1, 2), tokens=(1, 3), contexts=(8, 16), widths=(1, 2), repeats=1, max_kv_tokens=64)
    table, hits = _trapped(lambda: measure_step_table(model, grid, "tiny", log=lambda line: None))
    assert hits == []
    assert len(table["verify"]) == 8 and len(table["draft"]) == 8
    timings, hits = _trapped(lambda: calibrate_verify(model, 2, 3, context_len=16, repeats=1, progress=False))
    assert hits == []
    assert {t.batch_size for t in timings} == {1, 2}
