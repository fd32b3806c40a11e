"""``specctl bench engine``: the reference engine on a real model, drafter by
drafter, static chains and trees against the controller (cold and warm),
at batch 1, 4 and 8.

Every run decodes the same held-out prompts (mixed chat / code / math /
summarisation, not used to train the heads) greedily to ``max_new_tokens``
through ``worker.reference.engine.Engine`` with ``max_batch = batch``:

- ``none`` / ``plain``: no drafter (its outputs are the reference for
  ``lossless`` and the oracle's truth) and ``plain-repeat`` (the same again,
  last: the machine's drift); the mean of the two is the baseline of
  ``speedup_vs_plain``. Every engine runs the model on the tuned linear
  kernels (``worker.reference.engine.kernels``; ``kernels="default"`` keeps torch's),
  and ``plain-default-kernels`` decodes plainly on a second copy of the model
  with torch's default kernels: what the kernels alone are worth;
- ``hf-prompt-lookup`` / ``static-dK``: transformers
  ``generate(prompt_lookup_num_tokens=K)`` on the same model, one prompt at a
  time (transformers' assisted decoding is batch-1 only), batch 1 only; its
  target forwards are counted, so ``steps`` and ``mean_accepted`` compare
  with the engine's exactly. ``hf-generate`` / ``plain``: transformers' plain
  greedy ``generate`` the same way, the peer's own baseline
  (``speedup_vs_hf_plain``). Both are stepped one target forward per round
  in the lockstep below (``_SteppedGenerate``), like the engines;
- ``ngram`` / ``medusa`` / ``eagle`` static, at ``static-dK`` (chains of
  each of ``depths``) and ``static-dDwWnN`` (trees of ``trees``: depth,
  width, draft nodes, clamped to the drafter's limits), and under the
  controller (policy = the preset name + ``-cold`` / ``-warm``): an
  in-process controller on loopback, one ``SpeculationAgent`` per drafter,
  observing its own runs only (no static or plain run feeds it).
  ``-cold``: a fresh controller per batch size, no traffic before the timed
  run (it starts from the worker's start-up calibration and the policy's
  priors). ``-warm``: one controller for the whole benchmark that decodes
  ``warmup_prompts`` warm-up prompts untimed before each batch size's timed
  runs. The warm-up prompts are held-out prompts of the shipped ``all`` set
  that are not evaluation prompts (``eval_and_warmup_prompts``): like the
  evaluation prompts the heads never trained on them, and none is an
  evaluation prompt (checked). The controller's acceptance model is shared
  by every worker of a drafter version, so a fresh worker id on the warm
  controller would not be cold: the cold runs get controllers of their own.
  Where the warm-up runs (``warmup``): by default ``alone``, each warm
  engine decoding the warm-up by itself. ``crowd``: in a lockstep of every
  configuration of the timed one on the warm-up prompts (untimed; another
  controller's runs stood in for by static chains of the agents' fallback
  depth, so no other controller hears it), since what a step costs depends
  on how many engines take turns (a draft at batch 8 is 3-8 % dearer
  against plain among ~30 engines than among six; stop 38). ``both``: a
  second warm controller (``-warm-alone``) warmed alone, timed beside the
  crowd-warmed one in every lockstep. Measured with ``both`` (runs S and T,
  docs/benchmarks.md): the crowd-warmed one ahead in 16 of 24 pairs, 1 % on
  the mean, not significant, for twice the run time, so ``alone`` stays.
  ``challenger_policy``: one more warm controller (``-challenger``) on
  another policy file, warmed where ``-warm`` is and timed beside it: two
  policy configurations compared paired (``challenger_vs_warm``);
- ``oracle`` / ``static-dK``: replays the target's own greedy continuation
  (100% acceptance), the ceiling of this verification pipeline here.

Configurations run in lockstep: one engine per configuration, each with all
the prompts, and the driver steps them in turn (one step each per round, in
a fresh random order every round, seeded by the batch size) and times every
step; transformers' generate takes its turns the same way, one forward each.
A slow minute of this shared machine then falls on all configurations alike
instead of on whichever ran in it. The order is drawn anew each round
because the place an engine steps at is worth about a percent: when the
starting engine only rotated, each engine always stepped right after the
same one, and three EAGLE engines that never draft measured 0.982 of plain
beside it over three lockstep passes at batch 8 (0.998 with the order drawn
each round, three passes on the same code; identical engines spread 2.0-5.6 %
against 1.2-2.1 %; docs/benchmarks.md, runs K and L).
What noise is left is on every controller ratio as a 90 % interval
(:mod:`bench.intervals`: the rounds resampled in blocks, the engines' own
speeds from the plain pairs added; ``engine-steps.json.gz`` holds the steps
they are drawn from, ``rescore_intervals`` draws them again).

Each configuration runs in a thread of its own and only one runs at a
time: an engine stepped in the process's main thread took 4-6 % more CPU
per step than the same engine in a thread of its own (the peers always had
one), so none runs in the main thread. Greedy outputs do not depend on the
configuration: one untimed plain pass first gives the reference and the
oracle's truth.

``tokens_per_s``: generated tokens / wall time of the run (prefill, drafting,
verification, Python overhead: everything). ``tokens_per_cpu_s``: the same
over the CPU time of the configuration's thread (``time.thread_time``;
torch runs one intra-op thread, in that thread). On a machine shared with
other processes the wall clock swings by tens of percent from minute to minute,
while CPU time only counts the cycles the engine got, so on the CPU
``speedup_vs_plain`` is computed on CPU time and ``speedup_vs_plain_wall``
on wall time; both against the mean of the two plain configurations of the
same batch. Off the CPU (``--device cuda``) the thread's CPU time misses the
device's work (a step waits for it, and a wait is not CPU time on every
driver), so there ``speedup_vs_plain`` is on wall time too;
``speedup_basis`` in the JSON says which. ``mean_accepted``: mean τ per row-step.
``lossless``: every output equals the plain run's token for token.

``static_vs_controller`` in the JSON: per learned drafter and batch size, the
best static configuration in hindsight over its chains and trees (picked on
the same measurement, so it carries the luck of the best of several noisy
runs), the best chain and the best tree, the cold and warm controller and
their ratios to the best static one and to max(best static, plain); and,
reported, not a gate, the warm controller's share of the best oracle
speedup of that batch.

The second pass (``confirm``, on by default): picked on the same
measurement, the best of seven noisy static runs overstates what its shape
is worth (the winner's curse). So after each batch's lockstep, a second,
shorter lockstep decodes the same prompts with the shape picked for each
learned drafter, a fresh cold controller and a fresh warm one per drafter
(warmed on the warm-up prompts at this batch size only, untimed), between a
plain run and a plain repeat of its own: policies ``confirm-plain``,
``confirm-<shape>``, ``confirm-goodput-cold``, ``confirm-goodput-warm``,
``confirm-plain-repeat``, speedups against that pass's plain runs. No run
there was picked by its own measurement, and all share one lockstep (the
number of engines taking turns moves every speculating run against plain:
the picked shapes timed alone beside plain moved by -3 % to +5 % against
plain from the main lockstep, +2 % on the mean, so a comparison across two
passes would not be fair).
``static_vs_controller`` gains ``second_pass``: the shape, its speedup, the
controllers' and their ratios to max(shape, plain). Its controllers record
to ``engine-telemetry-confirm-{cold,warm}-bB.jsonl.gz``.

The controllers' clock (:class:`RunClock`): in a lockstep of twenty engines
each engine steps once every twenty steps' time, so on the wall clock a
controller would see its worker step at a twentieth of the rate it would
serving alone: its acceptance evidence (half-life 120 s) would fade over
about twenty times fewer steps, and the warm controller's warm-up would be
worth little by the end of a run (EAGLE at batch 8 took about 5.5 s of wall
time a step in run G, 45 steps in 250 s, two half-lives), as would the wait
between a controller's warm-up and its timed run. So each in-process
controller runs on a clock of its own engines' time: it runs with the wall
clock while one of its engines decodes alone (the warm-ups), stands still
in between, and in a lockstep moves each round by the mean step time of its
own engines in that round, what serving alone would have taken. Runs before
run I used the wall clock. And each round ends with the controllers in sync
(:class:`ControlSync`): their agents' steps read, the due plans pushed and
applied, so how many steps a plan takes to arrive is no race against the
order of the turns.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import json
import logging
import random
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from policies.table import Decision
from worker.reference.threads import inherit_threads, set_threads

__all__ = ["CONFIRM", "ControlSync", "DEFAULT_DEPTHS", "best_static_name", "DEFAULT_TREES", "EngineRun", "PositionAcceptance", "acceptance_warmup_vs_eval",
           "engine_controller_config",
           "eval_and_warmup_prompts", "eval_prompts", "eval_acceptance_shape", "run_engine_bench", "static_shapes",
           "static_vs_controller"]


@dataclass
class EngineRun:
    drafter: str
    policy: str
    batch: int
    tokens_per_s: float
    speedup_vs_plain: float  # on engine-thread CPU time; on wall time off the CPU (module docstring)
    mean_accepted: float
    lossless: bool
    tokens: int
    seconds: float
    tokens_per_cpu_s: float = 0.0
    speedup_vs_plain_wall: float = 0.0
    draft_ms_per_step: float = 0.0
    verify_ms_per_step: float = 0.0
    catch_up_ms_per_step: float = 0.0  # EAGLE's catch-ups of rows switched on (outside draft_ms)
    steps: int = 0
    note: str = ""
    spec_fraction: float = 0.0  # share of row-steps that drafted
    nodes_per_spec_row_step: float = 0.0  # mean tree size when drafting
    speedup_vs_hf_plain: float = 0.0  # transformers runs: against transformers' plain generate (CPU time)
    # Shadow drafts of off rows (worker.sdk.shadow; n-gram): resolved and reported, and their share of the
    # engine's time per step (proposing them; inside the timed step, outside draft_ms and verify_ms).
    shadow_drafts: int = 0
    shadow_ms_per_step: float = 0.0
    # A controlled run: its row-steps decided by a per-request override, by the
    # controller's reason ("explore", "price-probe", ...), and of those the ones that
    # asked for a draft (n-gram may find none); the rest came from the plan's table
    # (the agent's override counters).
    override_row_steps: dict = field(default_factory=dict)
    override_draft_asks: dict = field(default_factory=dict)
    spec_row_steps: int = 0  # row-steps that drafted (spec_fraction's numerator)
    controlled: bool = False  # decided by a controller's agent
    # Row-steps over steps x batch: the share of the batch's slots that held a request. Plain fills
    # them to the end (every row emits one token a step); drafting rows finish unevenly, and once
    # the queue is empty the batch's last steps run part-empty (stop 40: 0.83-0.88 at batch 8 with
    # 8 prompts, one closed batch, against 0.92-0.96 at batch 4, where the queue refills a slot).
    occupancy: float = 0.0


@dataclass
class _Tally:
    """One configuration's totals over the prompt groups of one batch size."""

    tokens: int = 0
    secs: float = 0.0
    cpu: float = 0.0
    steps: int = 0
    row_steps: int = 0
    spec_row_steps: int = 0
    draft_nodes: int = 0
    accepted: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    catch_up_s: float = 0.0
    shadow_drafts: int = 0
    shadow_s: float = 0.0
    lossless: bool = True
    note: str = ""
    overrides: Counter = field(default_factory=Counter)
    override_draft_asks: Counter = field(default_factory=Counter)
    controlled: bool = False
    # Step by step (its i-th step ran in the lockstep's round i): wall and CPU
    # seconds and tokens emitted, for the intervals (bench.intervals).
    step_secs: list = field(default_factory=list)
    step_cpu: list = field(default_factory=list)
    step_tokens: list = field(default_factory=list)

    def series(self, basis: str) -> tuple[list, list]:
        """Per round: the step's seconds on the benchmark's basis and its tokens."""
        return (self.step_cpu if basis == "cpu" else self.step_secs), self.step_tokens

    def add_stats(self, stats, lossless: bool) -> None:
        """Engine totals (time is added step by step by the caller)."""
        self.tokens += stats.tokens
        self.steps += stats.steps
        self.row_steps += stats.row_steps
        self.spec_row_steps += stats.spec_row_steps
        self.draft_nodes += stats.draft_nodes
        self.accepted += stats.accepted
        self.draft_s += stats.draft_s
        self.verify_s += stats.verify_s
        self.catch_up_s += stats.catch_up_s
        self.shadow_drafts += stats.shadow_drafts
        self.shadow_s += stats.shadow_s
        self.lossless &= lossless

    def add_peer(self, peer: "_SteppedGenerate", reference) -> None:
        """A transformers peer's totals (time is added step by step by the caller)."""
        tokens = sum(len(o) for o in peer.outputs)
        self.tokens += tokens
        self.steps += peer.forwards
        self.row_steps += peer.forwards
        self.accepted += tokens - peer.forwards
        self.lossless &= peer.outputs == reference
        self.note = (f"transformers generate(prompt_lookup_num_tokens={peer.k}), stepped in lockstep; batch 1 only"
                     if peer.k else "transformers generate, greedy, stepped in lockstep; batch 1 only")

    def run(self, drafter: str, policy: str, batch: int) -> "EngineRun":
        steps = max(self.steps, 1)
        return EngineRun(drafter, policy, batch, tokens_per_s=round(self.tokens / self.secs, 2), speedup_vs_plain=0.0,
                         mean_accepted=round(self.accepted / max(self.row_steps, 1), 3), lossless=self.lossless,
                         tokens=self.tokens, seconds=round(self.secs, 2),
                         tokens_per_cpu_s=round(self.tokens / self.cpu, 2),
                         draft_ms_per_step=round(1e3 * self.draft_s / steps, 2),
                         verify_ms_per_step=round(1e3 * self.verify_s / steps, 2),
                         catch_up_ms_per_step=round(1e3 * self.catch_up_s / steps, 3), steps=self.steps, note=self.note,
                         spec_fraction=round(self.spec_row_steps / max(self.row_steps, 1), 3),
                         nodes_per_spec_row_step=round(self.draft_nodes / max(self.spec_row_steps, 1), 2),
                         shadow_drafts=self.shadow_drafts, shadow_ms_per_step=round(1e3 * self.shadow_s / steps, 4),
                         override_row_steps=dict(self.overrides), override_draft_asks=dict(self.override_draft_asks),
                         spec_row_steps=self.spec_row_steps, controlled=self.controlled,
                         occupancy=round(self.row_steps / max(steps * batch, 1), 3))


