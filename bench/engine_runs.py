"""Several engine benchmark runs read together: is the warm controller
behind the best static shape in a cell run after run, or only in one?

One run of ``specctl bench engine`` gives each ratio (controller over
max(best static, plain)) a 90 % interval 5-25 % wide (:mod:`bench.intervals`),
so a controller 2 % behind looks tied in every cell of every run. Runs made
on other days are other draws of the machine's noise, and a cell's ratios
over them say more than any one: a controller tied with the shape it is set
against falls under 1 in about half the runs of a cell, one that is behind
in nearly all. :func:`cross_run` gathers each cell's warm (and cold) ratio
over the runs, main pass and second pass apart, with the runs under 1 and
the two-sided sign test's p-value (:func:`sign_test_p`), per cell and over
all cells. A cell is a drafter, a batch size and the load: run R (stop 38)
decoded its prompts four times over at batch 8 and twice at batch 4 to keep
the batch full (``passes`` in its ``engine.json``), and is never pooled
with the runs of one batch draining there. The warm-up is part of the cell
too: runs before stop 39 warmed their warm controller alone, later ones in
the crowd of the timed lockstep (``controller_warmup`` in ``engine.json``),
and a run with both (``--warmup both``) gives a cell of each, its
``warm-alone`` controller's ratios in the ``alone`` one (its cold ratios
count once, with the crowd-warmed controller). Pooled counts are per
warm-up.

Read the **second pass**: its shape was picked on another measurement (the
main pass), so a controller tied with it sits at 1 in expectation. The main
pass sets the controller against the best of seven noisy static runs picked
on the very measurement, whose luck pulls its ratios under 1 even for a tie.

The runs differ in more than noise (code, heads, kernel tables: the
results index gives each run's commit and what changed), so a pooled mean
is a summary of the project's recent runs, not an estimate of one controller; the sign counts per cell are the evidence.
Each cell also gets the warm-up's first-position acceptance less the
evaluation prompts' (``acceptance_warmup_vs_eval``, top-ranked candidate)
and, over all cells, its correlation with the second pass's ratio: a warm-up
that accepts more than the timed prompts teaches the controller to draft
more than they pay for.

Runs made with a challenger policy (``--challenger-policy``, stop 40) also
give each cell a paired ratio, challenger / warm, timed in one lockstep:
:func:`challenger_pairs` pools them per policy file, per pass and batch
size, with the sign test (``challengers`` in ``engine-runs.json``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

PASSES = ("main", "second")
TAGS = ("warm", "cold")


@dataclass(frozen=True)
class CellRun:
    """One run's ratios in one cell (drafter, batch, passes): ``None`` where the run lacks it."""

    run: str
    drafter: str
    batch: int
    # times its run decoded the prompts at this batch: 1 (one batch draining) but in run R, an
    # experiment of stop 38 that kept the batch full (``passes`` in its engine.json)
    passes: int
    ratios: dict[str, float | None]  # "warm-main", "warm-second", "cold-main", "cold-second"
    acceptance_gap: float | None  # warm-up minus evaluation, first position, top-ranked candidate
    warmup: str = "alone"  # where its warm controller decoded the warm-up: alone, or crowd (the timed lockstep's)


@dataclass(frozen=True)
class Signs:
    """Ratios read for their side of 1: how many are under, how many are off
    1 either way (a tie at exactly 1 is no sign), the two-sided sign test's
    p-value (:func:`sign_test_p`) and the mean of all that are there."""

    under: int
    counted: int
    sign_p: float
    mean: float | None

    @classmethod
    def of(cls, values: Sequence[float | None]) -> "Signs":
        present = [v for v in values if v is not None]
        under = sum(v < 1.0 for v in present)
        counted = sum(v != 1.0 for v in present)
        mean = round(float(np.mean(present)), 4) if present else None
        return cls(under, counted, sign_test_p(under, counted), mean)


@dataclass
class CellSummary:
    """A cell's ratios over the runs, per ``tag-pass``: the values, and their :class:`Signs`."""

    drafter: str
    batch: int
    passes: int
    runs: list[str]
    warmup: str = "alone"
    values: dict[str, list[float | None]] = field(default_factory=dict)
    signs: dict[str, Signs] = field(default_factory=dict)
    acceptance_gaps: list[float | None] = field(default_factory=list)


