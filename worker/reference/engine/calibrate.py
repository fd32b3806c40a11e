"""Start-up calibration: the engine times its own verify step at the batch
shapes it may be asked to run, before it serves anything.

A controller fitting step costs from traffic alone knows only the shapes
the traffic has run. On the AMD EPYC the reference worker first ran on, a
forward cost the same for 1–6 tokens and ~20 % more from the 7th (on an
Intel Xeon since, each token adds ~7–10 %); a controller that has seen 5 and
7 tokens interpolates 6 half-way up the step and never plans the 5-node
tree that fits under it. The worker times every shape of a small grid
(a warm-up round and five timed rounds: ~20–35 s for SmolLM2 on this CPU)
and sends the medians in its ``Hello.calibration``; the controller's cost
model starts from them.

What is timed is the engine's real verify (``Engine.step``'s forward, LM
head, acceptance and KV compaction — what ``StepTelemetry.verify_ms``
reports) over prompts of ``context_len`` tokens, with a drafter that
proposes chains of fixed length: which tokens it proposes does not change
the cost of verifying them.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from policies.table import Decision
from worker.reference.drafters.base import DraftContext, DrafterLimits, DraftTree

__all__ = ["VerifyTiming", "calibrate_verify", "calibration_grid"]


@dataclass(frozen=True)
class VerifyTiming:
    """Median verify time of one batch shape (``Hello.calibration`` entry)."""

    batch_size: int
    batch_tokens: int  # batch_size · (1 + nodes per row): the padded forward
    kv_tokens: int
    verify_ms: float
    repeats: int


class _ChainDrafter:
    """Proposes a chain of ``decision.max_nodes`` copies of the root token."""

    kind = "calibration"
    version = "calibration"
    needs_hidden = False

    def __init__(self, max_nodes: int) -> None:
        self.limits = DrafterLimits(self.kind, self.version, max_nodes, 1, max_nodes)

    def propose(self, contexts: Sequence[DraftContext], decisions: Sequence[Decision]) -> list[DraftTree]:
        return [DraftTree.chain([c.tokens[-1]] * d.max_nodes) if d.depth else DraftTree()
                for c, d in zip(contexts, decisions)]

    def release(self, request_id: str) -> None:
        pass


class _VerifyTimes:
    """Engine observer keeping ``(verify_ms, context tokens)`` of the steps since the last ``clear``."""

    def __init__(self) -> None:
        self.times: list[tuple[float, int]] = []

    def observe(self, step) -> None:
        self.times.append((step.verify_ms, sum(r.context_len for r in step.requests)))

    def finish(self, summary) -> None:
        pass


def calibration_grid(max_batch: int, max_nodes: int) -> list[tuple[int, int]]:
    """``(batch size, draft nodes per row)`` shapes to time: at batch 1 every
    node count up to 12 and a few beyond (where trees live and CPU steps
    sit), at batch 2, 4, 8, ... up to ``max_batch`` the widths a plan gives
    every row of a busy batch.

    >>> calibration_grid(4, 24)[:5], calibration_grid(4, 24)[-3:]
    ([(1, 0), (1, 1), (1, 2), (1, 3), (1, 4)], [(4, 3), (4, 5), (4, 7)])
    """
    if max_batch < 1 or max_nodes < 0:
        raise ValueError(f"max_batch must be >= 1 and max_nodes >= 0, got {max_batch}, {max_nodes}")
    single = sorted({n for n in (*range(13), 15, 19, 23) if n <= max_nodes})
    grid = [(1, n) for n in single]
    batch = 2
    while batch <= max_batch:
        grid += [(batch, n) for n in (0, 1, 2, 3, 5, 7) if n <= max_nodes]
        batch *= 2
    return grid


@torch.inference_mode()
def calibrate_verify(model, max_batch: int, max_nodes: int, context_len: int = 128, repeats: int = 5,
                     seed: int = 0, progress: bool = True) -> list[VerifyTiming]:
    """Time ``Engine.step``'s verify at every shape of :func:`calibration_grid`:
    one engine per batch size (one prefill), a warm-up round and ``repeats``
    timed rounds over its shapes, each round in a fresh order drawn from
    ``seed``; the median per shape is kept."""
    from worker.reference.engine.engine import Engine
    from worker.reference.progress import ProgressBar

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    grid = calibration_grid(max_batch, max_nodes)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    out: list[VerifyTiming] = []
    bar = ProgressBar(len(grid), "calibrating verify", enabled=progress)
    for batch in sorted({b for b, _ in grid}):
        shapes = [n for b, n in grid if b == batch]
        current = [Decision.off()]
        timer = _VerifyTimes()
        engine = Engine(model, _ChainDrafter(max(shapes)), lambda rid, ctx, b: current[0], observer=timer,
                        max_batch=batch, eos_token_id=-1)
        steps = len(shapes) * (repeats + 1)
        # Low ids are the tokenizer's specials; any other ids give the same cost.
        for _ in range(batch):
            prompt = torch.randint(min(100, vocab // 2), vocab, (context_len,), generator=gen, device="cpu").tolist()
            engine.submit(prompt, steps * (max(shapes) + 1) + 1)
        # Every round steps every shape once, so a slow minute of a shared machine
        # falls on every shape alike, not on a run of neighbours (which would carve
        # a false step into the curve); each round in a fresh seeded order, so no
        # shape is always timed right after the same one (in a fixed order, batch
        # 1's one-token step always followed the 23-node one). Round 0 warms up.
        order = random.Random(seed * 1_000_003 + batch)
        by_shape: dict[int, list[tuple[float, int]]] = {n: [] for n in shapes}
        for round_ in range(repeats + 1):
            shuffled = list(shapes)
            order.shuffle(shuffled)
            for nodes in shuffled:
                current[0] = Decision(nodes, 1, nodes) if nodes else Decision.off()
                timer.times.clear()
                engine.step()
                if round_:
                    by_shape[nodes] += timer.times
        for nodes in shapes:
            timed = by_shape[nodes]
            out.append(VerifyTiming(batch, batch * (1 + nodes), int(statistics.median(kv for _, kv in timed)),
                                    float(statistics.median(ms for ms, _ in timed)), len(timed)))
            bar.update(1)
    bar.close()
    return out
