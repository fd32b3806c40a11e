"""One step-cost table against another: what ``specctl calibrate --compare`` prints.

Two tables of the ``hardware_tables`` schema (``specctl calibrate`` writes
one on any device; ``h200-llama3-8b.json`` was measured apart, with CUDA
graphs and a packed attention) priced at the first table's own grid points,
the second read the way the simulator reads it (:class:`~worker.sim.measured.CostGrid`:
linear between its points). Points outside the second table's grid are left
out and counted, never extrapolated.

Two views, because decisions use the second: the ratio of step times
(``measured / reference``) per point, and the ratio of the *ratios* a
speculation decision weighs, the cost of ``q`` tokens per request over one
at the same batch and context (``q_over_1``): a table that is uniformly
slower still ranks the shapes the same way.

Examples
--------
>>> from worker.sim.measured import StepCostTable
>>> rows = [{"batch": b, "tokens_per_request": q, "context": c, "verify_ms": 2.0 * b + q + c / 512}
...         for b in (1, 8) for q in (1, 4) for c in (512, 1024)]
>>> draft = [{"batch": b, "width": w, "context": c, "draft_level_ms": 0.5 * w} for b in (1, 8) for w in (1, 2)
...          for c in (512, 1024)]
>>> ref = StepCostTable.from_json({"model": {}, "verify": rows, "draft": draft}, "ref")
>>> slow = StepCostTable.from_json({"model": {}, "verify": [dict(r, verify_ms=1.5 * r["verify_ms"]) for r in rows],
...                                 "draft": draft}, "slow")
>>> c = compare_tables(slow, ref)
>>> c.verify.median, c.q_over_1.median, c.draft.median, c.verify.points, c.shapes_differ
(1.5, 1.0, 1.0, 8, [])
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from worker.sim.measured import CostGrid, StepCostTable

__all__ = ["SHAPE_FIELDS", "RatioSummary", "TableComparison", "compare_tables"]

# The model fields that make two tables time the same forward (dtype and the draft vocabulary aside).
SHAPE_FIELDS = ("hidden", "heads", "kv_heads", "head_dim", "ffn", "layers", "vocab")


@dataclass(frozen=True)
class RatioSummary:
    """Ratios ``measured / reference`` over the points both tables cover."""

    points: int
    median: float | None
    p10: float | None
    p90: float | None
    min: float | None
    max: float | None
    by_batch: dict[int, float] = field(default_factory=dict)  # median ratio per batch size

    @classmethod
    def of(cls, ratios: list[float], batches: list[int]) -> "RatioSummary":
        if not ratios:
            return cls(0, None, None, None, None, None)
        r = np.asarray(ratios, dtype=float)
        by_batch = {int(b): _round(float(np.median(r[np.asarray(batches) == b]))) for b in sorted(set(batches))}
        return cls(len(r), _round(float(np.median(r))), _round(float(np.percentile(r, 10))),
                   _round(float(np.percentile(r, 90))), _round(float(r.min())), _round(float(r.max())), by_batch)


@dataclass(frozen=True)
class TableComparison:
    """``measured`` priced against ``reference`` (:func:`compare_tables`)."""

    measured: str
    reference: str
    shapes_differ: list[str]  # model fields the two tables disagree on (ratios then compare different models)
    verify: RatioSummary  # verify_ms ratio per point
    q_over_1: RatioSummary  # (verify of q tokens / verify of 1 token) measured, over the reference's, q > 1
    draft: RatioSummary  # one draft level's ratio per point
    left_out: dict[str, int]  # points of the measured table outside the reference's grid, per kind
    verify_points: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[str]:
        """What ``specctl calibrate --compare`` prints."""
        def row(name: str, s: RatioSummary) -> str:
            if not s.points:
                return f"  {name}: no point inside the reference's grid"
            per_batch = ", ".join(f"b{b} {v:.2f}" for b, v in s.by_batch.items())
            return (f"  {name}: median {s.median:.3f} (p10 {s.p10:.3f}, p90 {s.p90:.3f}, {s.min:.3f}-{s.max:.3f}) "
                    f"over {s.points} points; per batch {per_batch}")

        out = [f"{self.measured} against {self.reference} (measured / reference):"]
        if self.shapes_differ:
            out.append(f"  the tables are of different models ({', '.join(self.shapes_differ)} differ)")
        out += [row("verify ms", self.verify),
               row("q tokens / 1 token", self.q_over_1), row("draft level ms", self.draft)]
        if any(self.left_out.values()):
            out.append("  outside the reference's grid, left out: "
                       + ", ".join(f"{n} {k}" for k, n in self.left_out.items() if n))
        return out


def compare_tables(measured: StepCostTable, reference: StepCostTable) -> TableComparison:
    """Price ``measured``'s grid points with both tables; see the module docstring."""
    verify_points, ratios, batches, left_out = [], [], [], {"verify": 0, "draft": 0}
    own = {}
    for b, q, c, ms in _points(measured.verify):
        if not _inside(reference.verify, b, q, c):
            left_out["verify"] += 1
            continue
        ref = float(reference.verify(b, q, c))
        own[(b, q, c)] = (ms, ref)
        verify_points.append({"batch": b, "tokens_per_request": q, "context": c, "measured_ms": _round(ms),
                              "reference_ms": _round(ref), "ratio": _round(ms / ref)})
        ratios.append(ms / ref)
        batches.append(b)
    q_ratios, q_batches = [], []
    for (b, q, c), (ms, ref) in own.items():
        if q > 1 and (b, 1, c) in own:
            ms1, ref1 = own[(b, 1, c)]
            q_ratios.append((ms / ms1) / (ref / ref1))
            q_batches.append(b)
    d_ratios, d_batches = [], []
    for b, w, c, ms in _points(measured.draft):
        if not _inside(reference.draft, b, w, c):
            left_out["draft"] += 1
            continue
        d_ratios.append(ms / float(reference.draft(b, w, c)))
        d_batches.append(b)
    differ = [k for k in SHAPE_FIELDS if measured.shapes.get(k) != reference.shapes.get(k)]
    return TableComparison(measured.source, reference.source, differ, RatioSummary.of(ratios, batches),
                           RatioSummary.of(q_ratios, q_batches), RatioSummary.of(d_ratios, d_batches), left_out,
                           verify_points)


def _points(grid: CostGrid):
    """``(batch, tokens or width, context, ms)`` of every point a table measured."""
    for (i, j, k), ms in np.ndenumerate(grid.ms):
        if grid.measured[i, j, k]:
            yield int(grid.batch[i]), int(grid.tokens[j]), int(grid.context[k]), float(ms)


def _inside(grid: CostGrid, b: int, q: int, c: int) -> bool:
    return (grid.batch[0] <= b <= grid.batch[-1] and grid.tokens[0] <= q <= grid.tokens[-1]
            and grid.context[0] <= c <= grid.context[-1])


def _round(x: float) -> float:
    return round(x, 4)