def sign_test_p(under: int, n: int) -> float:
    """Two-sided exact sign test: the chance, if under and over 1 were equally
    likely, of a split at least as uneven as ``under`` of ``n``.

    >>> sign_test_p(5, 5), sign_test_p(35, 45) < 0.001, sign_test_p(2, 4)
    (0.0625, True, 1.0)
    """
    if not 0 <= under <= n:
        raise ValueError(f"under must be within 0..n, got under={under}, n={n}")
    if n == 0:
        return 1.0
    k = min(under, n - under)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0 ** n
    return min(1.0, 2.0 * tail)


def load_cells(folder: str | Path) -> list[CellRun]:
    """The cells of one run folder's ``engine.json`` (its ``static_vs_controller``)."""
    folder = Path(folder)
    result = json.loads((folder / "engine.json").read_text())
    if "static_vs_controller" not in result:
        raise ValueError(f"{folder / 'engine.json'}: no static_vs_controller (not a run of the fair grid)")
    gaps = {}
    for a in result.get("acceptance_warmup_vs_eval", []):
        warm, evaluation = a.get("warmup_top1_rates") or [None], a.get("eval_top1_rates") or [None]
        if warm[0] is not None and evaluation[0] is not None:
            gaps[(a["drafter"], a["batch"])] = round(warm[0] - evaluation[0], 4)
    # tag of the run's controller -> where it warmed up (runs before stop 39: one, warmed alone)
    warmups = result.get("controller_warmup") or {"warm": "alone"}
    out = []
    for row in result["static_vs_controller"]:
        second = row.get("second_pass") or {}
        passes = int(result.get("passes", {}).get(str(row["batch"]), 1))
        for warm_tag, where in warmups.items():
            # the run's controller each tag reads: its cold one counts once, beside the "warm" controller
            source = {"warm": warm_tag, "cold": "cold" if warm_tag == "warm" else None}
            ratios = {}
            for tag in TAGS:
                ratios[f"{tag}-main"] = row.get(f"{source[tag]}_vs_best_static_or_plain") if source[tag] else None
                ratios[f"{tag}-second"] = second.get(f"{source[tag]}_vs_best_static_or_plain") if source[tag] else None
            # the acceptance rows count the warm controller's warm-up only
            out.append(CellRun(folder.name, row["drafter"], int(row["batch"]), passes, ratios,
                               gaps.get((row["drafter"], row["batch"])) if warm_tag == "warm" else None, where))
    return out


def cross_run(cells: Sequence[CellRun]) -> tuple[list[CellSummary], dict]:
    """Per cell, and over all cells, each ``tag-pass``'s ratios over the runs
    (a tie at exactly 1 counts as neither under nor over, as the sign test
    has it). A cell is a drafter, a batch size, the passes its runs
    decoded there and the warm-up: a batch draining (one pass) and a batch
    kept full (run R's ``passes``) are different loads, a warm-up alone and
    one in the crowd different controllers, never pooled; ``overall`` is
    per warm-up.

    >>> runs = [CellRun(f"r{i}", "eagle", 8, 4, {"warm-second": v}, 0.1) for i, v in enumerate([0.96, 0.95, 0.99, 1.0])]
    >>> cells, overall = cross_run(runs)
    >>> cells[0].signs["warm-second"]
    Signs(under=3, counted=3, sign_p=0.25, mean=0.975)
    >>> overall["alone"]["warm-second"]["under"], overall["alone"]["warm-second"]["sign_p"]
    (3, 0.25)
    """
    keys = [f"{tag}-{p}" for tag in TAGS for p in PASSES]
    order = {"ngram": 0, "medusa": 1, "eagle": 2}
    by_cell: dict[tuple[str, int, int, str], list[CellRun]] = {}
    for c in cells:
        by_cell.setdefault((c.drafter, c.batch, c.passes, c.warmup), []).append(c)
    summaries = []
    for (drafter, batch, passes, warmup), rs in sorted(
            by_cell.items(), key=lambda kv: (kv[0][3] != "alone", kv[0][2], kv[0][1], order.get(kv[0][0], 9), kv[0][0])):
        s = CellSummary(drafter, batch, passes, [r.run for r in rs], warmup,
                        acceptance_gaps=[r.acceptance_gap for r in rs])
        for key in keys:
            s.values[key] = [r.ratios.get(key) for r in rs]
            s.signs[key] = Signs.of(s.values[key])
        summaries.append(s)
    overall: dict[str, dict] = {}
    for warmup in dict.fromkeys(s.warmup for s in summaries):
        mine = [s for s in summaries if s.warmup == warmup]
        overall[warmup] = {}
        for key in keys:
            vals = [v for s in mine for v in s.values[key]]
            o = overall[warmup][key] = {"cells": sum(v is not None for v in vals), **asdict(Signs.of(vals))}
            gaps = [(g, v) for s in mine for g, v in zip(s.acceptance_gaps, s.values[key])
                    if g is not None and v is not None]
            o["acceptance_gap_correlation"] = (
                round(float(np.corrcoef([g for g, _ in gaps], [v for _, v in gaps])[0, 1]), 3)
                if len(gaps) >= 3 and np.std([g for g, _ in gaps]) > 0 and np.std([v for _, v in gaps]) > 0 else None)
    return summaries, overall