class RunClock:
    """A benchmark controller's clock: seconds since the epoch that pass only while
    the controller's engines decode (module docstring).

    It starts at the wall clock's time; :meth:`live` lets it run with the wall clock
    (an engine of the controller's decoding alone), :meth:`advance` moves it by a
    given time (its engines' share of a lockstep round); otherwise it stands still.

    >>> clock = RunClock(start=100.0)
    >>> clock.advance(0.25); clock()
    100.25
    """

    def __init__(self, start: float | None = None) -> None:
        self._lock = threading.Lock()
        self._at = time.time() if start is None else float(start)
        self._live_since: float | None = None

    def __call__(self) -> float:
        with self._lock:
            if self._live_since is None:
                return self._at
            return self._at + (time.perf_counter() - self._live_since)

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock moves forward, not by {seconds} s")
        with self._lock:
            self._at += seconds

    @contextlib.contextmanager
    def live(self):
        """Run with the wall clock inside the block."""
        with self._lock:
            self._live_since = time.perf_counter()
        try:
            yield self
        finally:
            with self._lock:
                self._at += time.perf_counter() - self._live_since
                self._live_since = None


# Static trees beside the chains: (depth, width, draft nodes), each clamped to a
# drafter's limits. The shapes the controller planned at batch 1 in runs A-C
# (engine-telemetry.jsonl.gz): d2 w4 n5 (Medusa, EAGLE), d3 w2-3 n5 (EAGLE),
# d4 w2-3 n5-6 (n-gram), d5 w4 n10-12 (n-gram, run A); at batch 4 and 8 d1
# chains or off, which the d1 chain and plain cover.
DEFAULT_TREES = ((2, 4, 5), (3, 2, 5), (4, 2, 6), (4, 4, 12))
DEFAULT_DEPTHS = (1, 2, 4)
WARMUP_SOURCE = "held-out prompts of the shipped 'all' set that are not evaluation prompts"
# Where the warm controller decodes its warm-up prompts (``run_engine_bench(warmup=...)``).
WARMUPS = ("crowd", "alone", "both")
# What stands in for another controller's run in a warm-up lockstep: the agents' fallback shape.
STAND_IN = Decision.chain(2)


def _warm_controllers(warmup: str, challenger: bool = False) -> dict[str, str]:
    """The warm controllers of a ``warmup`` setting: tag -> where it warms up.
    ``challenger``: one more, on another policy file, warmed where ``warm`` is.

    >>> _warm_controllers("both")
    {'warm': 'crowd', 'warm-alone': 'alone'}
    >>> _warm_controllers("alone", challenger=True)
    {'warm': 'alone', 'challenger': 'alone'}
    """
    how = {"crowd": {"warm": "crowd"}, "alone": {"warm": "alone"},
           "both": {"warm": "crowd", "warm-alone": "alone"}}[warmup]
    return {**how, "challenger": how["warm"]} if challenger else how


class ControlSync:
    """The end of a lockstep round for the benchmark's controllers: every step
    their agents observed is read, the plans due on their clocks are pushed,
    and each agent has applied (acknowledged) what was pushed, before any
    engine steps again.

    Why: an agent sends its telemetry every ``flush_interval_s`` and a
    controller plans on its ticks, so how many steps a plan takes to arrive
    would be a race against the lockstep's turns: with the turns in a fresh
    order every round an engine may step again right after its last turn, or
    a round and a half later. Here a plan computed on the telemetry of a
    round is in force from the next round on, in every run and for every
    controller alike. (It does not make two runs decide alike: the
    controllers' cost models rest on measured step times and the start-up
    calibration, both a few percent apart from run to run, and in the
    break-even cells those decide; docs/benchmarks.md, runs K and L.)

    ``controllers``: ``(BackgroundController, agents)`` pairs, agents by name.
    """

    def __init__(self, controllers, timeout_s: float = 30.0, poll_s: float = 0.001) -> None:
        self.controllers = list(controllers)
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self.rounds = 0
        self.seconds = 0.0  # wall time spent waiting, over all rounds

    def __call__(self) -> None:
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        for ctl, agents in self.controllers:
            sent = {a.hello.worker_id: a for a in agents.values()}
            while (any(a.queued_steps() for a in sent.values())  # the next flush has them
                   or not ctl.call(_read_then_plan(ctl.running, {w: a.stats.steps_sent for w, a in sent.items()}))):
                self._wait(deadline, "the controller to read its agents' steps")
            while not ctl.call(_plans_applied(ctl.running, list(sent))):
                self._wait(deadline, "the agents to apply the plans pushed")
        self.rounds += 1
        self.seconds += time.perf_counter() - t0

    def _wait(self, deadline: float, what: str) -> None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"bench engine: waited {self.timeout_s:g} s for {what}")
        time.sleep(self.poll_s)


async def _read_then_plan(running, steps_sent: dict[str, int]) -> bool:
    """True, with the due plans pushed, once the controller has ingested every step
    each worker sent; False (nothing pushed) before."""
    workers = running.controller.workers
    for worker_id, n in steps_sent.items():
        state = workers.get(worker_id)
        if n and (state is None or state.steps_ingested < n):
            return False
    await running.servicer.push_due_plans(60.0)
    return True


async def _plans_applied(running, worker_ids: list[str]) -> bool:
    """Whether every plan and request-decisions message sent to these workers has been acknowledged."""
    workers = running.controller.workers
    return all(w not in workers or not workers[w].plans.pending for w in worker_ids)


def eval_prompts(n: int, held_out: float = 0.1):
    """``n`` held-out prompts of the shipped ``all`` set, domains interleaved
    (the same crc32 split as ``DistillSet.split``). The first ``n`` of
    ``eval_prompts(n + m)`` are ``eval_prompts(n)``."""
    from worker.reference.prompts import held_out as held_out_prompts, load_prompts

    items = held_out_prompts(load_prompts("all"), held_out)
    by_domain: dict[str, list] = {}
    for p in items:
        by_domain.setdefault(p.domain, []).append(p)
    out = []
    while len(out) < n and any(by_domain.values()):
        for dom in sorted(by_domain):
            if by_domain[dom] and len(out) < n:
                out.append(by_domain[dom].pop(0))
    return out


