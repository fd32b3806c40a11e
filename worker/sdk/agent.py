"""``SpeculationAgent``: the SDK an existing engine embeds.

The engine's step loop calls two methods, neither of which touches the
network:

- ``decide(request_id, context_len, batch_size, request_class="") -> Decision``
  — a lookup in the last plan received (per-request override first, then the
  table of the request's class, and for the default class the table of the
  request's state when the plan has one), a few microseconds, thread-safe:
  plans are immutable and swapped by reference. A class the plan does not
  name is its default class, counted in ``AgentStats.unknown_class``.
- ``acceptance_rule(request_class) -> AcceptanceRule`` — the rule the plan
  lets the engine verify that class's drafts with: ``strict`` unless the
  plan's class says ``typical`` (then with its epsilon and delta).
- ``observe(step)`` / ``finish(summary)`` — append to a bounded queue; when
  it is full the oldest step is dropped and counted, the engine never waits.

Request states (issue #28, :mod:`policies.outcome`): while the plan in force
has state tables (``Plan.state_tables``, ``Plan.later_state_tables``),
``observe`` also keeps each request's state (after a miss, after a full
accept, resting after a miss for up to 8 plain steps; any other plain step
resets it) in a bounded dict that ``finish`` empties, and ``decide`` picks the
state's table: one more dict lookup (a default-state request reads the
plan's ``REQUEST_STATE_OTHER`` table, compiled in as its default table, so
no lookup more). The engine changes nothing for it. The decision path (plan,
overrides, states) is :class:`LocalDecisions`, which the policy benchmark's
simulated workers run too.

A background task holds the Connect stream: it sends Hello, batches queued
telemetry into ``StepReports``, validates every Plan and RequestDecisions it
receives and answers each with an Ack or a Nack (a refused plan leaves the
previous one in force), and reconnects with exponential backoff and full
jitter. Before any plan arrives the agent decides on the fallback decision
(each such call counted in ``AgentStats.fallback_decisions``); once it has a
plan it decides on the last plan it applied, also while cut off from every
controller.

Several controller replicas (``target`` a list, ``"a:1,b:1"``, or one name
that resolves to several addresses; :mod:`worker.sdk.placement`): the agent
talks to the first live replica in the rendezvous order of its worker id.
When that replica fails (the connection is refused or times out, the stream
breaks, or nothing comes back for ``response_deadline_s`` after steps were
sent) it moves to the next one at once, says in its Hello which plan version
it runs (the new replica plans from the next version up) and re-sends there
the steps the failed replica never confirmed with a ``TelemetryReceipt``. It
moves back to a better-ranked replica only after that one has answered health
probes for ``return_after_s``, first waiting briefly for the receipts of what
it sent. Each move is in ``AgentStats.moves``.

Nothing is lost without being counted: steps the queue dropped, and steps
written to a stream that broke before a ``TelemetryReceipt`` covered them and
not re-sent to another replica, are in ``AgentStats`` and in every Hello the
agent sends (``Hello.telemetry_loss``). When idle it sends an empty
``StepReports`` as a heartbeat so the controller does not take it for gone.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Mapping, NamedTuple, Sequence

import grpc

from policies.outcome import (AFTER_HIT, AFTER_MISS, DEFAULT, OTHER, REST_STEPS, RESTING, STATE_BITS, STATE_MASK,
                              TABLE_STATES, TRACKED_STATES, pack_state)
from policies.table import Decision, DecisionTable
from protos.speculation.v1 import controller_pb2_grpc, plan_pb2, worker_pb2
from worker.sdk.placement import HEALTH_CHECK, Endpoint, Placement, Targets, health_request, health_serving
from worker.sdk.telemetry import RequestSummary, StepTelemetry

log = logging.getLogger("specctl.agent")
# A config problem, not a blip (another replica has the same config): the agent stays and backs off.
_REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT)
_SESSION_OVER = object()  # outbox sentinel: the request generator of an ended call returns
_SERVICE = "speculation.v1.SpeculationController"


class ReplicaSilent(Exception):
    """The replica sent nothing for ``response_deadline_s`` after steps were written to it."""


@dataclass
class Move:
    """The agent changed replicas.

    Attributes
    ----------
    source, target : str
        Addresses it left and went to.
    reason : str
        ``"failover"`` (the source failed) or ``"rebalance"`` (back to a better-ranked replica).
    left_at : float
        Wall time (``time.time()``) the session on ``source`` ended.
    connected_at : float
        Wall time the stream to ``target`` was up (0 until then).
    first_plan_at : float
        Wall time the agent applied (and ACKed) its first plan from ``target`` (0 until then).
    confirmed_through : int
        The last step id a receipt from ``source`` covered (0: none on that stream).
    resent : int
        Steps ``source`` never confirmed that were re-sent to ``target``.
    """

    source: str
    target: str
    reason: str
    left_at: float
    connected_at: float = 0.0
    first_plan_at: float = 0.0
    confirmed_through: int = 0
    resent: int = 0


@dataclass
class AgentStats:
    connected: bool = False
    plan_version: int = 0
    plans_applied: int = 0
    decisions_applied: int = 0
    nacks_sent: int = 0
    dropped_steps: int = 0  # dropped since the last StepReports (reported in its dropped_steps)
    steps_sent: int = 0
    # Telemetry loss since start (Hello.telemetry_loss): queue drops, and steps
    # written to a stream that broke before a receipt covered them.
    steps_dropped_total: int = 0
    steps_unconfirmed: int = 0
    finished_dropped: int = 0
    steps_confirmed: int = 0
    receipts: int = 0
    superseded: int = 0  # streams the controller ended because another took this worker id
    heartbeats: int = 0
    reconnects: int = 0
    rejections: int = 0
    last_rejection: str = ""
    last_error: str = ""
    # decide() calls naming a class the plan in force does not list (served as its
    # default class; a plan without classes lists none and counts nothing), and the last
    # such name. Counted without a lock: under heavy threading a few may go uncounted.
    unknown_class: int = 0
    last_unknown_class: str = ""
    # decide() calls answered by the fallback decision: before the first plan only (the
    # agent never goes back to it). Counted without a lock, like unknown_class.
    fallback_decisions: int = 0
    # decide() calls answered by a per-request override, by the reason the controller
    # gave for it ("explore", "price-probe", ...; "" where it gave none), and of those
    # the ones that ask for a draft (a drafter may find none to offer). Counted
    # without a lock, like unknown_class.
    override_decisions: Counter = field(default_factory=Counter)
    override_draft_asks: Counter = field(default_factory=Counter)
    # Replicas: the address of the stream (or the last one), moves, steps re-sent to a new replica.
    replica: str = ""
    failovers: int = 0
    rebalances: int = 0
    steps_resent: int = 0
    probes: int = 0  # health probes of better-ranked replicas
    moves: deque = field(default_factory=lambda: deque(maxlen=32))  # the last 32 Move records


@dataclass
class AgentOptions:
    fallback: Decision = field(default_factory=lambda: Decision.off())
    queue_size: int = 4096  # steps kept while the controller is slow or away
    flush_interval_s: float = 0.1  # telemetry batching period (plans move on seconds, not steps)
    max_steps_per_message: int = 64
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 5.0
    # An empty StepReports after this long with nothing to send: the controller
    # takes a worker silent for worker_idle_ttl_s (default 120 s) for gone.
    heartbeat_interval_s: float = 15.0
    # Several replicas (worker.sdk.placement). A dial that has not connected after
    # connect_timeout_s counts as a failure of that replica.
    connect_timeout_s: float = 2.0
    # With another replica to go to: steps written and nothing received for this long
    # means the replica is hung. The controller sends a receipt about every
    # receipt_interval_s (1 s) while it reads steps: keep this well above that. 0 = off.
    response_deadline_s: float = 4.0
    # Back to a better-ranked replica once it answered health probes this long.
    return_after_s: float = 30.0
    probe_interval_s: float = 2.0  # health probes of better-ranked replicas, while there are any
    probe_timeout_s: float = 1.0
    resolve_interval_s: float = 30.0  # re-resolve names this often while healthy (at most once a second on failure)
    handover_wait_s: float = 2.0  # moving back: how long to wait for receipts of what was sent
    # Called on the agent's loop with each Plan it applied (after its ACK was queued).
    on_plan: Callable[[plan_pb2.Plan], None] | None = None


class AcceptanceRule(NamedTuple):
    """How the engine may verify one class's drafts: ``rule`` is ``"strict"``
    (lossless; ``epsilon`` and ``delta`` 0) or ``"typical"`` (accept a drafted
    token x when p(x) > min(epsilon, delta · exp(−H)), H the target's entropy)."""

    rule: str
    epsilon: float = 0.0
    delta: float = 0.0


STRICT = AcceptanceRule("strict")
_RULE_NAMES = {plan_pb2.ACCEPTANCE_RULE_UNSPECIFIED: "strict", plan_pb2.ACCEPTANCE_RULE_STRICT: "strict",
               plan_pb2.ACCEPTANCE_RULE_TYPICAL: "typical"}
_RULE_VALUES = {"strict": plan_pb2.ACCEPTANCE_RULE_STRICT, "typical": plan_pb2.ACCEPTANCE_RULE_TYPICAL}


@dataclass(frozen=True, slots=True)
class CompiledPlan:
    """A plan as ``decide`` reads it: immutable, swapped by reference.

    ``tables`` / ``rules``: per class name (empty for a plan without
    classes); ``default_table`` / ``default_rule``: the default class's (the
    plan table and strict without classes). ``state_tables``: per request
    state (``policies.outcome``), the default class's table for requests in
    that state (empty: none).
    """

    table: DecisionTable
    default_table: DecisionTable
    tables: Mapping[str, DecisionTable] = field(default_factory=dict)
    rules: Mapping[str, AcceptanceRule] = field(default_factory=dict)
    default_class: str = ""
    default_rule: AcceptanceRule = STRICT
    fallback: bool = False  # the agent's fallback, not a plan from a controller
    state_tables: Mapping[int, DecisionTable] = field(default_factory=dict)

    @classmethod
    def single(cls, table: DecisionTable) -> "CompiledPlan":
        return cls(table, table)

    def clamped(self, max_depth: int, max_width: int, max_nodes: int) -> "CompiledPlan":
        """Every table cut to a drafter's limits (a roll-out until the next plan)."""
        cut: dict[int, DecisionTable] = {}

        def clamp(t: DecisionTable) -> DecisionTable:
            if id(t) not in cut:  # tables shared between classes stay shared
                cut[id(t)] = t.clamped(max_depth, max_width, max_nodes)
            return cut[id(t)]

        tables = {name: clamp(t) for name, t in self.tables.items()}
        states = {state: clamp(t) for state, t in self.state_tables.items()}
        return CompiledPlan(clamp(self.table), clamp(self.default_table), tables, self.rules, self.default_class,
                            self.default_rule, self.fallback, states)


# Requests whose state the agent keeps at most (an engine that never calls finish() must not
# grow it without bound): past it the oldest half is forgotten (back to the default state).
MAX_TRACKED_REQUESTS = 65_536


# Packed states (policies.outcome.pack_state) of a rest: its first step, one step more, and the
# last step a rest may run (a resting request at it goes back to the default state).
_FIRST_REST = pack_state(RESTING, 1)
_ONE_REST = 1 << STATE_BITS
_LAST_REST = pack_state(RESTING, REST_STEPS)


class OutcomeTracker:
    """Each request's state (:mod:`policies.outcome`) from the steps the engine reports.

    Only requests in a tracked state are held (the default state is the
    absence of an entry), so a request that drafts part-way or plainly costs
    nothing to keep; ``forget`` drops a finished request. ``codes`` holds
    each one's state packed in one int as the controller keeps it
    (:func:`policies.outcome.pack_state`: the state in the low bits, a
    resting request's rest count above them); ``decide`` reads the state as
    ``code & STATE_MASK``. Bounded by ``max_requests``: past it the entries
    that have been held longest go first (those of requests that left
    without a ``finish``).

    >>> from worker.sdk.telemetry import RequestTelemetry as R, StepTelemetry as S
    >>> t = OutcomeTracker()
    >>> t.observe(S(1, 0.0, 3, 1.0, 1.0, [R("a", 10, depth=4), R("b", 10, depth=4, accepted=4), R("c", 10)]))
    >>> t.state("a"), t.state("b"), t.state("c")
    (1, 2, 0)
    >>> t.observe(S(2, 0.0, 2, 0.0, 1.0, [R("a", 11), R("b", 15)]))  # plain steps: a rests, b is back to default
    >>> t.state("a"), t.rest("a"), t.state("b")
    (3, 1, 0)
    """

    __slots__ = ("codes", "max_requests")

    def __init__(self, max_requests: int = MAX_TRACKED_REQUESTS) -> None:
        self.codes: dict[str, int] = {}
        self.max_requests = max_requests

    def observe(self, step: StepTelemetry) -> None:
        codes = self.codes
        for r in step.requests:
            # policies.outcome.next_state on packed states, inline: this runs for every request of every step.
            rid, depth = r.request_id, r.depth
            if depth > 0:
                accepted = r.accepted
                code = AFTER_MISS if accepted <= 0 else AFTER_HIT if accepted >= depth else DEFAULT
            else:  # plain: a miss starts a rest, a rest runs REST_STEPS steps, anything else is the default
                previous = codes.get(rid, DEFAULT) if codes else DEFAULT
                if previous == AFTER_MISS:
                    code = _FIRST_REST
                elif _FIRST_REST <= previous < _LAST_REST:  # resting (the only codes past the states)
                    code = previous + _ONE_REST
                else:
                    code = DEFAULT
            if code:
                codes[rid] = code
            elif codes:
                codes.pop(rid, None)
        if len(codes) > self.max_requests:
            for rid in list(codes)[: len(codes) - self.max_requests // 2]:
                del codes[rid]

    def state(self, request_id: str) -> int:
        return self.codes.get(request_id, DEFAULT) & STATE_MASK

    def rest(self, request_id: str) -> int:
        """Plain steps a resting request has run since its miss (0: not resting)."""
        return self.codes.get(request_id, DEFAULT) >> STATE_BITS

    def forget(self, request_id: str) -> None:
        self.codes.pop(request_id, None)

    def clear(self) -> None:
        self.codes.clear()


class LocalDecisions:
    """What ``decide`` reads, and ``decide`` itself: the plan in force, the
    per-request overrides and each request's state.

    :class:`SpeculationAgent` decides through one of these, and so do the
    policy benchmark's simulated workers (``bench.policies.WorkerLink``), so
    the simulator exercises this very lookup. ``plan`` and ``overrides`` are
    replaced whole, never mutated (``decide`` may run on another thread).
    Counters go to ``stats`` (``fallback_decisions``, ``unknown_class``,
    ``last_unknown_class``, ``override_decisions``, ``override_draft_asks``).
    """

    __slots__ = ("plan", "overrides", "reasons", "outcomes", "codes", "stats")

    def __init__(self, plan: CompiledPlan, stats: "AgentStats") -> None:
        self.plan = plan
        self.overrides: dict[str, Decision] = {}
        self.reasons: dict[str, str] = {}  # request id -> why the controller overrode it
        self.outcomes = OutcomeTracker()
        self.codes = self.outcomes.codes  # the tracker's dict itself (cleared, never replaced): one lookup less
        self.stats = stats

    def decide(self, request_id: str, context_len: int, batch_size: int, request_class: str = "") -> Decision:
        """The request's decision: its override, else its class's table at
        (``batch_size``, ``context_len``); for the default class (also an
        empty or unknown ``request_class``, the unknown counted) the table of
        the request's state when the plan has one."""
        override = self.overrides.get(request_id)
        if override is not None:
            reason = self.reasons.get(request_id, "")
            self.stats.override_decisions[reason] += 1
            if override.depth:
                self.stats.override_draft_asks[reason] += 1
            return override
        plan = self.plan  # read once: a plan arriving meanwhile is swapped whole
        if plan.fallback:
            self.stats.fallback_decisions += 1
        table = plan.default_table
        if request_class and plan.tables:
            named = plan.tables.get(request_class)
            if named is None:
                stats = self.stats
                stats.unknown_class += 1
                stats.last_unknown_class = request_class
            elif request_class != plan.default_class:
                return named.lookup(batch_size, context_len)  # state tables refine the default class only
        state_tables = plan.state_tables
        if state_tables:
            code = self.codes.get(request_id)
            if code is not None:
                table = state_tables.get(code & STATE_MASK, table)
        return table.lookup(batch_size, context_len)

    def install(self, plan: CompiledPlan) -> None:
        """Decide from ``plan`` from now on. A plan without state tables stops the tracking."""
        self.plan = plan
        if not plan.state_tables:
            self.outcomes.clear()

    def observe(self, step: StepTelemetry) -> None:
        """Each request's outcome in ``step``, kept while the plan has state tables."""
        if self.plan.state_tables:
            self.outcomes.observe(step)

    def apply_decisions(self, msg: plan_pb2.RequestDecisions, drafter: worker_pb2.Drafter) -> None:
        """Apply a RequestDecisions: its overrides win over the table from now
        on, the ids it clears go back to it. Raises ``ValueError`` (nothing
        applied) for a decision past ``drafter``'s limits."""
        d = drafter
        overrides, reasons = dict(self.overrides), dict(self.reasons)
        for i, rd in enumerate(msg.decisions):
            cell = rd.decision
            if cell.depth > d.max_depth or cell.width > d.max_width or cell.max_nodes > d.max_tree_nodes:
                raise ValueError(f"decisions[{i}] for {rd.request_id!r} exceeds the drafter's limits")
            overrides[rd.request_id] = Decision(cell.depth, cell.width, cell.max_nodes)
            reasons[rd.request_id] = rd.reason
        for rid in msg.cleared:
            overrides.pop(rid, None)
            reasons.pop(rid, None)
        self.reasons = reasons  # before the overrides: decide() reads an override's reason after it
        self.overrides = overrides

    def clear_overrides(self) -> None:
        self.overrides = {}
        self.reasons = {}

    def forget(self, request_id: str) -> None:
        """The request left: its override and its state go."""
        self.outcomes.forget(request_id)
        if request_id in self.overrides:
            overrides = dict(self.overrides)
            overrides.pop(request_id, None)
            self.overrides = overrides
            reasons = dict(self.reasons)
            reasons.pop(request_id, None)
            self.reasons = reasons


def step_to_proto(step: StepTelemetry) -> worker_pb2.StepReport:
    report = worker_pb2.StepReport(
        step_id=step.step_id,
        timestamp=step.timestamp,
        batch_size=step.batch_size,
        draft_ms=step.draft_ms,
        verify_ms=step.verify_ms,
        catch_up_ms=step.catch_up_ms,
    )
    for r in step.requests:
        ranks, cands = (r.accepted_rank, r.level_candidates) if r.width != 1 or r.accepted_rank else ((), ())
        report.requests.add(
            request_id=r.request_id,
            context_len=r.context_len,
            depth=r.depth,
            width=r.width,
            nodes=r.nodes,
            accepted=r.accepted,
            accepted_rank=ranks,
            level_candidates=cands,
            draft_confidence=r.draft_confidence,
            domain=r.domain,
            requested_depth=r.requested_depth,
            requested_width=r.requested_width,
            requested_nodes=r.requested_nodes,
            caught_up_tokens=r.caught_up_tokens,
            request_class=r.request_class,
            acceptance_rule=_RULE_VALUES[r.acceptance_rule] if r.acceptance_rule else 0,
        )
        if r.shadows:
            report.requests[-1].shadows.extend(worker_pb2.ShadowDraft(
                context_len=s.context_len, requested_depth=s.requested_depth, depth=s.depth, accepted=s.accepted)
                for s in r.shadows)
    return report


def compile_plan(plan: plan_pb2.Plan, hello: worker_pb2.Hello, current_version: int) -> DecisionTable:
    """Turn a Plan into a lookup table or raise ValueError naming the problem."""
    if plan.version <= current_version:
        raise ValueError(f"version {plan.version} is not newer than the plan in force ({current_version})")
    return DecisionTable(tuple(plan.batch_size_edges), tuple(plan.context_len_edges),
                         _decisions(plan.table, hello, "table"))


def _decisions(cells, hello: worker_pb2.Hello, path: str) -> tuple[Decision, ...]:
    d = hello.drafter
    decisions = []
    for i, cell in enumerate(cells):
        if cell.depth > d.max_depth or cell.width > d.max_width or cell.max_nodes > d.max_tree_nodes:
            raise ValueError(
                f"{path}[{i}] = (depth {cell.depth}, width {cell.width}, max_nodes {cell.max_nodes}) exceeds the "
                f"drafter's limits ({d.max_depth}, {d.max_width}, {d.max_tree_nodes})"
            )
        try:
            decisions.append(Decision(cell.depth, cell.width, cell.max_nodes))
        except ValueError as err:
            raise ValueError(f"{path}[{i}]: {err}") from None
    return tuple(decisions)


def compile_states(plan: plan_pb2.Plan, hello: worker_pb2.Hello, table: DecisionTable) -> dict[int, DecisionTable]:
    """``plan.state_tables`` and ``plan.later_state_tables`` over the edges of its
    compiled ``table``, or ValueError naming the field: each entry names a tracked
    state (AFTER_MISS, AFTER_HIT, RESTING) once across both fields, and its table
    is checked like the plan table (length, drafter limits). An entry of
    ``later_state_tables`` whose state this worker does not know is skipped (its
    requests stay on ``table``, as on a worker that predates the state); in
    ``state_tables`` it is refused."""
    out: dict[int, DecisionTable] = {}
    cells = len(table.batch_edges) * len(table.context_edges)
    entries = [(f"state_tables[{i}]", sp, False) for i, sp in enumerate(plan.state_tables)]
    entries += [(f"later_state_tables[{i}]", sp, True) for i, sp in enumerate(plan.later_state_tables)]
    for path, sp, later in entries:
        if sp.state not in TABLE_STATES:
            if later and sp.state != DEFAULT:
                continue  # a state added after this worker: its requests are decided by `table`
            known = ", ".join(plan_pb2.RequestState.Name(s) for s in TABLE_STATES)
            what = ("the default state, whose table is Plan.table" if sp.state == DEFAULT
                    else "not a RequestState this worker knows")
            raise ValueError(f"{path}.state = {sp.state} is {what} (expected one of {known})")
        name = plan_pb2.RequestState.Name(sp.state)
        if sp.state in out:
            raise ValueError(f"{path}.state = {name} appears twice")
        if len(sp.table) != cells:
            raise ValueError(f"{path} ({name}).table has {len(sp.table)} decisions, expected "
                             f"{len(table.batch_edges)} batch buckets x {len(table.context_edges)} context buckets "
                             f"= {cells}")
        out[sp.state] = DecisionTable(table.batch_edges, table.context_edges,
                                      _decisions(sp.table, hello, f"{path}.table"))
    return out


def compile_classes(plan: plan_pb2.Plan, hello: worker_pb2.Hello, table: DecisionTable) -> CompiledPlan:
    """``plan``'s class and state sections over its compiled ``table`` (:func:`compile_plan`),
    or ValueError naming the problem: every class table is checked like the
    plan table (length, drafter limits), ``default_class`` must name a class,
    a typical class needs epsilon and delta in (0, 1]; state tables as
    :func:`compile_states` checks them."""
    states = compile_states(plan, hello, table)
    if OTHER in states:
        # A tracked state without an entry is decided by Plan.table (the proto's rule, and what the
        # policy priced), not by the OTHER table that becomes the default one below.
        for state in TRACKED_STATES:
            states.setdefault(state, table)
    if not plan.classes:
        if plan.default_class:
            raise ValueError(f"default_class = {plan.default_class!r} but the plan lists no classes")
        return CompiledPlan(table, states.get(OTHER, table), state_tables=states) if states else CompiledPlan.single(table)
    cells = len(table.batch_edges) * len(table.context_edges)
    tables: dict[str, DecisionTable] = {}
    rules: dict[str, AcceptanceRule] = {}
    for i, c in enumerate(plan.classes):
        path = f"classes[{i}]"
        if not c.name:
            raise ValueError(f"{path}.name must be a non-empty string")
        if c.name in tables:
            raise ValueError(f"{path}.name = {c.name!r} appears twice")
        if c.table and len(c.table) != cells:
            raise ValueError(f"{path} ({c.name!r}).table has {len(c.table)} decisions, expected 0 (the plan table) "
                             f"or {len(table.batch_edges)} batch buckets x {len(table.context_edges)} context "
                             f"buckets = {cells}")
        tables[c.name] = (DecisionTable(table.batch_edges, table.context_edges,
                                        _decisions(c.table, hello, f"{path}.table")) if c.table else table)
        rule = _RULE_NAMES.get(c.acceptance_rule)
        if rule is None:
            raise ValueError(f"{path} ({c.name!r}).acceptance_rule = {c.acceptance_rule} is not a known "
                             "AcceptanceRule")
        if rule == "typical":
            for name in ("typical_epsilon", "typical_delta"):
                value = getattr(c, name)
                if not 0.0 < value <= 1.0:  # NaN fails too
                    raise ValueError(f"{path} ({c.name!r}).{name} = {value} must be in (0, 1] for typical "
                                     "acceptance")
            rules[c.name] = AcceptanceRule("typical", c.typical_epsilon, c.typical_delta)
        else:
            rules[c.name] = STRICT
    if plan.default_class not in tables:
        raise ValueError(f"default_class = {plan.default_class!r} is not one of the plan's classes {list(tables)}")
    default = plan.default_class
    return CompiledPlan(table, states.get(OTHER, tables[default]), tables, rules, default, rules[default],
                        state_tables=states)


class SpeculationAgent:
    """Local decisions + background telemetry/control stream for one worker.

    Parameters
    ----------
    hello : worker_pb2.Hello
        What the worker is (its ``worker_id`` also places it among replicas).
    target : str, sequence of str or Targets
        The controller: ``"host:port"``; several replicas as a list or
        comma-separated (``"ctl-a:50051,ctl-b:50051"``); or one name that
        resolves to several addresses (``"dns:///ctl.prod:50051"``). A
        :class:`~worker.sdk.placement.Targets` brings its own resolver. See
        :mod:`worker.sdk.placement`.
    options : AgentOptions, optional
        Queue sizes, timings, the fallback decision.
    channel_credentials : grpc.ChannelCredentials, optional
        TLS (``grpc.ssl_channel_credentials``, with a client certificate for
        mutual TLS). A replica dialled by an IP resolved from a name is
        checked against that name.
    token : str, optional
        This worker's bearer token when the controller has auth on.
    """

    def __init__(self, hello: worker_pb2.Hello, target: str | Sequence[str] | Targets,
                 options: AgentOptions | None = None, channel_credentials: grpc.ChannelCredentials | None = None,
                 token: str | None = None) -> None:
        self.hello = hello
        self.options = options or AgentOptions()
        opts = self.options
        targets = target if isinstance(target, Targets) else Targets(target)
        self.placement = Placement(targets, hello.worker_id, backoff_initial_s=opts.backoff_initial_s,
                                   backoff_max_s=opts.backoff_max_s, return_after_s=opts.return_after_s)
        self.target = self.placement.preferred().address  # the replica in use, or the next one to dial
        self.credentials = channel_credentials
        self._call_metadata = (("authorization", f"Bearer {token}"),) if token else None
        fallback = DecisionTable.uniform(opts.fallback, (1,), (0,))
        self.stats = AgentStats()
        # The plan in force, the per-request overrides and each request's state: what decide() reads.
        self._local = LocalDecisions(CompiledPlan(fallback, fallback, fallback=True), self.stats)
        self._steps: deque[StepTelemetry] = deque()
        self._finished: deque[RequestSummary] = deque()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._outbox: asyncio.Queue | None = None  # the live session's, while connected
        # Step ids written on the live stream that no receipt has covered yet. A controller
        # sends one about every second, so this holds about a second of steps; bounded for one
        # that sends none (older than receipts), where a break then counts the newest it holds.
        self._unconfirmed: deque[int] = deque(maxlen=4 * self.options.queue_size)
        # The newest of those steps themselves (at most queue_size): what a failover re-sends to
        # the next replica. Always a suffix of _unconfirmed (same appends, same receipts).
        self._resendable: deque[worker_pb2.StepReport] = deque(maxlen=self.options.queue_size)
        self._carry: list[worker_pb2.StepReport] = []  # unconfirmed steps of a failed replica, for the next one
        self._carry_from = ""  # the replica they were written to
        # Messages the live stream's request generator drained but has not handed to gRPC yet, and,
        # after a session ended, the telemetry among them: never written, so sent first next time.
        self._unsent: deque[worker_pb2.WorkerMessage] | None = None
        self._replay: list[worker_pb2.WorkerMessage] = []
        self._awaiting_since: float | None = None  # monotonic: first write since the replica last sent anything
        self._receipt_through = 0  # last step id a receipt on the live stream covered
        self._handover = False  # moving back: write no more telemetry to this stream
        self._move: Move | None = None  # the move whose first plan is awaited
        self._left: Move | None = None  # the move under way: left a replica, not yet up on another
        self._up_at: float | None = None  # monotonic: when the live stream came up
        self._resolving = False

    # ------------------------------------------------------------ hot path
    def decide(self, request_id: str, context_len: int, batch_size: int, request_class: str = "") -> Decision:
        """The request's decision: its override, else its class's table at
        (``batch_size``, ``context_len``). ``request_class`` empty or not in
        the plan: the plan's default class (an unknown name is counted). For
        the default class, the table of the request's state (its last
        outcome) when the plan has one (:meth:`LocalDecisions.decide`)."""
        return self._local.decide(request_id, context_len, batch_size, request_class)

    def acceptance_rule(self, request_class: str = "") -> AcceptanceRule:
        """The rule the engine may verify ``request_class``'s drafts with:
        ``("strict", 0, 0)`` unless the plan in force gives the class (or,
        for an empty or unknown name, its default class) typical acceptance.
        Before any plan, and for a plan without classes: strict."""
        plan = self._local.plan
        return plan.rules.get(request_class, plan.default_rule)

    def observe(self, step: StepTelemetry) -> None:
        self._local.observe(step)  # each request's last outcome, while the plan has state tables
        with self._lock:
            if len(self._steps) >= self.options.queue_size:
                self._steps.popleft()
                self.stats.dropped_steps += 1
                self.stats.steps_dropped_total += 1
            self._steps.append(step)

    def finish(self, summary: RequestSummary) -> None:
        with self._lock:
            if len(self._finished) >= self.options.queue_size:
                self._finished.popleft()
                self.stats.finished_dropped += 1
            self._finished.append(summary)
        self._local.forget(summary.request_id)

    def roll_drafter(self, drafter: worker_pb2.Drafter) -> None:
        """Switch to a new drafter (e.g. retrained heads) without a reconnect.

        The controller learns it from a new Hello on the live stream; the steps
        observed before the roll are sent ahead of that Hello so their outcomes
        are credited to the old version. Until a plan for the new drafter
        arrives, decisions are the last plan's clamped to the new limits.
        Callable from any thread.
        """
        hello = worker_pb2.Hello()
        hello.CopyFrom(self.hello)
        hello.drafter.CopyFrom(drafter)
        d = hello.drafter
        self._local.install(self._local.plan.clamped(d.max_depth, d.max_width, d.max_tree_nodes))
        self._local.clear_overrides()
        if self._loop is None or not self._loop.is_running():
            self.hello = hello
            return
        done = threading.Event()

        def on_loop() -> None:
            # Drain under the old Hello, then switch: nothing observed before the
            # roll is reported as the new version's.
            pending = self._drain() if self._outbox is not None else []
            self.hello = hello
            if self._outbox is not None:
                for msg in pending:
                    self._outbox.put_nowait(msg)
                self._outbox.put_nowait(worker_pb2.WorkerMessage(hello=self._current_hello()))
            done.set()

        self._loop.call_soon_threadsafe(on_loop)
        done.wait(5.0)

    def _current_hello(self) -> worker_pb2.Hello:
        hello = worker_pb2.Hello()
        hello.CopyFrom(self.hello)
        hello.current_plan_version = self.stats.plan_version
        loss = hello.telemetry_loss
        loss.steps_dropped = self.stats.steps_dropped_total
        loss.steps_unconfirmed = self.stats.steps_unconfirmed
        loss.finished_dropped = self.stats.finished_dropped
        return hello

    @property
    def plan_version(self) -> int:
        return self.stats.plan_version

    def queued_steps(self) -> int:
        """Steps observed and not yet written to a stream (the next flush takes them)."""
        with self._lock:
            return len(self._steps)

    def backlog(self) -> int:
        """Steps no controller has confirmed yet: queued, written and awaiting a
        receipt, or carried to the next replica. 0 once everything observed was read."""
        queued = self.queued_steps()
        replay = sum(len(m.reports.steps) for m in self._replay if m.WhichOneof("payload") == "reports")
        return queued + len(self._unconfirmed) + len(self._carry) + replay

    @property
    def table(self) -> DecisionTable:
        """The plan table (``Plan.table``; a class may have its own: :meth:`class_table`)."""
        return self._local.plan.table

    def class_table(self, request_class: str = "") -> DecisionTable:
        """The table ``decide`` reads for ``request_class`` (not counted when unknown) in the default state."""
        plan = self._local.plan
        return plan.tables.get(request_class, plan.default_table)

    def state_table(self, state: int) -> DecisionTable:
        """The default class's table for requests in ``state`` (``policies.outcome``)."""
        plan = self._local.plan
        return plan.state_tables.get(state, plan.default_table)

    def request_state(self, request_id: str) -> int:
        """The request's state as the agent tracks it (``policies.outcome``; 0 while untracked)."""
        return self._local.outcomes.state(request_id)

    @property
    def classes(self) -> tuple[str, ...]:
        """Class names of the plan in force (empty: it has none)."""
        return tuple(self._local.plan.tables)

    # -------------------------------------------------------- thread usage
    def start(self) -> "SpeculationAgent":
        """Run the stream on a background thread with its own event loop."""
        ready = threading.Event()

        def main() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            ready.set()
            self._loop.run_until_complete(self.run())
            self._loop.close()

        self._thread = threading.Thread(target=main, name=f"specctl-agent-{self.hello.worker_id}", daemon=True)
        self._thread.start()
        ready.wait()
        return self

    def close(self, timeout: float = 5.0) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout)

    # ---------------------------------------------------------- the stream
    async def run(self) -> None:
        """Hold a stream to a replica until ``stop()``.

        A replica that fails (connect refused or timed out, stream broken, silent for
        ``response_deadline_s``) is left for the next in rendezvous order at once; when
        every replica has failed the agent retries with exponential backoff and full
        jitter. Ends that are the worker's own business (superseded by a twin,
        refused credentials, expired while idle) retry the same replica.
        """
        self._stop = asyncio.Event()
        opts, placement = self.options, self.placement
        await self._resolve(0.0)
        endpoint, delay = placement.next()
        backoff = opts.backoff_initial_s
        first = True
        while not self._stop.is_set():
            if delay > 0:
                try:
                    await asyncio.wait_for(self._stop.wait(), timeout=delay)
                    break
                except asyncio.TimeoutError:
                    pass
            if not first:
                self.stats.reconnects += 1
            first = False
            self.target = endpoint.address
            self._up_at = None
            outcome, move_to = await self._attempt(endpoint)
            up_for = time.monotonic() - self._up_at if self._up_at is not None else 0.0
            self.stats.connected = False
            if self._stop.is_set():
                self._settle(endpoint, None, "")
                break
            if outcome == "failed":
                placement.failed(endpoint, up_for)
                await self._resolve(1.0)  # a replica set that changed may be why it failed
                nxt, wait = placement.next()
                # Leaving: at once, jittered so a dead replica's workers do not arrive in one burst.
                delay = wait if nxt.address == endpoint.address else random.uniform(0, opts.backoff_initial_s)
            elif outcome == "rebalance":
                nxt, delay = move_to, 0.0
            else:
                placement.lasted(endpoint, up_for)
                nxt = endpoint
                if outcome == "superseded":
                    backoff = opts.backoff_max_s
                elif up_for > 2.0:
                    backoff = opts.backoff_initial_s  # the link was healthy: start over
                # A twin holds the id: wait the longest delay, jittered in its upper half only. Full
                # jitter drew waits near zero one time in a few dozen, and took the id straight back.
                delay = random.uniform(backoff / 2 if outcome == "superseded" else 0.0, backoff)
                backoff = min(backoff * 2, opts.backoff_max_s)
            self._settle(endpoint, nxt, outcome)
            endpoint = nxt

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    async def _attempt(self, endpoint: Endpoint) -> tuple[str, Endpoint | None]:
        """One session on ``endpoint``: how it ended (``failed``, ``rebalance``,
        ``superseded``, ``refused``, ``expired``, ``stopped``) and, for a
        rebalance, the replica to move to."""
        try:
            move_to = await self._session(endpoint)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - any failure means: reconnect, here or elsewhere
            self.stats.last_error = f"{type(err).__name__}: {err}"
            code = err.code() if isinstance(err, grpc.aio.AioRpcError) else None
            if code == grpc.StatusCode.ABORTED:
                # Another stream took this worker id (a twin with the same id, or our own
                # restart's leftover): come back slowly, or the two take the id in turns.
                self.stats.superseded += 1
                log.warning("controller %s ended worker %r's stream: %s", endpoint.address, self.hello.worker_id,
                            err.details())
                return "superseded", None
            if code in _REFUSED:
                log.warning("controller %s refused worker %r: %s %s", endpoint.address, self.hello.worker_id,
                            code.name, err.details())
                return "refused", None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED and self._up_at is not None:
                return "expired", None  # the controller's idle TTL: it is alive, come back to it
            log.debug("replica %s failed for worker %r: %s", endpoint.address, self.hello.worker_id,
                      self.stats.last_error)
            return "failed", None
        if move_to is not None:
            return "rebalance", move_to
        if self._stop.is_set():
            return "stopped", None
        self.stats.last_error = f"{endpoint.address} ended the stream"
        return "failed", None  # ended without a status: serve elsewhere if there is an elsewhere

    def _settle(self, endpoint: Endpoint, nxt: Endpoint | None, outcome: str) -> None:
        """The stream to ``endpoint`` ended and ``nxt`` is dialled next: what
        becomes of the steps it never confirmed. Going to another replica they
        are carried there (the newest ``queue_size`` of them); staying (one
        replica, or every other one down) they are counted as possibly lost,
        since the same replica may have read them and would count them twice."""
        moving = nxt is not None and nxt.address != endpoint.address
        unconfirmed = len(self._unconfirmed)
        if moving and unconfirmed:
            carry = list(self._resendable)
            self.stats.steps_unconfirmed += unconfirmed - len(carry)
            self._carry, self._carry_from = carry, endpoint.address
        else:
            self.stats.steps_unconfirmed += unconfirmed
        self._unconfirmed.clear()
        self._resendable.clear()
        if moving and self._left is None:
            # Kept until a stream is up elsewhere: a dial that fails on the way does not start another move.
            self._left = Move(endpoint.address, "", "rebalance" if outcome == "rebalance" else "failover",
                              time.time(), confirmed_through=self._receipt_through)
            log.info("worker %r leaves replica %s (%s, %s)", self.hello.worker_id, endpoint.address,
                     self._left.reason, self.stats.last_error if outcome == "failed" else "better-ranked replica up")

    def _arrived(self, endpoint: Endpoint, outbox: asyncio.Queue) -> None:
        """The stream to ``endpoint`` is up: record a move, queue the carried steps first."""
        self.stats.replica = endpoint.address
        left, self._left = self._left, None
        if left is not None and left.source != endpoint.address:
            left.target = endpoint.address
            left.connected_at = time.time()
            self.stats.moves.append(left)
            if left.reason == "failover":
                self.stats.failovers += 1
            else:
                self.stats.rebalances += 1
            self._move = left
        if self._carry:
            carry, self._carry = self._carry, []
            if self._carry_from == endpoint.address:
                self.stats.steps_unconfirmed += len(carry)  # back where they may have been read: not twice
            else:
                size = self.options.max_steps_per_message
                for i in range(0, len(carry), size):
                    outbox.put_nowait(worker_pb2.WorkerMessage(
                        reports=worker_pb2.StepReports(steps=carry[i:i + size])))
                self.stats.steps_resent += len(carry)
                if self._move is not None:
                    self._move.resent += len(carry)
        # Drained after the carried steps were written: newer step ids, so they follow them.
        for msg in self._replay:
            outbox.put_nowait(msg)
        self._replay = []

    def _channel(self, endpoint: Endpoint) -> grpc.aio.Channel:
        options = []
        if endpoint.authority and self.credentials is not None:
            # Dialled by an IP resolved from a name: the certificate is the name's.
            options = [("grpc.ssl_target_name_override", endpoint.authority),
                       ("grpc.default_authority", endpoint.authority)]
        if self.credentials is not None:
            return grpc.aio.secure_channel(endpoint.address, self.credentials, options=options)
        return grpc.aio.insecure_channel(endpoint.address, options=options)

    async def _session(self, endpoint: Endpoint) -> Endpoint | None:
        """One stream to ``endpoint``; returns the replica to move back to when a better-ranked one is ready."""
        opts = self.options
        several = len(self.placement.order) > 1 or self.placement.targets.has_names
        move_to = None
        async with self._channel(endpoint) as channel:
            stub = controller_pb2_grpc.SpeculationControllerStub(channel)
            outbox: asyncio.Queue = asyncio.Queue()
            self._outbox = outbox
            self._awaiting_since, self._receipt_through, self._handover = None, 0, False
            stream_up = asyncio.Event()
            call = stub.Connect(self._outbound(outbox, stream_up), metadata=self._call_metadata)
            tasks: list[asyncio.Task] = []
            try:
                # Telemetry stays queued until the stream is really up: steps
                # drained into a call that never connects would be lost.
                await asyncio.wait_for(call.wait_for_connection(), opts.connect_timeout_s)
                self._up_at = time.monotonic()
                self._arrived(endpoint, outbox)
                stream_up.set()
                self.stats.connected = True
                read_task = asyncio.create_task(self._inbound(call, outbox))
                tasks = [asyncio.create_task(self._stop.wait()), read_task]
                placement_task = None
                if several:
                    placement_task = asyncio.create_task(self._watch_placement(endpoint))
                    tasks += [placement_task, asyncio.create_task(self._watch_silence(endpoint))]
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                if placement_task in done and not read_task.done():
                    move_to = placement_task.result()
                    await self._handover_wait(read_task)
            finally:
                for task in tasks:
                    task.cancel()
                call.cancel()
                self._outbox = None
                self._keep_unsent(outbox)
                # A call the controller ended (refused, restarted) leaves the request
                # generator waiting: the sentinel ends it without draining telemetry.
                outbox.put_nowait(_SESSION_OVER)
                stream_up.set()
            for task in tasks[1:]:  # the reader and the watchers: the first failure is the session's
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()
        return move_to

    def _keep_unsent(self, outbox: asyncio.Queue) -> None:
        """The session is over: telemetry drained but never handed to gRPC (and what
        still waits in its outbox) is replayed on the next stream. ACKs and NACKs are
        not: they name plans of this stream, which no other stream knows."""
        leftover = list(self._unsent or ())
        if self._unsent is not None:
            self._unsent.clear()  # the generator, should gRPC resume it, finds nothing more to send
        self._unsent = None
        while not outbox.empty():
            leftover.append(outbox.get_nowait())
        self._replay.extend(m for m in leftover
                            if m is not _SESSION_OVER and m.WhichOneof("payload") in ("reports", "finished"))

    async def _handover_wait(self, read_task: asyncio.Task) -> None:
        """Moving back: stop writing telemetry here and give the replica up to
        ``handover_wait_s`` to confirm what it was sent (what it does not confirm is re-sent)."""
        self._handover = True
        until = time.monotonic() + self.options.handover_wait_s
        while self._unconfirmed and not read_task.done() and time.monotonic() < until:
            await asyncio.sleep(0.02)

    async def _watch_silence(self, endpoint: Endpoint) -> None:
        """Raise :class:`ReplicaSilent` when steps were written and nothing came back for
        ``response_deadline_s`` (a hung replica keeps its connection open), while there is
        another replica to go to."""
        deadline = self.options.response_deadline_s
        if deadline <= 0:
            await asyncio.Event().wait()
        while True:
            await asyncio.sleep(min(0.25, deadline / 4))
            since = self._awaiting_since
            if since is not None and len(self.placement.order) > 1 and time.monotonic() - since > deadline:
                raise ReplicaSilent(f"{endpoint.address} sent nothing for {deadline:g} s after steps were written")

    async def _watch_placement(self, endpoint: Endpoint) -> Endpoint:
        """While on ``endpoint``: re-resolve names now and then, probe the
        replicas ranked above it, and return one once it has answered probes
        for ``return_after_s``."""
        opts = self.options
        while True:
            await asyncio.sleep(opts.probe_interval_s * random.uniform(0.8, 1.2))
            await self._resolve(opts.resolve_interval_s)
            ahead = self.placement.ahead_of(endpoint)
            if not ahead:
                continue
            serving = await asyncio.gather(*(self._probe(e) for e in ahead))
            for e, ok in zip(ahead, serving):
                self.placement.probed(e, ok)
            target = self.placement.return_target(endpoint)
            if target is not None:
                return target

    async def _probe(self, endpoint: Endpoint) -> bool:
        """The gRPC health check of ``endpoint``'s controller service: SERVING or not."""
        self.stats.probes += 1
        try:
            async with self._channel(endpoint) as channel:
                check = channel.unary_unary(HEALTH_CHECK)  # no serializers: bytes in, bytes out
                return health_serving(await check(health_request(_SERVICE), timeout=self.options.probe_timeout_s))
        except grpc.aio.AioRpcError as err:
            # A server that answers gRPC but has no health service is up as far as we can tell.
            return err.code() == grpc.StatusCode.UNIMPLEMENTED
        except Exception:  # noqa: BLE001 - whatever it is, the replica is not answering
            return False

    async def _resolve(self, max_age_s: float) -> None:
        """Re-resolve the target names when the last resolution is older than ``max_age_s``."""
        targets = self.placement.targets
        if not targets.has_names or self._resolving or time.monotonic() - targets.resolved_at < max_age_s:
            return
        self._resolving = True
        try:
            endpoints = await asyncio.get_running_loop().run_in_executor(None, targets.resolve)
        finally:
            self._resolving = False
        if self.placement.update(endpoints):
            log.info("worker %r: controller replicas now %s", self.hello.worker_id,
                     ", ".join(e.address for e in self.placement.order))

    async def _outbound(self, outbox: asyncio.Queue, stream_up: asyncio.Event):
        # `unsent` is this stream's; when the session ends _keep_unsent takes it away
        # (self._unsent changes). gRPC may still pull from this generator after that: it then
        # returns, and must not drain telemetry meant for the next stream into a dead one.
        unsent: deque[worker_pb2.WorkerMessage] = deque()
        self._unsent = unsent
        yield worker_pb2.WorkerMessage(hello=self._current_hello())
        await stream_up.wait()
        interval = self.options.flush_interval_s
        last_sent = time.monotonic()
        while self._unsent is unsent:
            try:
                queued = [await asyncio.wait_for(outbox.get(), timeout=interval)]
                while not outbox.empty():
                    queued.append(outbox.get_nowait())
            except asyncio.TimeoutError:
                queued = []
            if _SESSION_OVER in queued or self._unsent is not unsent:
                return
            drained = [] if self._handover else self._drain()
            if not queued and not drained and time.monotonic() - last_sent >= self.options.heartbeat_interval_s:
                self.stats.heartbeats += 1
                drained = [worker_pb2.WorkerMessage(reports=worker_pb2.StepReports())]
            unsent.extend(queued + drained)
            while unsent:
                # Taken off before the yield: once yielded it is gRPC's (written); what is
                # left when the session ends was never written (see _keep_unsent).
                msg = unsent.popleft()
                if msg.WhichOneof("payload") == "reports" and msg.reports.steps:
                    steps = msg.reports.steps
                    self._unconfirmed.extend(step.step_id for step in steps)
                    self._resendable.extend(steps)
                    if self._awaiting_since is None:
                        self._awaiting_since = time.monotonic()
                yield msg
            if queued or drained:
                last_sent = time.monotonic()

    def _drain(self) -> list[worker_pb2.WorkerMessage]:
        with self._lock:
            steps = list(self._steps)
            finished = list(self._finished)
            self._steps.clear()
            self._finished.clear()
            dropped, self.stats.dropped_steps = self.stats.dropped_steps, 0
        out = []
        size = self.options.max_steps_per_message
        for i in range(0, len(steps), size):
            reports = worker_pb2.StepReports(steps=[step_to_proto(s) for s in steps[i : i + size]])
            if i == 0:
                reports.dropped_steps = dropped
            out.append(worker_pb2.WorkerMessage(reports=reports))
        self.stats.steps_sent += len(steps)
        for f in finished:
            out.append(worker_pb2.WorkerMessage(finished=worker_pb2.RequestFinished(
                request_id=f.request_id, generated_tokens=f.generated_tokens, steps=f.steps,
                accepted_tokens=f.accepted_tokens, timestamp=f.timestamp)))
        return out

    async def _inbound(self, call, outbox: asyncio.Queue) -> None:
        on_plan = self.options.on_plan
        async for msg in call:
            self.stats.connected = True
            self._awaiting_since = None  # the replica is alive
            kind = msg.WhichOneof("payload")
            if kind == "plan":
                reply = self._apply_plan(msg.plan)
                outbox.put_nowait(reply)
                if on_plan is not None and reply.WhichOneof("payload") == "ack":
                    try:
                        on_plan(msg.plan)
                    except Exception:  # noqa: BLE001 - the engine's hook must not end the stream
                        log.exception("on_plan hook failed")
            elif kind == "request_decisions":
                outbox.put_nowait(self._apply_decisions(msg.request_decisions))
            elif kind == "receipt":
                self._confirm(msg.receipt.last_step_id)
            elif kind == "rejection":
                self.stats.rejections += 1
                r = msg.rejection
                self.stats.last_rejection = f"{plan_pb2.RejectReason.Name(r.reason)} {r.field}: {r.detail}"
                log.debug("controller rejected telemetry: %s", self.stats.last_rejection)

    def _confirm(self, last_step_id: int) -> None:
        """A receipt: the controller has read every step up to ``last_step_id``."""
        self.stats.receipts += 1
        self._receipt_through = max(self._receipt_through, last_step_id)
        unconfirmed = self._unconfirmed
        while unconfirmed and unconfirmed[0] <= last_step_id:
            unconfirmed.popleft()
            self.stats.steps_confirmed += 1
        resendable = self._resendable
        while resendable and resendable[0].step_id <= last_step_id:
            resendable.popleft()

    def _apply_plan(self, plan: plan_pb2.Plan) -> worker_pb2.WorkerMessage:
        try:
            compiled = compile_classes(plan, self.hello, compile_plan(plan, self.hello, self.stats.plan_version))
        except ValueError as err:
            self.stats.nacks_sent += 1
            return worker_pb2.WorkerMessage(nack=worker_pb2.Nack(version=plan.version, nonce=plan.nonce,
                                                                  reason=str(err)))
        self._local.install(compiled)
        self.stats.plan_version = plan.version
        self.stats.plans_applied += 1
        move = self._move
        if move is not None:  # the first plan from the replica it moved to
            move.first_plan_at = time.time()
            self._move = None
        return worker_pb2.WorkerMessage(ack=worker_pb2.Ack(version=plan.version, nonce=plan.nonce))

    def _apply_decisions(self, msg: plan_pb2.RequestDecisions) -> worker_pb2.WorkerMessage:
        try:
            self._local.apply_decisions(msg, self.hello.drafter)
        except ValueError as err:
            self.stats.nacks_sent += 1
            return worker_pb2.WorkerMessage(nack=worker_pb2.Nack(version=msg.version, nonce=msg.nonce,
                                                                  reason=str(err)))
        self.stats.decisions_applied += 1
        return worker_pb2.WorkerMessage(ack=worker_pb2.Ack(version=msg.version, nonce=msg.nonce))