def challenger_pairs(folders: Sequence[str | Path]) -> dict[str, dict]:
    """The runs made with a challenger policy (``--challenger-policy``), per
    policy file: every cell's paired ratio challenger / warm (both timed in one
    lockstep), per pass and per batch size, with their :class:`Signs` (under 1:
    the challenger behind). Runs of the same file pool; the warm controllers
    they are set against are each run's own.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     for i, v in enumerate([1.05, 0.98]):
    ...         _ = (Path(tmp) / f"r{i}").mkdir()
    ...         _ = (Path(tmp) / f"r{i}" / "engine.json").write_text(json.dumps({
    ...             "challenger_policy": {"path": "c.yaml", "fields": {"min_gain": 0.05}},
    ...             "static_vs_controller": [{"drafter": "eagle", "batch": 8, "challenger_vs_warm": v,
    ...                                       "second_pass": {"challenger_vs_warm": 1.02}}]}))
    ...     pairs = challenger_pairs([Path(tmp) / "r0", Path(tmp) / "r1"])
    >>> pairs["c.yaml"]["runs"], pairs["c.yaml"]["all"]["under"], pairs["c.yaml"]["all"]["counted"]
    (['r0', 'r1'], 1, 4)
    >>> pairs["c.yaml"]["by_batch"]["8"]["main"]["mean"]
    1.015
    """
    out: dict[str, dict] = {}
    for folder in folders:
        folder = Path(folder)
        result = json.loads((folder / "engine.json").read_text())
        challenger = result.get("challenger_policy")
        if not challenger:
            continue
        entry = out.setdefault(challenger["path"], {"fields": challenger["fields"], "runs": [], "values": []})
        entry["runs"].append(folder.name)
        for row in result.get("static_vs_controller", []):
            for passed, where in (("main", row), ("second", row.get("second_pass") or {})):
                if where.get("challenger_vs_warm") is not None:
                    entry["values"].append((int(row["batch"]), passed, folder.name, row["drafter"],
                                            where["challenger_vs_warm"]))
    for entry in out.values():
        values = entry.pop("values")
        entry["pairs"] = [{"batch": b, "pass": p, "run": r, "drafter": d, "challenger_vs_warm": v}
                          for b, p, r, d, v in values]
        entry["all"] = asdict(Signs.of([v for *_, v in values]))
        entry["by_batch"] = {str(b): {p: asdict(Signs.of([v for bb, pp, *_, v in values if (bb, pp) == (b, p)]))
                                      for p in PASSES}
                             for b in sorted({b for b, *_ in values})}
    return out


def default_run_folders(results: str | Path = "bench/results") -> list[Path]:
    """Every ``engine-run*`` folder under ``results`` whose run has a second pass, in run order."""
    found = []
    for folder in Path(results).glob("engine-run*"):
        path = folder / "engine.json"
        if not path.is_file():
            continue
        rows = json.loads(path.read_text()).get("static_vs_controller", [])
        if any(r.get("second_pass") for r in rows):
            found.append(folder)
    return sorted(found, key=_run_number)


def _run_number(folder: Path) -> tuple[int, str]:
    tail = folder.name.removeprefix("engine-run").split("-")[0]
    return (int(tail) if tail.isdigit() else 10 ** 6, folder.name)