def eval_and_warmup_prompts(n: int, warmup: int, held_out: float = 0.1):
    """``(evaluation prompts, warm-up prompts)``: ``eval_prompts(n)`` and the
    next ``warmup`` held-out prompts of the ``all`` set (domains interleaved),
    none of them an evaluation prompt (by id or by text). Held-out prompts,
    not the training split: the heads trained on the training split, so
    their acceptance there would overstate what the controller meets on the
    evaluation prompts. Raises ``ValueError`` when too few are left."""
    both = eval_prompts(n + warmup, held_out)
    items, warm = both[:n], both[n:]
    if len(warm) < warmup:
        raise ValueError(f"{warmup} warm-up prompts asked for, {len(warm)} held-out prompts left after the "
                         f"{len(items)} evaluation prompts")
    if {p.id for p in items} & {p.id for p in warm} or {p.text for p in items} & {p.text for p in warm}:
        raise AssertionError("a warm-up prompt is an evaluation prompt")
    return items, warm


def static_shapes(limits, depths, trees) -> list[tuple[str, Decision]]:
    """``(policy name, decision)`` of the static configurations of a drafter:
    the chains of ``depths`` (``static-dK``), then the trees of ``trees``
    (``static-dDwWnN``), each clamped to ``limits``; repeats dropped (a tree
    clamped to width 1 is the chain of its depth)."""
    out, seen = [], set()
    for d, w, n in [(k, 1, k) for k in depths] + [tuple(t) for t in trees]:
        dec = Decision(d, w, n).clamp(limits.max_depth, limits.max_width, limits.max_tree_nodes)
        if not dec.speculate or dec in seen:
            continue
        seen.add(dec)
        chain = dec.width == 1 and dec.max_nodes == dec.depth
        out.append((f"static-d{dec.depth}" if chain else f"static-d{dec.depth}w{dec.width}n{dec.max_nodes}", dec))
    return out


@dataclass
class PositionAcceptance:
    """What a drafter's row-steps accepted, position by position: an engine
    observer (``observe`` / ``finish``, as the agent's) that counts and
    forwards nothing.

    Position ``k`` (1-based) of a row-step is *reached* when the drafter
    drafted at least one node at depth ``k`` below the accepted path (the
    row accepted ``k - 1`` tokens and the node it accepted last has
    children): the levels ``RequestTelemetry.position_outcomes`` reports, as
    the controller's acceptance model reads them. Of those, ``accepted``
    counts the row-steps that accepted a node there (any candidate) and
    ``top1`` those that accepted the drafter's top-ranked candidate. So
    ``top1[k] / reached[k]`` is the conditional acceptance of the drafter's
    first choice at position ``k``, which a chain and a tree measure alike,
    while ``accepted[k] / reached[k]`` grows with the width offered there.

    >>> from worker.sdk.telemetry import RequestTelemetry
    >>> a = PositionAcceptance()
    >>> a.add(RequestTelemetry("r", 10, depth=3, width=1, nodes=3, accepted=1))   # chain d3: 1st ok, 2nd rejected
    >>> a.add(RequestTelemetry("r", 10))                                          # did not draft
    >>> a.reached, a.accepted, a.top1, a.rates(), a.mean_accepted()
    ([1, 1], [1, 0], [1, 0], [1.0, 0.0], 1.0)
    """

    row_steps: int = 0
    drafting_row_steps: int = 0
    accepted_tokens: int = 0  # Σ τ over the drafting row-steps
    depth_sum: int = 0  # Σ tree depth over the drafting row-steps
    nodes_sum: int = 0
    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    top1: list[int] = field(default_factory=list)

    def add(self, request) -> None:
        """Count one request's part of one step (a ``RequestTelemetry``)."""
        self.row_steps += 1
        if request.depth <= 0:
            return
        self.drafting_row_steps += 1
        self.accepted_tokens += request.accepted
        self.depth_sum += request.depth
        self.nodes_sum += request.nodes
        ranks, _ = request.position_outcomes()
        for level, rank in enumerate(ranks):
            if level == len(self.reached):
                self.reached.append(0)
                self.accepted.append(0)
                self.top1.append(0)
            self.reached[level] += 1
            self.accepted[level] += rank > 0
            self.top1[level] += rank == 1

    def observe(self, step) -> None:
        for request in step.requests:
            self.add(request)

    def finish(self, summary) -> None:
        """Request summaries carry nothing per position."""

    def rates(self, top1: bool = False) -> list[float | None]:
        """Per position, accepted (or top-ranked accepted) / reached; None where nothing reached it."""
        hits = self.top1 if top1 else self.accepted
        return [round(h / n, 3) if n else None for h, n in zip(hits, self.reached)]

    def mean_accepted(self) -> float:
        """Mean τ per drafting row-step."""
        return round(self.accepted_tokens / self.drafting_row_steps, 3) if self.drafting_row_steps else 0.0


class _Tee:
    """An engine observer that hands every report to the agent and to a counter."""

    def __init__(self, agent, counts: PositionAcceptance) -> None:
        self.agent, self.counts = agent, counts

    @property
    def stats(self):
        """The agent's counters (its overrides by reason: ``_override_counts``)."""
        return self.agent.stats

    def observe(self, step) -> None:
        self.counts.observe(step)
        self.agent.observe(step)

    def finish(self, summary) -> None:
        self.agent.finish(summary)


def eval_acceptance_shape(shapes: list[tuple[str, Decision]]) -> str:
    """The static run whose acceptance stands for the evaluation prompts: the
    deepest shape, a chain before a tree of the same depth (it drafts on every
    row-step the drafter can, to the greatest depth, one candidate a level, as
    the warm-up's rank-1 rates count). ``""`` when there is none."""
    if not shapes:
        return ""
    return max(shapes, key=lambda s: (s[1].depth, s[1].width == 1, -s[1].max_nodes))[0]


def acceptance_warmup_vs_eval(warmup: dict, evaluation: dict, warmup_source: str = "") -> list[dict]:
    """Per learned drafter and batch size: its acceptance on the warm-up prompts
    (what the warm controller learned from) against the evaluation prompts.

    ``warmup``: ``{(drafter, batch): PositionAcceptance}`` of the warm-up runs;
    ``evaluation``: ``{(drafter, batch): (run's policy name, PositionAcceptance)}``.
    Each record has the per-position rates of both (``*_rates``: any candidate
    accepted; ``*_top1_rates``: the top-ranked one, comparable across shapes),
    the row-steps that reached each position, the mean τ per drafting
    row-step (which does depend on the shapes drafted: the mean depth and
    nodes drafted sit beside it) and the row-steps counted. Positions run as
    far as either side reached; a rate is None where its side reached none.
    """
    order = ("ngram", "medusa", "eagle")
    keys = sorted(set(warmup) | set(evaluation),
                  key=lambda k: (k[1], order.index(k[0]) if k[0] in order else len(order), k[0]))
    out = []
    for drafter, batch in keys:
        warm = warmup.get((drafter, batch), PositionAcceptance())
        source, ev = evaluation.get((drafter, batch), ("", PositionAcceptance()))
        depth = max(len(warm.reached), len(ev.reached))
        row = {"drafter": drafter, "batch": batch, "warmup_source": warmup_source if (drafter, batch) in warmup else "",
               "eval_source": source, "positions": list(range(1, depth + 1))}
        for tag, c in (("warmup", warm), ("eval", ev)):
            pad = [None] * (depth - len(c.reached))
            row[f"{tag}_rates"] = c.rates() + pad
            row[f"{tag}_top1_rates"] = c.rates(top1=True) + pad
            row[f"{tag}_reached"] = c.reached + [0] * (depth - len(c.reached))
            row[f"{tag}_mean_accepted"] = c.mean_accepted()
            row[f"{tag}_row_steps"] = c.row_steps
            row[f"{tag}_drafting_row_steps"] = c.drafting_row_steps
            row[f"{tag}_mean_depth"] = round(c.depth_sum / c.drafting_row_steps, 2) if c.drafting_row_steps else 0.0
            row[f"{tag}_mean_nodes"] = round(c.nodes_sum / c.drafting_row_steps, 2) if c.drafting_row_steps else 0.0
        out.append(row)
    return out


def engine_controller_config(policy: str, record: str, overrides: dict | None = None):
    """The config of one of the benchmark's in-process controllers: a loopback
    server recording to ``record``, with ``overrides`` (top-level sections of a
    controller YAML, e.g. ``{"acceptance": {"half_life_s": 30}}``) on top.
    The benchmark's own settings (listen address, policy, recording, plan
    intervals, in-memory store) win over the overrides; a bad field raises
    the config's validation error, which names it.

    >>> engine_controller_config("goodput", "r.jsonl.gz", {"acceptance": {"half_life_s": 30}}).acceptance.half_life_s
    30.0
    """
    from controller.background import in_process_config

    overrides = dict(overrides or {})
    for section in ("listen", "policy", "record", "plan", "store"):
        overrides.pop(section, None)
    return in_process_config(policy, record=record, **overrides)


