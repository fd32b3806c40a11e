"""``specctl replay FILE --policy PRESET``: a policy's goodput on recorded telemetry.

The recording (``specctl serve --record FILE``, :mod:`controller.observe.recorder`)
holds what workers really ran. Replay feeds it, message by message and step
by step, to a fresh :class:`controller.core.Controller` running the policy
under test, on the recording's own clock: the controller fits its cost and
acceptance models from the recorded steps exactly as it would live, and its
plans reach a simulated worker link ``delay_steps`` of that worker's steps
later. Before each recorded step is ingested, every request in it is
re-decided under the plan in force (per-request override first, then the
table; until the worker's first plan arrives it keeps its recorded decision)
and its accepted length τ under that decision is estimated.

Censoring — what one recorded request-step says about another decision.
The recorded per-position outcome gives, along the path the target took, the
accepted rank at each level reached (0 = none of the ``c`` offered
candidates) and how many candidates were offered. Walking the counterfactual
tree (built best-first from the acceptance model's ``q`` for the request's
context bucket with the policy's depth, width and node budget) level by
level along that path:

- a level where the recorded rank ``r ≥ 1`` was accepted: the counterfactual
  tree accepts it too if it offers at least ``r`` candidates there (τ + 1,
  continue along it), else it rejects there — exact either way;
- a level where none of the ``c`` recorded candidates was accepted: if the
  counterfactual offers ``≤ c`` candidates it rejects — exact; ranks
  ``c + 1 ..`` it offers beyond were never tested, so they get the model's
  probability conditional on ranks ``1..c`` having failed,
  ``q[k, r] / (1 − Σ_{r' ≤ c} q[k, r'])``, and their subtrees the model's value;
- a level the recorded step never reached — past its depth ``d`` after
  ``τ = d``, or past a leaf — is unobserved: the model's expected value of the
  counterfactual subtree there (Σ over its nodes of the product of ``q`` along
  the path).

``q`` is the probability that a slot is offered *and* accepted (the
acceptance model's rank probabilities times the drafter's learned offer
probabilities, as the policy values nodes): a prompt-lookup drafter finds
a match for a minority of requests and seldom has a second candidate, so a
request-step the recording ran plain is worth that much less drafted. One
where the drafter was asked for a draft and offered none (``requested_depth``
> 0, ``depth`` 0) gets nothing under any decision, exactly.

For chains this is the rule: **a step run at depth d with τ < d tells nothing
about positions past τ + 1** (position τ + 1 was rejected, so any depth
``≥ τ + 1`` gives exactly τ, any depth ``≤ τ`` gives exactly that depth);
**τ = d tells nothing past d** — a shorter or equal depth is exact, a longer
one adds ``Σ_{k=d+1..d'} Π_{j=d+1..k} α_j`` from the acceptance model. A
step that did not speculate (d = 0) is all model.

Step time comes from the cost model the controller fitted on the whole
recording: ``verify_ms(Σ(1 + nodes'), Σ context, Σ (1 + nodes')·context) + draft_ms(max depth',
Σ nodes') + catch_up_ms(tokens caught up')`` for the counterfactual batch, and
the same for the recorded decisions, so the two estimates share one clock and
their ratio is meaningful; the measured goodput of the recording is reported
next to them. The verify shape is the one the worker's forward computes: on a
``PADDED`` worker (``Hello.verify_layout``) every row carries the widest
block, ``batch · (1 + max nodes')`` tokens and ``Σ context · (1 + max nodes')``
pairs, as the controller fits it (a policy that drafts for one request of
eight pays for all eight there; priced packed, such a step looked nearly
free). A drafter that catches a request up on the context it was off for
(EAGLE's head cache: ``caught_up_tokens``) costs that too: a counterfactual
request that drafts owes the context it reached since its last
counterfactual drafting step (the controller's own rule), priced at the
fitted ms per caught-up token (0 for a drafter that never reported one).
What replay cannot see: the batch is the recorded one (a faster policy would
have had smaller batches), and shapes the recording never ran (e.g. compute-
bound batches) rest on the cost model's extrapolation.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from controller.config import ServerConfig
from controller.core import Controller, WorkerState
from controller.protocol import Invalid
from controller.observe.recorder import finished_from_dict, hello_from_dict, read_recording, step_from_dict
from policies.table import Decision, DecisionTable, bucket_index
from protos.speculation.v1 import plan_pb2, worker_pb2
from worker.sdk.agent import compile_plan
from worker.sim.tree import TreeShape, build_tree

# ------------------------------------------------------------ the estimator
def subtree_value(tree: TreeShape, q: np.ndarray, node: int, level: int) -> float:
    """E[accepted tokens below ``node``] (at depth ``level``) under ``q``, with no observation."""
    total = 0.0
    first = int(tree.first_child[node])
    for r in range(int(tree.child_count[node])):
        p = float(q[level, r]) if level < q.shape[0] and r < q.shape[1] else 0.0
        if p > 0.0:
            total += p * (1.0 + subtree_value(tree, q, first + r, level + 1))
    return total


def censored_tau(tree: TreeShape, q: np.ndarray, accepted_rank: Sequence[int], level_candidates: Sequence[int]) -> tuple[float, bool]:
    """(E[τ] of ``tree`` given a recorded per-position outcome, whether it is exact).

    ``accepted_rank[k]`` / ``level_candidates[k]``: the recorded accepted rank
    (1-based, 0 = none) and candidates offered at level ``k + 1`` along the path
    the target took (``speculation.v1`` semantics; empty when the recorded step
    did not speculate). ``q[k, r]``: the acceptance model's probability that
    rank ``r + 1`` is accepted at position ``k + 1`` given the path so far.

    >>> from worker.sim.tree import chain_tree
    >>> q = np.array([[0.8], [0.5], [0.5]])
    >>> censored_tau(chain_tree(2), q, [1, 0], [1, 1])  # τ=1 < d=2: exact for any depth
    (1.0, True)
    >>> censored_tau(chain_tree(3), q, [1, 1], [1, 1])  # τ=d=2: position 3 from the model
    (2.5, False)
    """
    node, level, tau = 0, 0, 0.0
    while True:
        offered = int(tree.child_count[node])
        if offered == 0:
            return tau, True
        if level >= len(accepted_rank):  # never reached in the recording
            return tau + subtree_value(tree, q, node, level), False
        rank, seen = int(accepted_rank[level]), int(level_candidates[level])
        if rank >= 1:
            if rank > offered:
                return tau, True  # the target's token is not among the counterfactual candidates
            tau += 1.0
            node = int(tree.first_child[node]) + rank - 1
            level += 1
            continue
        if offered <= seen:
            return tau, True  # every candidate offered was tested and refused
        row = q[level] if level < q.shape[0] else np.zeros(0)
        failed = float(row[:seen].sum())
        rest = max(1.0 - failed, 1e-9)
        first = int(tree.first_child[node])
        extra = 0.0
        for r in range(seen, min(offered, row.shape[0])):
            p = float(row[r]) / rest
            extra += p * (1.0 + subtree_value(tree, q, first + r, level + 1))
        return tau + extra, False


def recorded_outcome(r: worker_pb2.RequestStep) -> tuple[list[int], list[int]]:
    """(accepted_rank, level_candidates), derived for a chain that omitted them."""
    if r.depth == 0:
        return [], []
    if r.accepted_rank:
        return list(r.accepted_rank), list(r.level_candidates)
    reached = min(r.accepted + 1, r.depth)
    return [1] * r.accepted + [0] * (reached - r.accepted), [1] * reached


# -------------------------------------------------------------- the replay
@dataclass
class StepEstimate:
    batch_size: int
    kv_tokens: int
    unreported: int
    # counterfactual
    tokens: float
    nodes: int
    max_depth: int
    attn_pairs: int
    # recorded
    rec_tokens: int
    rec_nodes: int
    rec_max_depth: int
    rec_attn_pairs: int
    measured_ms: float
    widest: int = 0  # the largest draft block of one request: a padded forward's width
    rec_widest: int = 0
    caught_up_tokens: int = 0  # context the drafter catches up on before drafting
    rec_caught_up_tokens: int = 0

    def verify_shape(self, padded: bool, recorded: bool = False) -> tuple[int, int]:
        """(batch tokens, attention pairs) of the forward: packed, Σ (1 + nodes); padded,
        every row carries the widest block (unreported rows too: they are in the batch)."""
        nodes, widest, pairs = ((self.rec_nodes, self.rec_widest, self.rec_attn_pairs) if recorded
                                else (self.nodes, self.widest, self.attn_pairs))
        if padded:
            return self.batch_size * (1 + widest), self.kv_tokens * (1 + widest)
        return self.batch_size + nodes, pairs


@dataclass
class ReplayWorker:
    """The worker side of one recorded worker: its plans and its estimates."""

    state: WorkerState
    hello: worker_pb2.Hello
    delay_steps: int
    table: DecisionTable | None = None  # None: no plan yet, keep the recorded decision
    overrides: dict[str, Decision] = field(default_factory=dict)
    version: int = 0
    steps: int = 0
    pending: deque = field(default_factory=deque)
    estimates: list[StepEstimate] = field(default_factory=list)
    exact: int = 0
    request_steps: int = 0
    speculating: int = 0
    trees: dict = field(default_factory=dict)
    details: list | None = None
    # request id -> context the counterfactual drafter has caught up to (its last drafting step's end)
    drafted_through: dict[str, int] = field(default_factory=dict)

    @property
    def padded(self) -> bool:
        return self.hello.verify_layout == worker_pb2.VERIFY_LAYOUT_PADDED

    def decide(self, r: worker_pb2.RequestStep, batch_size: int) -> Decision | None:
        override = self.overrides.get(r.request_id)
        if override is not None:
            return override
        if self.table is None:
            return None
        return self.table.lookup(batch_size, r.context_len)

    def deliver(self, ctl: Controller, item) -> None:
        try:
            if isinstance(item, plan_pb2.Plan):
                self.table = compile_plan(item, self.hello, self.version)
                self.version = item.version
            else:
                overrides = dict(self.overrides)
                for rd in item.decisions:
                    c = rd.decision
                    overrides[rd.request_id] = Decision(c.depth, c.width, c.max_nodes)
                for rid in item.cleared:
                    overrides.pop(rid, None)
                self.overrides = overrides
        except ValueError as err:
            ctl.nack(self.state, worker_pb2.Nack(version=item.version, nonce=item.nonce, reason=str(err)))
            return
        ctl.ack(self.state, worker_pb2.Ack(version=item.version, nonce=item.nonce))


class Replayer:
    """Re-run a recording through a fresh controller with ``policy``."""

    def __init__(self, policy, config: ServerConfig | None = None, delay_steps: int = 2,
                 keep_details: bool = False) -> None:
        self.now = 0.0
        self.controller = Controller(config or ServerConfig(), policy, clock=lambda: self.now)
        self.delay_steps = delay_steps
        self.keep_details = keep_details
        self.workers: dict[str, ReplayWorker] = {}
        self.skipped = 0

    def feed(self, records: Iterable[dict[str, Any]]) -> None:
        for rec in records:
            kind = rec.get("kind")
            if kind == "header":
                continue
            self.now = max(self.now, float(rec.get("t", self.now)))
            if kind == "hello":
                self.on_hello(hello_from_dict(rec["hello"]))
                continue
            worker = self.workers.get(rec.get("worker_id", ""))
            if worker is None:
                self.skipped += 1
                continue
            if kind == "steps":
                for d in rec["steps"]:
                    self.on_step(worker, step_from_dict(d))
            elif kind == "finished":
                msg = finished_from_dict(rec["finished"])
                self.controller.finished(worker.state, msg)
                worker.overrides.pop(msg.request_id, None)
                worker.drafted_through.pop(msg.request_id, None)

    def on_hello(self, hello: worker_pb2.Hello) -> None:
        try:
            state = self.controller.hello(hello)
        except Invalid:
            self.skipped += 1
            return
        old = self.workers.get(hello.worker_id)
        if old is not None and old.state is state:
            old.hello = hello
            return
        self.workers[hello.worker_id] = ReplayWorker(state, hello, self.delay_steps,
                                                     details=[] if self.keep_details else None)

    def on_step(self, worker: ReplayWorker, step: worker_pb2.StepReport) -> None:
        ctl = self.controller
        counters = (worker.exact, worker.request_steps, worker.speculating,
                    len(worker.details) if worker.details is not None else 0)
        through = {r.request_id: worker.drafted_through.get(r.request_id) for r in step.requests}
        estimate = self.estimate(worker, step)  # before ingesting: the policy must not see the outcome
        rejected = ctl.ingest(worker.state, worker_pb2.StepReports(steps=[step]))
        if rejected:  # the controller refused it: it is not part of the replay
            worker.exact, worker.request_steps, worker.speculating, n = counters
            if worker.details is not None:
                del worker.details[n:]
            for rid, value in through.items():
                if value is None:
                    worker.drafted_through.pop(rid, None)
                else:
                    worker.drafted_through[rid] = value
            return
        worker.estimates.append(estimate)
        worker.steps += 1
        for item in ctl.plan_updates(worker.state):
            worker.pending.append((worker.steps + worker.delay_steps, item))
        while worker.pending and worker.pending[0][0] <= worker.steps:
            worker.deliver(ctl, worker.pending.popleft()[1])

    def estimate(self, worker: ReplayWorker, step: worker_pb2.StepReport) -> StepEstimate:
        limits = worker.state.limits
        view = None
        q_by_bucket: dict[int, np.ndarray] = {}
        tokens, nodes, max_depth, pairs, widest, caught_up = 0.0, 0, 0, 0, 0, 0
        rec_tokens, rec_nodes, rec_depth, rec_pairs, kv, rec_widest, rec_caught_up = 0, 0, 0, 0, 0, 0, 0
        for r in step.requests:
            kv += r.context_len
            rec_tokens += r.accepted + 1
            rec_nodes += r.nodes
            rec_pairs += (1 + r.nodes) * r.context_len
            rec_depth = max(rec_depth, r.depth)
            rec_widest = max(rec_widest, r.nodes)
            rec_caught_up += r.caught_up_tokens
            decision = worker.decide(r, step.batch_size)
            worker.request_steps += 1
            if decision is None:  # no plan yet: what the worker really ran
                tau, exact, n, d = float(r.accepted), True, r.nodes, r.depth
            else:
                decision = limits.clamp(decision)
                if decision.depth == 0 or (r.requested_depth > 0 and r.depth == 0):
                    # Off, or the drafter was asked and had nothing (prompt lookup without a
                    # match): nothing under any decision either.
                    tau, exact, n, d = 0.0, True, 0, 0
                else:
                    if view is None:
                        view = ctl_view(self.controller, worker.state)
                    bucket = bucket_index(self.controller.context_edges, r.context_len)
                    q = q_by_bucket.get(bucket)
                    if q is None:  # P(offered and accepted) per slot, as the policy values nodes
                        q = q_by_bucket[bucket] = view.rank_probs(bucket) * view.offer_probs(bucket)
                    tree = self.tree(worker, q, decision)
                    ranks, cands = recorded_outcome(r)
                    tau, exact = censored_tau(tree, q, ranks, cands)
                    n, d = tree.nodes, tree.depth
            worker.exact += exact
            worker.speculating += d > 0
            tokens += tau + 1.0
            nodes += n
            pairs += (1 + n) * r.context_len
            max_depth = max(max_depth, d)
            widest = max(widest, n)
            if d > 0:  # what it owes since its last drafting step, then caught up to its next context
                caught_up += max(r.context_len - worker.drafted_through.get(r.request_id, 0), 0)
                worker.drafted_through[r.request_id] = r.context_len + r.accepted + 1  # the recorded trajectory
            if worker.details is not None:
                worker.details.append((r.request_id, r.depth, r.accepted, decision, tau, exact))
        unreported = max(0, step.batch_size - len(step.requests))
        return StepEstimate(step.batch_size, kv, unreported, tokens + unreported, nodes, max_depth, pairs,
                            rec_tokens + unreported, rec_nodes, rec_depth, rec_pairs,
                            step.draft_ms + step.verify_ms + step.catch_up_ms, widest, rec_widest, caught_up,
                            rec_caught_up)

    def tree(self, worker: ReplayWorker, q: np.ndarray, decision: Decision) -> TreeShape:
        """The counterfactual tree: best-first from the model's ``q`` (cached by ``q`` and decision)."""
        key = (q.tobytes(), decision)
        tree = worker.trees.get(key)
        if tree is None:
            if len(worker.trees) > 4096:
                worker.trees.clear()
            tree = worker.trees[key] = build_tree(q, decision.depth, decision.width, decision.max_nodes)
        return tree

    def step_ms(self, worker: ReplayWorker) -> tuple[np.ndarray, np.ndarray]:
        """(counterfactual, recorded) model step time of each of ``worker``'s estimates (ms),
        under the cost model fitted on the whole recording."""
        cost = worker.state.cost.refit()
        e = worker.estimates

        def priced(recorded: bool) -> np.ndarray:
            shapes = np.array([x.verify_shape(worker.padded, recorded) for x in e], float).reshape(-1, 2)
            kv = np.array([x.kv_tokens for x in e], float)
            depth = np.array([x.rec_max_depth if recorded else x.max_depth for x in e], float)
            nodes = np.array([x.rec_nodes if recorded else x.nodes for x in e], float)
            caught = np.array([x.rec_caught_up_tokens if recorded else x.caught_up_tokens for x in e], float)
            return (np.asarray(cost.verify_ms(shapes[:, 0], kv, shapes[:, 1])) + np.asarray(cost.draft_ms(depth, nodes))
                    + np.asarray(cost.catch_up_ms(caught)))

        return priced(False), priced(True)

    def result(self) -> dict[str, Any]:
        out_workers = {}
        totals = np.zeros(5)  # tokens, ms, rec tokens, rec model ms, measured ms
        exact = request_steps = speculating = 0
        for wid, w in self.workers.items():
            if not w.estimates:
                continue
            e = w.estimates
            ms, rec_ms = self.step_ms(w)
            row = np.array([sum(x.tokens for x in e), ms.sum(), sum(x.rec_tokens for x in e), rec_ms.sum(),
                            sum(x.measured_ms for x in e)])
            totals += row
            exact += w.exact
            request_steps += w.request_steps
            speculating += w.speculating
            out_workers[wid] = _summary(row, w.exact, w.request_steps, w.speculating, len(e))
        out = _summary(totals, exact, request_steps, speculating, sum(len(w.estimates) for w in self.workers.values()))
        out["policy"] = self.controller.policy.name
        out["workers"] = out_workers
        out["skipped_records"] = self.skipped
        return out