def run_engine_runs(folders: Sequence[str | Path], out_dir: str | Path = "bench/results", plot: bool = True) -> int:
    """Read the run folders, print each cell's warm ratios over them and the
    pooled counts, write ``engine-runs.json`` (and ``engine-runs.png``) in ``out_dir``."""
    if len(folders) < 2:
        raise ValueError(f"bench engine-runs needs two run folders or more, got {len(folders)}")
    cells = [c for f in folders for c in load_cells(f)]
    summaries, overall = cross_run(cells)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    challengers = challenger_pairs(folders)
    result = {"runs": [Path(f).name for f in folders], "cells": [asdict(s) for s in summaries], "overall": overall,
              "challengers": challengers}
    (out / "engine-runs.json").write_text(json.dumps(result, indent=1))
    _print(summaries, overall, [Path(f).name for f in folders])
    _print_challengers(challengers)
    if plot:
        _plot(summaries, out / "engine-runs.png", len(folders))
    print(f"wrote {out / 'engine-runs.json'}" + (f" and {out / 'engine-runs.png'}" if plot else ""))
    return 0


def _print(summaries: list[CellSummary], overall: dict, runs: list[str]) -> None:
    print(f"warm controller / max(best static, plain) over {len(runs)} runs ({', '.join(runs)})")
    print(f"{'drafter':8} {'batch':>5} {'x':>2} {'warm-up':7} {'pass':6} {'under 1':>8} {'sign p':>7} {'mean':>6}  "
          f"per run (x: passes over the prompts)")
    for s in summaries:
        for p in PASSES:
            key = f"warm-{p}"
            vals = " ".join("-" if v is None else f"{v:.3f}" for v in s.values[key])
            sg = s.signs[key]
            mean = "-" if sg.mean is None else f"{sg.mean:.3f}"
            print(f"{s.drafter:8} {s.batch:>5} {s.passes:>2} {s.warmup:7} {p:6} {sg.under:>3}/{sg.counted:<4} "
                  f"{sg.sign_p:>7.3f} {mean:>6}  {vals}")
    for warmup, by_key in overall.items():
        for key, o in by_key.items():
            mean = "-" if o["mean"] is None else f"{o['mean']:.3f}"
            print(f"all cells, warm-up {warmup}, {key}: under 1 in {o['under']} of {o['counted']} "
                  f"(sign p {o['sign_p']:.2g}), mean {mean}, "
                  f"correlation with warm-up minus evaluation acceptance {o['acceptance_gap_correlation']}")


def _print_challengers(challengers: dict[str, dict]) -> None:
    for path, c in challengers.items():
        a = c["all"]
        print(f"\nchallenger {path} {c['fields']} over {', '.join(c['runs'])}: challenger / warm, paired, behind in "
              f"{a['under']} of {a['counted']} (sign p {a['sign_p']:.2g}), mean {a['mean']}")
        for batch, by_pass in c["by_batch"].items():
            print("  batch " + batch + ": " + "; ".join(
                f"{p} pass behind in {sg['under']} of {sg['counted']}, mean {sg['mean']}" for p, sg in by_pass.items()
                if sg["mean"] is not None))


def _plot(summaries: list[CellSummary], path: Path, n_runs: int) -> None:
    """One dot per run and cell (warm controller, both passes), the cell's mean as a bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(7.0, 1.0 * len(summaries)), 4.2))
    for i, (p, color) in enumerate((("main", "#224477"), ("second", "#aa5522"))):
        key = f"warm-{p}"
        for x, s in enumerate(summaries):
            vals = [v for v in s.values[key] if v is not None]
            if not vals:
                continue
            xs = x + (i - 0.5) * 0.3 + np.linspace(-0.08, 0.08, len(vals))
            ax.plot(xs, vals, "o", color=color, ms=3, alpha=0.7, label=f"warm, {p} pass" if x == 0 else None)
            ax.hlines(np.mean(vals), x + (i - 0.5) * 0.3 - 0.12, x + (i - 0.5) * 0.3 + 0.12, color=color, lw=2)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(summaries)))
    ax.set_xticklabels([f"{s.drafter}\nb{s.batch}" + (f" x{s.passes}" if s.passes > 1 else "")
                        + ("" if s.warmup == "alone" else f"\n{s.warmup}") for s in summaries], fontsize=8)
    ax.set_ylabel("warm controller / max(best static, plain)", fontsize=8)
    ax.set_title(f"The warm controller over {n_runs} engine runs: one dot per run, the bar the mean", fontsize=9)
    ax.legend(fontsize=7, loc="lower center", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