def run_engine_bench(out_dir: str = "bench/results", model_name: str = "smollm2-135m", batches=(1, 4, 8),
                     prompts: int = 8, max_new_tokens: int = 48, depths=DEFAULT_DEPTHS,
                     drafters=("ngram", "medusa", "eagle", "oracle"), policy: str = "goodput",
                     threads: int = 1, heads_dir: str | None = None, plot: bool = True,
                     warmup_prompts: int = 8, kernels: str = "tuned", calibrate: bool = True,
                     trees=DEFAULT_TREES, controller_overrides: dict | None = None, confirm: bool = True,
                     verify_layout: str = "packed", warmup: str = "alone", challenger_policy: str = "") -> int:
    """The benchmark; see the module docstring. ``warmup_prompts`` = 0: no warm
    controller (the cold one only). ``warmup``: where the warm controller decodes
    its warm-up prompts (:data:`WARMUPS`): ``alone`` (default), by itself;
    ``crowd``, in a lockstep of every configuration of the timed one (the
    conditions it is timed in; twice the run time); ``both``, a second warm
    controller (``-warm-alone``) warmed alone beside the crowd-warmed one, in
    every lockstep (a paired comparison). ``controller_overrides``: controller config
    sections for all its controllers (:func:`engine_controller_config`; recorded
    in the JSON as ``controller_config``). ``confirm``: the second pass, each
    drafter's best static shape against fresh controllers (module docstring).
    ``challenger_policy``: a policy file (or preset name) for one more warm
    controller (``-challenger``), warmed where the warm one is and timed beside it
    in every lockstep, so two policy configurations compare paired
    (``challenger_vs_warm``); ``controller_overrides`` apply to it too."""
    from controller.background import BackgroundController
    from worker.reference.drafters.oracle import OracleDrafter
    from worker.reference.engine.engine import Engine, static_decide
    from worker.reference.models import load_model
    from worker.reference.prompts import chat_ids
    from worker.reference.server import build_drafter, engine_layout, make_hello

    if warmup not in WARMUPS:
        raise ValueError(f"warmup {warmup!r}: one of {', '.join(WARMUPS)}")
    challenger = check_challenger(challenger_policy, warmup_prompts) if challenger_policy else {}
    warm_how = _warm_controllers(warmup, challenger=bool(challenger_policy))
    set_threads(threads)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    items, warm_items = eval_and_warmup_prompts(prompts, warmup_prompts)
    lm = load_model(model_name, tune_kernels=kernels == "tuned")
    model, tok = lm.model, lm.tokenizer
    # Every engine of the run verifies in one layout, and every agent's Hello says which.
    layout = engine_layout(model, verify_layout)
    Engine = functools.partial(Engine, packed=layout == "packed")  # noqa: N806 - stands in for the class
    device = next(model.parameters()).device
    basis = "cpu" if device.type == "cpu" else "wall"
    for p in model.parameters():
        p.requires_grad_(False)
    # With tuned kernels, plain decoding on torch's default kernels runs beside the
    # rest: what the kernels themselves are worth, measured in the same minutes.
    default_model = load_model(model_name).model if lm.kernels is not None else None
    ids = [chat_ids(tok, p.text) for p in items]
    warm_ids = [chat_ids(tok, p.text) for p in warm_items]

    learned = [d for d in drafters if d in ("ngram", "medusa", "eagle")]
    built = {d: build_drafter(d, model, heads_dir, model_name) for d in learned}
    shapes = {d: static_shapes(built[d].limits, depths, trees) for d in learned}
    controlled = bool(policy and learned)
    calibration = []
    # What a worker does at start-up: its Hello carries the verify times of a grid of shapes.
    if controlled and calibrate:
        from worker.reference.engine.calibrate import calibrate_verify

        calibration = calibrate_verify(model, max(batches), max(built[d].limits.max_tree_nodes for d in learned))

    def start_controller(record: str, suffix: str, tag: str = ""):
        """A controller recording what it receives (``DIR/<record>``: every step's decisions, times
        and outcomes, readable step by step afterwards) and one agent per learned drafter; the
        challenger's (``tag``) on its own policy file."""
        from worker.sdk.agent import AgentOptions, SpeculationAgent

        clock = RunClock()
        config = engine_controller_config(challenger_policy if tag == "challenger" else policy, str(out / record),
                                          controller_overrides)
        ctl = BackgroundController(config, clock)
        agents = {}
        try:
            for d in learned:
                hello = make_hello(f"bench-{d}{suffix}", model_name, model, built[d], max(batches), calibration,
                                   layout)
                # Telemetry leaves every 5 ms, so ControlSync's wait at the end of a round stays short.
                options = AgentOptions(fallback=STAND_IN, flush_interval_s=0.005)
                agents[d] = SpeculationAgent(hello, ctl.address, options).start()
                clocks[id(agents[d])] = clock
        except BaseException:
            stop_controller(ctl, agents)
            raise
        return ctl, agents

    def stop_controller(ctl, agents) -> None:
        for a in agents.values():
            a.close()
        ctl.close()

    def second_pass(picked: dict[str, str], batch: int) -> None:
        """The shapes picked in hindsight against fresh controllers, cold and warmed at this batch
        only, in a lockstep of their own (module docstring)."""
        started: dict[str, tuple] = {}
        try:
            for tag in ("cold", *warm_how):
                started[tag] = start_controller(f"engine-telemetry-{CONFIRM}{tag}-b{batch}.jsonl.gz",
                                                f"-{CONFIRM}{tag}-b{batch}", tag)

            def specs(slot, timed=True):
                again = [("none", f"{CONFIRM}plain", None, None, None)]
                for d in learned:
                    if picked.get(d):
                        again.append((d, CONFIRM + picked[d], built[d], static_decide(dict(shapes[d])[picked[d]]),
                                      None))
                    again += [(d, f"{CONFIRM}{policy}-{tag}", built[d], *slot(tag, d)) for tag in started]
                return again + [("none", f"{CONFIRM}plain-repeat", None, None, None)]

            # untimed, as the main warm controllers' warm-ups
            warmup_overrides.extend(warm_up(started, batch, specs, CONFIRM))
            syncs.append(ControlSync(started.values()))
            _lockstep(model, Engine, specs(lambda tag, d: (started[tag][1][d].decide, started[tag][1][d])), (), ids,
                      reference, batch, max_new_tokens, tallies, clocks, syncs[-1])
            for _, agents in started.values():  # the recordings hold the last requests too
                _settle(agents)
        finally:
            logging.getLogger("asyncio").setLevel(logging.CRITICAL)
            for ctl, agents in started.values():
                stop_controller(ctl, agents)
    def warm_up(controllers: dict, batch: int, make_specs, prefix: str = "", hf_depths=(),
                counts: dict | None = None) -> list[dict]:
        """Each warm controller of ``controllers`` (tag -> (controller, agents)) decodes the warm-up
        prompts untimed, the way ``warm_how`` says: ``alone``, each agent's engine by itself on the
        controller's live clock; ``crowd``, in a lockstep of ``make_specs(slot, timed=False)`` on
        the warm-up prompts with transformers' peers of ``hf_depths`` (the timed lockstep's
        configurations; ``slot(tag, drafter)`` gives a controlled run's decide and observer, its
        policy is ``prefix + policy-tag``), where every controlled run of another controller is
        stood in for by a static chain (``STAND_IN``): those controllers hear nothing.
        ``counts``: drafter -> PositionAcceptance of the ``warm`` controller's warm-up.
        Returns one row per drafter and warm controller: its row-steps, drafting, overrides and
        whether its warm-up outputs equal plain greedy's."""
        rows = []

        def row(d, tag, where, t: _Tally, **extra) -> dict:
            return {"drafter": d, "batch": batch, "pass": "second" if prefix else "main", "controller": tag,
                    "warmup": where, "row_steps": t.row_steps, "spec_row_steps": t.spec_row_steps,
                    "override_row_steps": dict(t.overrides), "override_draft_asks": dict(t.override_draft_asks),
                    "lossless": t.lossless, **extra}

        for tag, (ctl, agents) in controllers.items():
            if warm_how.get(tag) != "alone":
                continue
            for d, agent in agents.items():
                start = _override_counts(agent)
                observer = _Tee(agent, counts[d]) if counts is not None and tag == "warm" else agent
                with clocks[id(agent)].live():
                    engine = Engine(model, built[d], agent.decide, observer=observer, max_batch=batch)
                    outputs = engine.generate(warm_ids, max_new_tokens)
                end = _override_counts(agent)
                t = _Tally(overrides=end[0] - start[0], override_draft_asks=end[1] - start[1])
                t.add_stats(engine.stats, outputs == warm_reference)
                rows.append(row(d, tag, "alone", t))
        crowd = {tag: c for tag, c in controllers.items() if warm_how.get(tag) == "crowd"}
        if not crowd:
            return rows
        tees = {}
        for tag, (_, agents) in crowd.items():
            for d, agent in agents.items():
                tees[(tag, d)] = _Tee(agent, counts[d] if counts is not None and tag == "warm"
                                      else PositionAcceptance())
                clocks[id(tees[(tag, d)])] = clocks[id(agent)]

        def slot(tag, d):
            if tag in crowd:
                return crowd[tag][1][d].decide, tees[(tag, d)]
            return static_decide(STAND_IN), None

        seen: dict[tuple[str, str, int], _Tally] = {}
        syncs.append(ControlSync(crowd.values()))
        _lockstep(model, Engine, make_specs(slot, timed=False), hf_depths, warm_ids, warm_reference, batch,
                  max_new_tokens, seen, clocks, syncs[-1], seed=f"warm-up {prefix}{batch}",
                  what=f"{prefix}warm-up, batch {batch}")
        rows += [row(d, tag, "crowd", seen[(d, f"{prefix}{policy}-{tag}", batch)], crowd=len(seen))
                 for tag, (_, agents) in crowd.items() for d in agents]
        return rows

    # Greedy output does not depend on the configuration (every run is
    # checked against this), so one untimed pass gives the reference and the
    # oracle's truth for every batch size.
    reference = Engine(model, max_batch=len(ids)).generate(ids, max_new_tokens)
    truth = {tuple(p): o for p, o in zip(ids, reference)}
    # The warm-up prompts' own: every warm-up is checked against it, and the oracle replays it in the crowd.
    warm_reference = Engine(model, max_batch=len(warm_ids)).generate(warm_ids, max_new_tokens) if warm_ids else []
    truth.update({tuple(p): o for p, o in zip(warm_ids, warm_reference)})
    tallies: dict[tuple[str, str, int], _Tally] = {}
    clocks: dict[int, RunClock] = {}  # id(agent) -> its controller's clock
    syncs: list[ControlSync] = []  # one per lockstep with controllers
    fitted: dict = {}
    warmup_acceptance: dict[tuple[str, int], PositionAcceptance] = {}
    warmup_overrides: list[dict] = []  # the warm controllers' overrides during each warm-up, by reason
    eval_shape = {d: eval_acceptance_shape(shapes[d]) for d in learned}
    eval_acceptance: dict[tuple[str, int], tuple[str, PositionAcceptance]] = {}
    warm: dict[str, tuple] = {}  # tag -> (controller, agents): one for the whole benchmark each
    try:
        if controlled and warm_ids:
            for tag in warm_how:
                warm[tag] = start_controller("engine-telemetry.jsonl.gz" if tag == "warm"
                                             else f"engine-telemetry-{tag}.jsonl.gz", "" if tag == "warm" else f"-{tag}",
                                             tag)
        for batch in batches:
            # The cold one: a controller of its own for this batch size, no traffic before the timed run.
            cold_ctl, cold_agents = (start_controller(f"engine-telemetry-cold-b{batch}.jsonl.gz", f"-cold-b{batch}")
                                     if controlled else (None, {}))
            controllers = {**({"cold": (cold_ctl, cold_agents)} if cold_ctl is not None else {}), **warm}
            # transformers' generate, batch 1 only: plain greedy (k = 0) and prompt lookup at each depth
            hf_depths = (0, *depths) if batch == 1 else ()

            def specs(slot, timed=True):
                out = [("none", "plain", None, None, None)]
                for d in learned:
                    # The deepest static timed run counts its acceptance (no controller hears of it).
                    if timed and eval_shape[d]:
                        eval_acceptance[(d, batch)] = (eval_shape[d], PositionAcceptance())
                    out += [(d, name, built[d], static_decide(dec),
                             eval_acceptance[(d, batch)][1] if timed and name == eval_shape[d] else None)
                            for name, dec in shapes[d]]
                    out += [(d, f"{policy}-{tag}", built[d], *slot(tag, d)) for tag in controllers]
                if "oracle" in drafters:
                    out += [("oracle", f"static-d{k}", OracleDrafter(truth, max_depth=max(depths)),
                             static_decide(Decision.chain(k)), None) for k in depths]
                out.append(("none", "plain-repeat", None, None, None))
                if default_model is not None:
                    out.append(("none", "plain-default-kernels", None, None, None, default_model))
                return out

            try:
                # The warm controllers see the warm-up prompts (untimed), then their own timed runs; nothing
                # else. The warm one's acceptance there is counted on the way (``acceptance_warmup_vs_eval``).
                counts = {d: PositionAcceptance() for d in learned}
                warmup_overrides.extend(warm_up(controllers, batch, specs, "", hf_depths, counts))
                if "warm" in warm:
                    warmup_acceptance.update({(d, batch): counts[d] for d in learned})
                syncs.append(ControlSync(controllers.values()))
                _lockstep(model, Engine, specs(lambda tag, d: (controllers[tag][1][d].decide,
                                                               controllers[tag][1][d])),
                          hf_depths, ids, reference, batch, max_new_tokens, tallies, clocks, syncs[-1])
                if confirm and controlled and warm_ids:
                    picked = {d: best_static_name(tallies, d, batch, basis) for d in learned}
                    second_pass(picked, batch)
                for tag, (_, agents) in controllers.items():
                    for d, agent in agents.items():
                        tallies[(d, f"{policy}-{tag}", batch)].note = (
                            f"plan v{agent.plan_version}; decision at this batch at the end: "
                            f"{agent.decide('probe', 200, batch)}")
                if cold_ctl is not None:
                    _settle(cold_agents)
                    fitted.update(_fitted_costs(cold_ctl.address, (batch,)))
            finally:
                if cold_ctl is not None:
                    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # grpc.aio pollers of closed agent loops
                    stop_controller(cold_ctl, cold_agents)
        for ctl, agents in warm.values():
            _settle(agents)
            fitted.update(_fitted_costs(ctl.address, batches))
    finally:
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)
        for ctl, agents in warm.values():
            stop_controller(ctl, agents)

    runs = [t.run(name, pol, batch) for (name, pol, batch), t in tallies.items()]
    for r in runs:
        own = CONFIRM if r.policy.startswith(CONFIRM) else ""  # a confirmation run: its own pass's plain runs
        plain = [tallies[(n, own + p, r.batch)] for n, p in (("none", "plain"), ("none", "plain-repeat"))
                 if (n, own + p, r.batch) in tallies]
        base = sum(t.tokens / t.secs for t in plain) / len(plain)
        base_cpu = sum(t.tokens / t.cpu for t in plain) / len(plain)
        r.speedup_vs_plain_wall = round(r.tokens_per_s / base, 3)
        r.speedup_vs_plain = round(r.tokens_per_cpu_s / base_cpu, 3) if basis == "cpu" else r.speedup_vs_plain_wall
        hf_plain = tallies.get(("hf-generate", "plain", r.batch))
        if r.drafter.startswith("hf-") and hf_plain is not None:
            r.speedup_vs_hf_plain = round(_rate(tallies[(r.drafter, r.policy, r.batch)], basis) / _rate(hf_plain, basis), 3)
    series = {key: t.series(basis) for key, t in tallies.items()}
    engine_var = plain_engine_variance(series)
    summary = static_vs_controller(runs, policy, series, engine_var)
    acceptance = acceptance_warmup_vs_eval(
        warmup_acceptance, eval_acceptance,
        f"{policy}-warm warm-up ({len(warm_ids)} prompts, untimed, {warm_how.get('warm')}, the controller's shapes)"
        if "warm" in warm else "")
    result = {
        "model": model_name,
        "prompts": [p.id for p in items],
        "max_new_tokens": max_new_tokens,
        "threads": torch.get_num_threads(),
        "device": str(device),
        "speedup_basis": basis,
        "policy": policy,
        "controller_warmup_prompts": [p.id for p in warm_items] if warm else [],
        "controller_warmup_source": WARMUP_SOURCE if warm else "",
        # where each warm controller decoded its warm-up: tag -> crowd / alone (``warmup``)
        "controller_warmup": {tag: warm_how[tag] for tag in warm},
        "controller_config": dict(controller_overrides or {}),
        # the challenger's policy file and its fields (``challenger_policy``), "" without one
        "challenger_policy": challenger or "",
        # the lockstep rounds that ended with a ControlSync, and the wall seconds it waited (outside every timing)
        "control_sync": {"rounds": sum(s.rounds for s in syncs), "seconds": round(sum(s.seconds for s in syncs), 2)},
        "static_shapes": {d: [name for name, _ in shapes[d]] for d in learned},
        "heads": {d: getattr(built[d], "version", "") for d in learned},
        "kernels": _kernel_summary(lm.kernels),
        "verify_layout": layout,
        # one pass over every linear layer in the model's order, per row count: what chose the kernels
        "kernel_stack_ms": {} if lm.kernels is None else {"rows": list(lm.kernels.stack.rows),
                                                          **{n: list(ms) for n, ms in lm.kernels.stack.total.items()}},
        "controller_cost_models": fitted,
        "calibration": [asdict(t) for t in calibration],
        # the engines' own speeds: sd of one engine's log rate past what the rounds show, from the plain pairs
        "engine_sd_log": round(float(np.sqrt(engine_var)), 4),
        "static_vs_controller": summary,
        "acceptance_warmup_vs_eval": acceptance,
        "warmup_overrides": warmup_overrides,
        "runs": [asdict(r) for r in runs],
    }
    (out / "engine.json").write_text(json.dumps(result, indent=1))
    # Every timed run step by step (the lockstep's round i holds each run's i-th step): what the
    # intervals were drawn from, to draw them again or otherwise.
    steps = [{"drafter": d, "policy": p, "batch": b, "basis": basis,
              "ms": [round(1e3 * s, 3) for s in t.series(basis)[0]], "tokens": t.step_tokens}
             for (d, p, b), t in tallies.items()]
    with gzip.open(out / "engine-steps.json.gz", "wt") as f:
        json.dump(steps, f)
    ratios = plot and any(k.endswith("_interval") for s in summary for k in s)
    if plot:
        _plot(runs, out / "engine.png", batches)
    if ratios:
        _plot_ratios(summary, out / "engine-ratios.png")
    _print_table(runs)
    _print_summary(summary)
    print(f"(intervals widened by each engine's own speed: sd {100 * np.sqrt(engine_var):.2f} % of its rate, "
          "from the plain pairs)")
    _print_acceptance(acceptance)
    _print_overrides(runs, warmup_overrides)
    print(f"wrote {out / 'engine.json'}" + (f" and {out / 'engine.png'}" if plot else "")
          + (" and engine-ratios.png" if ratios else ""))
    return 0