def ctl_view(controller: Controller, state: WorkerState):
    return controller.acceptance.view(state.drafter_key, state.limits.max_depth, state.limits.max_width)


def _summary(row: np.ndarray, exact: int, request_steps: int, speculating: int, steps: int) -> dict[str, Any]:
    tokens, ms, rec_tokens, rec_ms, measured_ms = row
    est = 1000.0 * tokens / ms if ms > 0 else 0.0
    rec_model = 1000.0 * rec_tokens / rec_ms if rec_ms > 0 else 0.0
    return {
        "steps": steps,
        "request_steps": request_steps,
        "estimated_goodput_tok_s": round(est, 3),
        "recorded_goodput_model_tok_s": round(rec_model, 3),
        "recorded_goodput_measured_tok_s": round(1000.0 * rec_tokens / measured_ms, 3) if measured_ms > 0 else 0.0,
        "vs_recorded": round(est / rec_model, 4) if rec_model > 0 else None,
        "estimated_tokens": round(float(tokens), 3),
        "recorded_tokens": int(rec_tokens),
        "exact_fraction": round(exact / request_steps, 4) if request_steps else None,
        "spec_fraction": round(speculating / request_steps, 4) if request_steps else None,
    }


def replay_file(path: str | Path, policy, config: ServerConfig | None = None, delay_steps: int = 2,
                keep_details: bool = False) -> tuple[dict[str, Any], Replayer]:
    """Replay a recording with ``policy`` (a Policy object); returns (result, replayer)."""
    replayer = Replayer(policy, config, delay_steps, keep_details)
    replayer.feed(read_recording(path))
    result = replayer.result()
    result["recording"] = str(path)
    return result, replayer