CONFIRM = "confirm-"  # policy prefix of the confirmation pass's runs
# The controlled runs' policy suffixes: a fresh controller per batch, one warmed as ``warmup`` says,
# with ``warmup="both"`` one warmed alone beside it, and with a challenger policy one more on that policy.
CONTROLLER_TAGS = ("cold", "warm", "warm-alone", "challenger")
# Paired ratios of two controllers timed in the same locksteps (numerator, denominator): ``A_vs_B``.
CONTROLLER_PAIRS = (("warm", "warm-alone"), ("challenger", "warm"))


def check_challenger(policy_file: str, warmup_prompts: int) -> dict:
    """A challenger policy checked before anything loads: the policy it builds
    and a warm controller to time it beside (``warmup_prompts`` > 0). Returns
    where it was read from and its fields, for the JSON; raises ``ValueError``
    (a :class:`policies.presets.PresetError` for the file) naming what is wrong.

    >>> check_challenger("goodput", 8)["fields"]["policy"]
    'goodput'
    """
    import yaml

    from policies.presets import load_preset, preset_path

    if not warmup_prompts:
        raise ValueError(f"challenger policy {policy_file!r} is timed beside the warm controller, which "
                         f"0 warm-up prompts (--warmup-prompts 0) do not start")
    load_preset(policy_file)
    path = preset_path(policy_file)
    return {"path": str(path), "fields": yaml.safe_load(path.read_text())}


def rescore_intervals(folder: str | Path, plot: bool = True) -> list[dict]:
    """Draw a saved run's intervals again from its ``engine-steps.json.gz``
    (``static_vs_controller`` and ``engine_sd_log`` in its ``engine.json``
    rewritten, ``engine-ratios.png`` redrawn): a run made before the
    intervals took the engines' own speeds in. Returns the new summary."""
    folder = Path(folder)
    result = json.loads((folder / "engine.json").read_text())
    with gzip.open(folder / "engine-steps.json.gz", "rt") as f:
        series = {(s["drafter"], s["policy"], s["batch"]): (s["ms"], s["tokens"]) for s in json.load(f)}
    runs = [EngineRun(**r) for r in result["runs"]]
    engine_var = plain_engine_variance(series)
    summary = static_vs_controller(runs, result["policy"], series, engine_var)
    result["engine_sd_log"] = round(float(np.sqrt(engine_var)), 4)
    result["static_vs_controller"] = summary
    (folder / "engine.json").write_text(json.dumps(result, indent=1))
    if plot:
        _plot_ratios(summary, folder / "engine-ratios.png")
    return summary


def _rate(t: "_Tally", basis: str) -> float:
    """Tokens per second of ``t`` on the benchmark's basis (engine-thread CPU time, or wall time)."""
    return t.tokens / (t.cpu if basis == "cpu" else t.secs)


def best_static_name(tallies, drafter: str, batch: int, basis: str = "cpu") -> str:
    """The policy name of ``drafter``'s fastest static run at ``batch`` in
    ``tallies`` ("" when it had none): the shape the confirmation pass times again."""
    static = [(pol, t) for (d, pol, b), t in tallies.items()
              if d == drafter and b == batch and pol.startswith("static-") and t.tokens]
    return max(static, key=lambda kv: _rate(kv[1], basis))[0] if static else ""


def static_vs_controller(runs, policy: str, series: dict | None = None, engine_var: float = 0.0) -> list[dict]:
    """Per learned drafter and batch size: the best static configuration in
    hindsight (over chains and trees; speedups against plain, CPU time), the
    best chain and tree, the cold and warm controller and their ratios to
    it, and the warm (else cold) controller's share of the best oracle speedup of the
    batch (reported, not a goal).

    ``series``: (drafter, policy, batch) -> per round, the step's seconds and
    tokens (``_Tally.series``); given, each ratio to max(best static, plain)
    gets its 90 % interval over the lockstep's rounds (:mod:`bench.intervals`;
    ``*_interval``), the best static shape picked again in every replicate,
    widened by the engines' own speeds (``engine_var``: the per-engine
    variance of the log rate, :func:`plain_engine_variance`; twice, for two engines)."""
    out = []
    keys = sorted({(r.drafter, r.batch) for r in runs if r.drafter in ("ngram", "medusa", "eagle")},
                  key=lambda k: (k[1], ("ngram", "medusa", "eagle").index(k[0])))
    for drafter, batch in keys:
        rs = [r for r in runs if r.drafter == drafter and r.batch == batch]
        static = [r for r in rs if r.policy.startswith("static-")]
        if not static:
            continue
        chains = [r for r in static if "w" not in r.policy]
        tree_runs = [r for r in static if "w" in r.policy]
        best = max(static, key=lambda r: r.speedup_vs_plain)
        row = {"drafter": drafter, "batch": batch, "best_static": best.policy,
               "best_static_speedup": best.speedup_vs_plain}
        for label, group in (("chain", chains), ("tree", tree_runs)):
            b = max(group, key=lambda r: r.speedup_vs_plain) if group else None
            row[f"best_{label}"] = b.policy if b else ""
            row[f"best_{label}_speedup"] = b.speedup_vs_plain if b else 0.0
        oracle = [r.speedup_vs_plain for r in runs if r.drafter == "oracle" and r.batch == batch]
        tags = [t for t in CONTROLLER_TAGS if t in ("cold", "warm") or any(r.policy == f"{policy}-{t}" for r in rs)]
        for tag in tags:
            c = next((r for r in rs if r.policy == f"{policy}-{tag}"), None)
            row[tag] = c.speedup_vs_plain if c else None
            row[f"{tag}_vs_best_static"] = round(c.speedup_vs_plain / best.speedup_vs_plain, 3) if c else None
            row[f"{tag}_vs_best_static_or_plain"] = (round(c.speedup_vs_plain / max(best.speedup_vs_plain, 1.0), 3)
                                                     if c else None)
            if c and series:
                row[f"{tag}_vs_best_static_or_plain_interval"] = _ratio_interval(
                    series, drafter, batch, c.policy, [r.policy for r in static], engine_var=engine_var)
        again = {r.policy.removeprefix(CONFIRM): r.speedup_vs_plain for r in rs if r.policy.startswith(CONFIRM)}
        if best.policy in again:
            shape = again[best.policy]
            row["second_pass"] = {"best_static": best.policy, "best_static_speedup": shape, **{
                key: value for tag in tags if f"{policy}-{tag}" in again for key, value in (
                    (tag, again[f"{policy}-{tag}"]),
                    (f"{tag}_vs_best_static_or_plain", round(again[f"{policy}-{tag}"] / max(shape, 1.0), 3)))}}
            if series:
                for tag in tags:
                    if f"{policy}-{tag}" in again:
                        row["second_pass"][f"{tag}_vs_best_static_or_plain_interval"] = _ratio_interval(
                            series, drafter, batch, f"{CONFIRM}{policy}-{tag}", [CONFIRM + best.policy], CONFIRM,
                            engine_var)
        # Two controllers timed in the same locksteps, paired: the crowd-warmed one over the one warmed
        # alone (--warmup both), the challenger's policy over the warm one's.
        for a, b in CONTROLLER_PAIRS:
            for where, prefix in ((row, ""), (row.get("second_pass"), CONFIRM)):
                if where is not None and where.get(a) and where.get(b):
                    where[f"{a}_vs_{b}"] = round(where[a] / where[b], 3)
                    if series:
                        where[f"{a}_vs_{b}_interval"] = _pair_interval(
                            series, drafter, batch, f"{prefix}{policy}-{a}", f"{prefix}{policy}-{b}", engine_var)
        ctl = row["warm"] if row["warm"] is not None else row["cold"]
        row["share_of_oracle"] = round(ctl / max(oracle), 3) if oracle and ctl is not None else None
        row["lossless"] = all(r.lossless for r in rs)
        out.append(row)
    return out


def plain_engine_variance(series: dict) -> float:
    """The per-engine variance of the log rate the rounds do not show (:func:`bench.intervals.engine_variance`),
    from the plain pairs of every lockstep in ``series`` (plain and plain-repeat, main and second passes)."""
    from bench.intervals import engine_variance

    pairs = [(series[("none", p, b)], series[("none", p + "-repeat", b)])
             for (d, p, b) in series if d == "none" and p in ("plain", CONFIRM + "plain")
             and ("none", p + "-repeat", b) in series]
    return engine_variance(pairs)


def _ratio_interval(series: dict, drafter: str, batch: int, controller: str, static: list[str],
                    prefix: str = "", engine_var: float = 0.0) -> list[float] | None:
    """90 % interval of ``controller``'s speedup over max(best of ``static``, plain) in its lockstep
    (``prefix``: the second pass's), the speedups against the mean rate of its two plain runs;
    ``engine_var`` per engine, for the controller's engine and the one it is set against."""
    from bench.intervals import interval

    plain = [("none", prefix + p, batch) for p in ("plain", "plain-repeat")]
    keys = {"controller": (drafter, controller, batch), **{f"plain{i}": k for i, k in enumerate(plain)},
            **{f"static{i}": (drafter, s, batch) for i, s in enumerate(static)}}
    if not all(k in series for k in keys.values()):
        return None
    chosen = {name: series[k] for name, k in keys.items()}

    def ratio(rates: dict) -> "np.ndarray":
        base = (rates["plain0"] + rates["plain1"]) / 2.0
        best = np.max([rates[f"static{i}"] for i in range(len(static))], axis=0) / base
        return rates["controller"] / base / np.maximum(best, 1.0)

    lo, hi = interval(chosen, ratio, extra_log_var=2.0 * engine_var)
    return [round(lo, 3), round(hi, 3)]


def _pair_interval(series: dict, drafter: str, batch: int, a: str, b: str,
                   engine_var: float = 0.0) -> list[float] | None:
    """90 % interval of run ``a``'s rate over run ``b``'s, two runs of ``drafter`` at ``batch`` in one
    lockstep (their rounds resampled together, ``engine_var`` per engine)."""
    from bench.intervals import interval

    keys = {"a": (drafter, a, batch), "b": (drafter, b, batch)}
    if not all(k in series for k in keys.values()):
        return None
    lo, hi = interval({name: series[k] for name, k in keys.items()}, lambda r: r["a"] / r["b"],
                      extra_log_var=2.0 * engine_var)
    return [round(lo, 3), round(hi, 3)]