def run_replay(path: str, policy_name: str, config_path: str | None = None, delay_steps: int = 2,
               json_out: str | None = None) -> int:
    """CLI entry: replay, print a table, optionally write JSON."""
    import json

    from rich.console import Console
    from rich.table import Table

    from controller.config import load_config
    from policies.presets import load_preset

    policy = load_preset(policy_name)
    config = load_config(config_path) if config_path else None
    result, _ = replay_file(path, policy, config, delay_steps)
    table = Table(title=f"replay of {path} under '{policy_name}'")
    for col in ("worker", "steps", "estimated tok/s", "recorded tok/s (model)", "recorded tok/s (measured)",
                "vs recorded", "exact", "spec"):
        table.add_column(col, justify="left" if col == "worker" else "right")

    def row(name: str, r: dict) -> list[str]:
        return [name, str(r["steps"]), f"{r['estimated_goodput_tok_s']:,.1f}", f"{r['recorded_goodput_model_tok_s']:,.1f}",
                f"{r['recorded_goodput_measured_tok_s']:,.1f}",
                f"{r['vs_recorded']:.3f}" if r["vs_recorded"] is not None else "-",
                f"{r['exact_fraction']:.1%}" if r["exact_fraction"] is not None else "-",
                f"{r['spec_fraction']:.1%}" if r["spec_fraction"] is not None else "-"]

    for wid, r in result["workers"].items():
        table.add_row(*row(wid, r))
    table.add_row(*row("all", result), style="bold")
    console = Console()
    console.print(table)
    if json_out:
        Path(json_out).write_text(json.dumps(result, indent=1) + "\n")
        console.print(f"wrote {json_out}")
    return 0