def _lockstep(model, engine_cls, specs, hf_depths, ids, reference, batch, max_new_tokens, tallies,
              clocks: dict[int, RunClock] | None = None, sync: Callable[[], None] | None = None,
              seed: int | str | None = None, what: str = "") -> None:
    """Run every configuration of ``specs`` side by side, one engine step each
    in turn (in a fresh order every round, :func:`_round_order`), timing each step.

    ``specs``: ``(drafter name, policy, drafter, decide, observer[, model])``
    (``model`` when not the shared one); every engine gets all prompts with
    ``max_batch = batch``. ``hf_depths``: transformers' ``generate`` on the
    shared model, one per depth (0: plain greedy, k: prompt lookup of k
    tokens), each over all prompts one at a time and stepped one target
    forward per round like the engines (``_SteppedGenerate``). Every
    configuration runs in a thread of its own (``_SteppedEngine``), none in
    the driver's. ``clocks``: id(observer) -> its controller's :class:`RunClock`;
    after each round a clock moves by the mean step time of its engines in it.
    The orders are drawn from a generator seeded with ``seed`` (default: ``batch``):
    one run's lockstep of a batch size repeats another's turn for turn. ``sync``, when
    given, runs after each round once the clocks moved (:class:`ControlSync`).
    ``what``: the progress bar's label (default: the timed lockstep of the batch size).
    """
    from worker.reference.progress import ProgressBar

    rng = random.Random(batch if seed is None else seed)

    runners, requests = {}, {}
    before: dict[tuple, tuple[Counter, Counter]] = {}  # runner key -> its agent's override counters at the start
    own_clock: dict[tuple, RunClock] = {}  # runner key -> the clock of the controller it reports to
    bar = None
    try:
        for i, (name, pol, drafter, decide, observer, *own_model) in enumerate(specs):
            key = (name, pol, batch)
            if clocks and id(observer) in clocks:
                own_clock[key] = clocks[id(observer)]
            engine = engine_cls(own_model[0] if own_model else model, drafter, decide, observer=observer,
                                max_batch=batch)
            requests[key] = [engine.submit(p, max_new_tokens) for p in ids]
            runners[key] = _SteppedEngine(engine, f"engine-{name}-{pol}")
            tallies[key] = _Tally()
            counts = _override_counts(observer)
            if counts is not None:
                before[key] = counts
            if i == 0:  # the peer's rows right after plain's
                for k in hf_depths:
                    runners[_hf_key(k)] = _SteppedGenerate(model, ids, max_new_tokens, k)
                    tallies[_hf_key(k)] = _Tally()
        expected_rounds = max(1, len(ids) * max_new_tokens // batch)
        bar = ProgressBar(expected_rounds, f"bench engine, {what or f'batch {batch}'} "
                                           f"({len(runners)} configurations in lockstep)")
        while True:
            live = [key for key, r in runners.items() if r.has_work()]
            if not live:
                break
            moved: dict[int, list] = {}  # id(clock) -> [clock, Σ step seconds, engines]
            for key in _round_order(live, rng):
                before_tokens = runners[key].tokens
                secs, cpu = runners[key].step()
                tally = tallies[key]
                tally.secs += secs
                tally.cpu += cpu
                tally.step_secs.append(secs)
                tally.step_cpu.append(cpu)
                tally.step_tokens.append(runners[key].tokens - before_tokens)
                if key in own_clock:
                    m = moved.setdefault(id(own_clock[key]), [own_clock[key], 0.0, 0])
                    m[1] += secs
                    m[2] += 1
            for clock, total, engines in moved.values():  # as if its engines had run alone, side by side
                clock.advance(total / engines)
            if sync is not None:
                sync()
            bar.update(1)
    finally:
        for runner in runners.values():
            runner.close()
        if bar is not None:
            bar.close()
    for key, runner in runners.items():
        if isinstance(runner, _SteppedGenerate):
            tallies[key].add_peer(runner, reference)
        else:
            tallies[key].add_stats(runner.engine.stats, [r.output for r in requests[key]] == reference)
        if key in before:  # one agent per controlled run of a lockstep: its counters moved for this run only
            after = _override_counts(runner.engine.observer)
            tallies[key].controlled = True
            tallies[key].overrides.update(after[0] - before[key][0])
            tallies[key].override_draft_asks.update(after[1] - before[key][1])


def _override_counts(observer) -> tuple[Counter, Counter] | None:
    """An agent's override counters (decisions, and those that draft, by reason), copied; None for another observer."""
    stats = getattr(observer, "stats", None)
    if not hasattr(stats, "override_decisions"):
        return None
    return Counter(stats.override_decisions), Counter(stats.override_draft_asks)


def _round_order(live: list, rng: random.Random) -> list:
    """The order a lockstep round steps its ``live`` configurations in: a fresh
    permutation each round, so no configuration always follows the same one
    (what an engine steps after moves its step time by about a percent, module
    docstring) and every place in the round falls to each about equally often.

    >>> rng = random.Random(8)
    >>> [_round_order(["a", "b", "c"], rng) for _ in range(3)]
    [['c', 'b', 'a'], ['c', 'a', 'b'], ['b', 'c', 'a']]
    """
    order = list(live)
    rng.shuffle(order)
    return order


def _hf_key(k: int) -> tuple[str, str, int]:
    return ("hf-generate", "plain", 1) if k == 0 else ("hf-prompt-lookup", f"static-d{k}", 1)


class _TurnThread(ABC):
    """Work that runs in a thread of its own and takes turns with the driver.

    The thread parks (``_park``, called in the thread) before each turn;
    :meth:`step` lets one turn run and waits until the thread parks again,
    so it and the driver never run at once. CPU time is the thread's own
    (``time.thread_time`` at each park). Subclasses set themselves up, then
    call ``__init__``, and implement ``_body`` (it parks before every turn).
    """

    def __init__(self, name: str) -> None:
        self.turns = 0
        self._cpu = 0.0  # the thread's CPU seconds when it last parked
        self._go = threading.Event()
        self._parked = threading.Event()
        self._closing = False
        self._finished = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._parked.wait()
        self._cpu_reported = self._cpu  # the thread's start-up is nobody's turn

    @abstractmethod
    def _body(self) -> None:
        """The thread's work; calls ``_park`` before every turn."""

    def _park(self) -> None:
        if self._closing:
            raise RuntimeError("benchmark stopped")
        self.turns += 1
        self._cpu = time.thread_time()
        self._parked.set()
        self._go.wait()
        self._go.clear()
        if self._closing:  # released by close(): stop instead of running on unparked
            raise RuntimeError("benchmark stopped")

    def _run(self) -> None:
        inherit_threads()  # MKL's count is per thread: apply the process's here
        try:
            with torch.inference_mode():
                self._body()
        except BaseException as err:  # re-raised by step()
            self._error = err
        finally:
            self._cpu = time.thread_time()
            self._finished = True
            self._parked.set()

    def has_work(self) -> bool:
        return not self._finished

    def step(self) -> tuple[float, float]:
        """Let one turn run; ``(wall seconds, CPU seconds)`` it took."""
        t0 = time.perf_counter()
        self._parked.clear()
        self._go.set()
        self._parked.wait()
        if self._error is not None and not self._closing:
            raise RuntimeError(f"{self._thread.name} failed") from self._error
        cpu, self._cpu_reported = self._cpu - self._cpu_reported, self._cpu
        return time.perf_counter() - t0, cpu

    def close(self) -> None:
        """Stop a thread still parked (it raises instead of taking its turn)."""
        self._closing = True
        self._go.set()
        self._thread.join(timeout=60)


class _SteppedEngine(_TurnThread):
    """An engine in a thread of its own, one ``Engine.step`` per turn.

    Every configuration of the lockstep runs in a thread of its own, the
    engines as the transformers peers, so none of them runs in the process's
    main thread: there the same engine measured 4-6 % more CPU per step than
    in a thread started for it (one-off lockstep on SmolLM2, issue #4), which
    tilted every comparison between an engine and a peer. The worker runs
    its engine in a thread of its own too (``worker.reference.server``).
    """

    def __init__(self, engine, name: str) -> None:
        self.engine = engine
        super().__init__(name)

    @property
    def tokens(self) -> int:
        """Tokens emitted so far."""
        return self.engine.stats.tokens

    def _body(self) -> None:
        while self.engine.has_work():
            self._park()
            self.engine.step()


class _SteppedGenerate(_TurnThread):
    """transformers' ``generate`` (``k`` = 0: plain greedy; else prompt lookup
    of ``k`` tokens) over ``ids`` one prompt at a time, one target forward
    per :meth:`step`.

    ``generate`` cannot be stepped from outside, so a forward pre-hook on
    the model parks its thread before every forward; a turn is one forward
    with the host work up to the next one (candidate lookup, logits
    processing, stopping checks). So the peer meets the machine's slow
    minutes and the caches as the engines beside it do, forward for
    forward, where a whole uninterrupted ``generate`` call ran with caches
    the engines in lockstep never get (the engine's plain decoding measured
    1.06x slower than transformers' that way).

    The hook counts forwards, so ``steps`` and ``mean_accepted`` compare
    with the engine's exactly (steps are deterministic under greedy
    decoding); assisted decoding runs the prompt and the first candidates in
    one forward, so every forward is one step emitting τ + 1 tokens.
    """

    def __init__(self, model, ids, max_new_tokens: int, k: int) -> None:
        self.model, self.ids, self.max_new_tokens, self.k = model, ids, max_new_tokens, k
        self.outputs: list[list[int]] = []
        self._hook = model.register_forward_pre_hook(self._before_forward)
        self._own: int | None = None
        super().__init__(f"hf-generate-k{k}")

    @property
    def forwards(self) -> int:
        return self.turns

    @property
    def tokens(self) -> int:
        """Tokens of the prompts finished so far (``generate`` returns a prompt's answer whole)."""
        return sum(len(o) for o in self.outputs)

    def _before_forward(self, module, args) -> None:
        if threading.get_ident() == self._own:  # not another peer's thread, nor an engine's
            self._park()

    def _body(self) -> None:
        self._own = threading.get_ident()  # the hook parks this thread only
        device = next(self.model.parameters()).device
        for p in self.ids:
            x = torch.tensor([p], device=device)
            y = self.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                    max_new_tokens=self.max_new_tokens, prompt_lookup_num_tokens=self.k or None)
            self.outputs.append(y[0, len(p):].tolist())

    def close(self) -> None:
        """Stop a thread still parked, then unhook."""
        super().close()
        self._hook.remove()


def _settle(agents, timeout_s: float = 5.0, ingest_s: float = 0.3) -> None:
    """Wait until the agents have sent what they observed (they flush every
    0.1 s), and a little more for the controller to take it in, so that the
    fitted costs and the recording hold the last requests too."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(getattr(a, "_steps", None) or getattr(a, "_finished", None)
                                              for a in agents.values()):
        time.sleep(0.05)
    time.sleep(ingest_s)


def _fitted_costs(address: str, batches, context_len: float = 200.0) -> dict:
    """What the controller's cost model of each agent's worker says at the end:
    its fit error and the verify ms it predicts for a batch of ``context_len``-token
    requests running 0..11 draft nodes each (``GetStatus``)."""
    from controller.client import cost_params, fetch_status

    out = {}
    for w in fetch_status(address).workers:
        c = cost_params(w.cost_model)
        predicted = {}
        for b in batches:
            kv = b * context_len
            predicted[b] = [round(float(c.verify_ms(b * (1 + n), kv, b * (1 + n) * context_len)), 2) for n in range(12)]
        out[w.hello.worker_id] = {"samples": w.cost_model.samples, "rmse_ms": round(w.cost_model.rmse_ms, 2),
                                  "verify_ms_by_batch_and_nodes_per_request": predicted}
    return out


def _kernel_summary(report) -> dict:
    """The linear-kernel choice per weight shape, for the JSON (``{}``: torch's defaults)."""
    if report is None:
        return {}
    out = {}
    for key, d in report.dispatch.items():
        t = report.timings[key]
        dense = dict(zip(t.rows, t.ms["dense"]))
        out[key] = {"packed": d.packed, "rows_run_as": [d.lookup(r)[1] for r in range(1, 17)],
                    "kernels_by_rows": [d.lookup(r)[0] for r in range(1, 17)],
                    "ms_vs_default_by_rows": {r: round(d.ms[r - 1] / dense[r], 3) for r in (1, 2, 3, 4, 8, 16)
                                              if r in dense}}
    return out


def _print_table(runs) -> None:
    print(f"{'drafter':18} {'policy':18} {'batch':>5} {'tok/s':>7} {'tok/cpu-s':>9} {'speedup':>7} {'(wall)':>7} "
          f"{'τ':>5} {'occ.':>5} {'lossless':>8}")
    for r in runs:
        print(f"{r.drafter:18} {r.policy:18} {r.batch:>5} {r.tokens_per_s:7.2f} {r.tokens_per_cpu_s:9.2f} "
              f"{r.speedup_vs_plain:7.3f} {r.speedup_vs_plain_wall:7.3f} {r.mean_accepted:5.2f} {r.occupancy:5.2f} "
              f"{str(r.lossless):>8}")


def _print_summary(summary) -> None:
    if not summary:
        return
    def num(x):
        return "-" if x is None else f"{x:.3f}"

    print(f"\n{'drafter':8} {'batch':>5} {'best static (hindsight)':>26} {'cold':>6} {'warm':>6} "
          f"{'cold/best':>9} {'warm/best':>9} | second pass: {'shape':>6} {'cold':>6} {'warm':>6} "
          f"{'cold/shape':>10} {'warm/shape':>10}  (/best, /shape: against max(it, plain))")
    for s in summary:
        best = f"{s['best_static']} {s['best_static_speedup']:.3f}"
        two = s.get("second_pass", {})
        print(f"{s['drafter']:8} {s['batch']:>5} {best:>26} {num(s['cold']):>6} {num(s['warm']):>6} "
              f"{num(s['cold_vs_best_static_or_plain']):>9} {num(s['warm_vs_best_static_or_plain']):>9} | "
              f"{'':13}{num(two.get('best_static_speedup')):>6} {num(two.get('cold')):>6} {num(two.get('warm')):>6} "
              f"{num(two.get('cold_vs_best_static_or_plain')):>10} {num(two.get('warm_vs_best_static_or_plain')):>10}")
    def spaced(x):
        return f" {_span(x)}" if x else ""

    # (the controller a block is about, the paired ratio's numerator and denominator, the block's title)
    for about, a, b, title in (("warm-alone", "warm", "warm-alone", "warmed alone beside it (warm-alone)"),
                               ("challenger", "challenger", "warm",
                                "the challenger's policy beside the warm one (challenger)")):
        if not any(about in s for s in summary):
            continue
        print(f"\n{title}: against max(best static, plain) / max(shape, plain), and {a}/{b} paired "
              f"(90 % interval)")
        for s in summary:
            two = s.get("second_pass", {})
            print(f"{s['drafter']:8} {s['batch']:>5}  main {num(s.get(f'{about}_vs_best_static_or_plain')):>6}"
                  f"  {a}/{b} {num(s.get(f'{a}_vs_{b}'))}{spaced(s.get(f'{a}_vs_{b}_interval'))}"
                  f"  | second pass {num(two.get(f'{about}_vs_best_static_or_plain')):>6}"
                  f"  {a}/{b} {num(two.get(f'{a}_vs_{b}'))}{spaced(two.get(f'{a}_vs_{b}_interval'))}")
    if not any(k.endswith("_interval") for s in summary for k in s):
        return
    span = _span
    print("\n90 % intervals (the lockstep's rounds resampled in blocks, the best shape picked again each time, "
          "the engines' own speeds added):")
    for s in summary:
        two = s.get("second_pass", {})
        others = "".join(f"{label}{span(where.get(f'{tag}_vs_best_static_or_plain_interval'))}"
                        for tag in ("warm-alone", "challenger")
                        for label, where in ((f" | {tag}: /best ", s), (" /shape ", two)) if tag in where)
        print(f"{s['drafter']:8} {s['batch']:>5}  cold/best {span(s.get('cold_vs_best_static_or_plain_interval'))}"
              f"  warm/best {span(s.get('warm_vs_best_static_or_plain_interval'))}"
              f" | second pass: cold/shape {span(two.get('cold_vs_best_static_or_plain_interval'))}"
              f"  warm/shape {span(two.get('warm_vs_best_static_or_plain_interval'))}" + others)


def _span(x) -> str:
    """An interval as printed: ``[lo, hi]``, or ``-`` where there is none."""
    return "-" if not x else f"[{x[0]:.3f}, {x[1]:.3f}]"


def _print_acceptance(rows) -> None:
    if not rows:
        return
    print("\nacceptance, warm-up prompts / evaluation prompts: top-ranked candidate accepted per position "
          "(any candidate in brackets where it differs), mean τ per drafting row-step, drafting row-steps")

    def rate(x):
        return "-" if x is None else f"{x:.3f}"

    for r in rows:
        positions = []
        for i, k in enumerate(r["positions"]):
            cell = f"p{k} {rate(r['warmup_top1_rates'][i])}/{rate(r['eval_top1_rates'][i])}"
            if (r["warmup_rates"][i], r["eval_rates"][i]) != (r["warmup_top1_rates"][i], r["eval_top1_rates"][i]):
                cell += f" ({rate(r['warmup_rates'][i])}/{rate(r['eval_rates'][i])})"
            positions.append(cell)
        print(f"{r['drafter']:8} {r['batch']:>5}  warm-up vs {r['eval_source'] or '-'}: " + "  ".join(positions)
              + f"  τ {r['warmup_mean_accepted']:.3f}/{r['eval_mean_accepted']:.3f}"
              f"  rows {r['warmup_drafting_row_steps']}/{r['eval_drafting_row_steps']}"
              f"  depth {r['warmup_mean_depth']:.2f}/{r['eval_mean_depth']:.2f}")


def _print_overrides(runs, warmup: list[dict]) -> None:
    """Where the controlled runs' drafting came from: row-steps an override
    decided and asked to draft, by reason, beside all the row-steps that drafted."""
    rows = [(f"{r.policy} {r.drafter} b{r.batch}", r.spec_row_steps, r.override_row_steps, r.override_draft_asks)
            for r in runs if r.controlled]
    rows += [(f"{'' if w.get('pass', 'main') == 'main' else CONFIRM}{w.get('controller', 'warm')} warm-up "
              f"({w.get('warmup', 'alone')}) {w['drafter']} b{w['batch']}", w["spec_row_steps"],
              w["override_row_steps"], w["override_draft_asks"]) for w in warmup]
    if not rows:
        return
    print("\nrow-steps decided by per-request overrides, by reason: asked to draft / all "
          "(row-steps that drafted, overrides and table together)")
    for label, spec, decided, drafted in rows:
        reasons = "  ".join(f"{reason or '-'} {drafted.get(reason, 0)}/{n}" for reason, n in sorted(decided.items()))
        print(f"  {label:34} {reasons or 'none'}  (drafting {spec})")


def _plot(runs, path: Path, batches) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def shown(r, b, second_pass):
        return r.batch == b and r.policy.startswith(CONFIRM) == second_pass and not r.policy.endswith("plain-repeat")

    first = {b: sum(shown(r, b, False) for r in runs) for b in batches}
    second = {b: sum(shown(r, b, True) for r in runs) for b in batches}
    per_batch = {b: [r for r in runs if shown(r, b, False)] + [r for r in runs if shown(r, b, True)] for b in batches}
    width = max(8.0, 0.32 * max(len(rs) for rs in per_batch.values()))
    fig, axes = plt.subplots(len(batches), 1, figsize=(width, 4.6 * len(batches)), squeeze=False)
    colors = {"none": "#888888", "hf-generate": "#ccaa77", "hf-prompt-lookup": "#bb8844", "ngram": "#4477aa",
              "medusa": "#aa3377", "eagle": "#228833", "oracle": "#222222"}
    for ax, batch in zip(axes[:, 0], batches):
        rs = per_batch[batch]
        labels = [f"{r.drafter}\n{r.policy}" for r in rs]
        # static trees lighter than chains; the controller hatched: '//' cold, 'xx' warm
        bars = ax.bar(range(len(rs)), [r.speedup_vs_plain for r in rs],
                      color=[colors.get(r.drafter, "#999") for r in rs], edgecolor="k", linewidth=0.4)
        for bar, r in zip(bars, rs):
            if r.policy.removeprefix(CONFIRM).startswith("static-") and "w" in r.policy:
                bar.set_alpha(0.55)
            elif r.policy.endswith("-cold"):
                bar.set_hatch("//")
            elif r.policy.endswith("-warm"):
                bar.set_hatch("xx")
            elif r.policy.endswith("-warm-alone"):
                bar.set_hatch("..")
            elif r.policy.endswith("-challenger"):
                bar.set_hatch("++")
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(rs)))
        ax.set_xticklabels(labels, rotation=70, fontsize=6)
        ax.set_title(f"batch {batch}: static chains (solid), static trees (light), controller cold (//) and "
                     f"warm (xx); right of the red line: the second pass (the picked shapes against fresh "
                    f"controllers)", fontsize=9)
        ax.set_ylabel("speedup vs plain greedy, same batch\n(engine CPU time); labels: tok/s (wall)", fontsize=8)
        for i, r in enumerate(rs):
            ax.text(i, r.speedup_vs_plain + 0.02, f"{r.tokens_per_s:.0f}", ha="center", fontsize=5)
        if second[batch]:  # the second pass: its own lockstep, to the right of a line
            ax.axvline(first[batch] - 0.5, color="#cc2222", lw=1.0)
            ax.text(first[batch] - 0.4, ax.get_ylim()[1] * 0.97, "second pass", color="#cc2222", fontsize=7, va="top")
    fig.suptitle("specctl reference engine, SmolLM2-135M on this CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_ratios(summary: list[dict], path: Path) -> None:
    """Each controller's ratio to max(best static, plain) per drafter and batch, main pass and second pass,
    with its 90 % interval (:func:`_ratio_interval`): under the line at 1 with the whole bar, behind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [f"{s['drafter']}\nb{s['batch']}" for s in summary]
    series = [("cold", "main", "#88aacc", "o"), ("warm", "main", "#224477", "s"),
              ("cold", "second", "#ddaa88", "o"), ("warm", "second", "#aa5522", "s")]
    if any("warm-alone" in s for s in summary):  # warmed alone beside the crowd-warmed one
        series[2:2] = [("warm-alone", "main", "#66aa66", "^")]
        series.append(("warm-alone", "second", "#226622", "^"))
    if any("challenger" in s for s in summary):  # another policy file beside the warm one
        series.insert(len(series) // 2, ("challenger", "main", "#bb66bb", "D"))
        series.append(("challenger", "second", "#772277", "D"))
    fig, ax = plt.subplots(figsize=(max(7.0, 1.0 * len(cells)), 4.2))
    for i, (tag, passed, color, marker) in enumerate(series):
        xs, ys, lo, hi = [], [], [], []
        for x, s in enumerate(summary):
            where = s if passed == "main" else s.get("second_pass", {})
            value = where.get(f"{tag}_vs_best_static_or_plain")
            span = where.get(f"{tag}_vs_best_static_or_plain_interval")
            if value is None or not span:
                continue
            xs.append(x + (i - (len(series) - 1) / 2) * 0.17)
            ys.append(value)
            lo.append(max(value - span[0], 0.0))
            hi.append(max(span[1] - value, 0.0))
        ax.errorbar(xs, ys, yerr=[lo, hi], fmt=marker, color=color, capsize=2, ms=4, lw=1,
                    label=f"{tag}, {passed} pass")
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(cells)))
    ax.set_xticklabels(cells, fontsize=8)
    ax.set_ylabel("controller / max(best static, plain)\n(90 % interval: rounds resampled, engines' own speeds)",
                  fontsize=8)
    ax.set_title("Controller vs the best static shape in hindsight (main pass)\nand vs the picked shape "
                 "(second pass)", fontsize=9)
    # below the axes, where it hides no interval
    ax.legend(fontsize=7, ncol=3 if len(series) > 4 else 4, loc="upper center", bbox_to_anchor=(0.5, -0.16))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
