"""Plans out, acknowledgements in: the version + nonce protocol of
speculation.v1 (as Envoy's xDS does it) over a worker's :class:`PlanLedger`.

- A table goes out when it differs from the one in force and, for
  model-based policies, when its estimated goodput clears the hysteresis
  (both tables judged under today's estimates); never more often than
  ``min_push_interval_s``. Per-request overrides go out as their diff.
- With request classes (a policy file with ``classes:``) a plan carries one
  table per class (``Plan.classes``) and is a new plan when any of them
  changed. For a model-based policy both plans are then judged as the
  goodput policy solves (:func:`policies.goodput.class_plan_estimate`: one
  step shared by every class's requests, each class's own acceptance):
  meeting every TPOT target beats missing one; otherwise the weighted
  goodput (both meet) or the worst TPOT / target (both miss) must clear the
  hysteresis.
- An ACK of a Plan makes it the plan in force; a unary worker acknowledges
  by deciding from it. A NACK returns the controller's view to the plan in
  force, and the refused table is not sent again before the next Hello.
- A Hello behind the current plan gets it again at once, under a new version.
"""

from __future__ import annotations

import logging
import secrets
from typing import TYPE_CHECKING

from controller.core.state import PlanLedger, SentPlan, WorkerState
from controller.protocol import Invalid, R, class_plans, decision_to_proto, plan_to_proto, state_plans
from policies.base import Observation, PlanDraft
from policies.classes import ClassSet
from policies.goodput import class_plan_estimate
from policies.state_tables import plan_goodputs
from policies.table import Decision
from protos.speculation.v1 import plan_pb2, worker_pb2

if TYPE_CHECKING:
    from controller.core.controller import Controller

log = logging.getLogger("specctl.controller")


class PlanDesk:
    """Runs a controller's policy for a worker and keeps its plan ledger."""

    def __init__(self, controller: "Controller") -> None:
        self.ctl = controller

    # ---------------------------------------------------------------- out
    def run_policy(self, state: WorkerState, now: float) -> tuple[PlanDraft, Observation]:
        obs = self.ctl.observation(state, now)
        ledger = state.plans
        draft, ledger.policy_state = self.ctl.policy.decide(ledger.policy_state, obs)
        state.requests.recent_steps.clear()
        state.requests.recent_finished.clear()
        ledger.new_steps = 0
        ledger.last_decide_at = now
        return draft, obs

    def updates(self, state: WorkerState, force: bool = False) -> list[plan_pb2.Plan | plan_pb2.RequestDecisions]:
        """Run the policy when due and return what to push (maybe nothing)."""
        ctl, ledger = self.ctl, state.plans
        now = ctl.clock()
        if ledger.resend and ledger.current is not None:
            # The worker's Hello was behind: the current plan again, at once.
            ledger.resend = False
            return [self.send_table(state, ledger.current, now)]
        ledger.resend = False
        force = force or ledger.force_push
        if not self._policy_due(state, now, force):
            return []
        if ledger.current is None and ctl.first_plan_hold is not None and ctl.first_plan_hold(state):
            return []  # a replica awaiting the fleet's statistics for this drafter (bounded by the hold)
        draft, obs = self.run_policy(state, now)
        ledger.force_push = False
        push_table = self._should_push_table(state, draft, obs, force)
        # Push latency is counted from here: the policy ran and judged its table worth sending
        # (the hysteresis prices both tables under today's models, 1-5 ms for a changed one:
        # deciding, like the policy run, not pushing).
        now = ctl.clock()
        out: list = []
        if push_table:
            out.append(self.send_table(state, draft, now))
        decisions = self._override_diff(state, draft, now)
        if decisions is not None:
            out.append(decisions)
        return out

    def due(self, state: WorkerState) -> bool:
        """Whether :meth:`updates` would run the policy (or resend the plan) for
        ``state`` now: what a turn put off for a busy stream would have cost."""
        ledger = state.plans
        return (ledger.resend and ledger.current is not None) or self._policy_due(state, self.ctl.clock(),
                                                                               ledger.force_push)

    def _policy_due(self, state: WorkerState, now: float, force: bool) -> bool:
        ledger, settings = state.plans, self.ctl.config.plan
        if not (force or (ledger.new_steps > 0 and now - ledger.last_decide_at >= settings.recompute_interval_s)):
            return False
        return force or ledger.current is not None or state.steps_ingested >= settings.steps_before_first_plan

    def send_table(self, state: WorkerState, draft: PlanDraft, now: float) -> plan_pb2.Plan:
        ledger = state.plans
        classes = self.ctl.policy.classes
        ledger.plan_version += 1
        nonce = secrets.token_hex(8)
        plan = plan_to_proto(draft.table, ledger.plan_version, nonce, self.ctl.policy.name, now,
                             draft.expected_goodput_tok_s, class_plans(classes, draft), classes.default,
                             state_plans(draft))
        ledger.track(SentPlan(plan.version, nonce, draft, now, "plan", classes))
        ledger.current = draft
        ledger.current_classes = classes
        ledger.current_version = plan.version
        ledger.last_push_at = now
        state.counters.plans_pushed += 1
        return plan

    def _should_push_table(self, state: WorkerState, draft: PlanDraft, obs: Observation, force: bool) -> bool:
        ledger = state.plans
        classes = self.ctl.policy.classes
        key = plan_key(draft, classes)
        if ledger.refused_table is not None and key == ledger.refused_table:
            return False  # the worker said no to these tables; wait for different ones (or its next Hello)
        if ledger.current is None or force:
            return True
        if key == plan_key(ledger.current, ledger.current_classes):
            return False
        if obs.now - ledger.last_push_at < self.ctl.config.plan.min_push_interval_s:
            return False
        if not self.ctl.policy.model_based:
            return True
        # Both tables judged under today's estimates: the old plan's own
        # estimate was made with yesterday's. At the mean batch and at the batch
        # of the last step: when the load jumps (4 -> 8 requests) the mean lags
        # for dozens of steps, and a stale row of the old table runs meanwhile.
        batches = {max(1.0, obs.load.mean_batch_size), float(max(1, state.load.last_batch_size))}
        margin = 1.0 + self.ctl.config.plan.hysteresis
        if classes.single or ledger.current_classes != classes or obs.classes != classes:
            # With state tables in either plan, both are priced per request state (policies.state_tables).
            return any(new > old * margin for new, old in (plan_goodputs(draft, ledger.current, obs, b)
                                                           for b in batches))
        return any(class_plan_estimate(draft, obs, b).better_than(class_plan_estimate(ledger.current, obs, b), margin)
                   for b in batches)

    def _override_diff(self, state: WorkerState, draft: PlanDraft, now: float) -> plan_pb2.RequestDecisions | None:
        ledger = state.plans
        wanted = {rid: d for rid, d in draft.overrides.items() if rid in state.requests.active}
        changed = {rid: d for rid, d in wanted.items() if ledger.sent_overrides.get(rid) != d}
        cleared = [rid for rid in ledger.sent_overrides if rid not in wanted]
        if not changed and not cleared:
            return None
        ledger.plan_version += 1
        nonce = secrets.token_hex(8)
        msg = plan_pb2.RequestDecisions(
            version=ledger.plan_version,
            nonce=nonce,
            decisions=[
                plan_pb2.RequestDecision(request_id=rid, decision=decision_to_proto(d),
                                         reason=draft.reasons.get(rid, self.ctl.policy.name))
                for rid, d in changed.items()
            ],
            cleared=cleared,
        )
        ledger.track(SentPlan(msg.version, nonce, draft, now, "request_decisions"))
        ledger.sent_overrides = wanted
        state.counters.decisions_pushed += 1
        return msg

    def decide(self, state: WorkerState, request_id: str, context_len: int, batch_size: int,
               request_class: str = "", request_state: int = 0) -> Decision:
        """One request's decision from the current plan (planned now if there
        is none yet: it then goes out as version 1 like any other plan), from
        its class's table; a class the plan does not name is the default
        class, counted. ``request_state`` (``DecideQuery.request_state``)
        picks the plan's state table for the default class."""
        ledger = state.plans
        override = ledger.sent_overrides.get(request_id)
        if override is not None:
            return override
        if ledger.current is None:
            self.send_table(state, self.run_policy(state, self.ctl.clock())[0], self.ctl.clock())
        classes = ledger.current_classes
        if request_class and not classes.known(request_class):
            state.counters.unknown_class_queries += 1
        current = ledger.current
        if classes.single:
            return current.table_for_state(request_state).lookup(batch_size, context_len)
        name = classes.get(request_class).name
        if name == classes.default:
            return current.state_tables.get(request_state, current.table_for(name)).lookup(batch_size, context_len)
        return current.table_for(name).lookup(batch_size, context_len)

    # ----------------------------------------------------------------- in
    def ack(self, state: WorkerState, msg: worker_pb2.Ack) -> plan_pb2.Rejection | None:
        ledger = state.plans
        sent = ledger.pending.get(msg.version)
        if sent is None or sent.nonce != msg.nonce:
            return self.ctl.reject(state, Invalid(R.REJECT_REASON_UNKNOWN_PLAN, "ack",
                                                  f"version={msg.version} nonce={msg.nonce!r} names no plan in "
                                                  "flight"))
        del ledger.pending[msg.version]
        state.counters.acks += 1
        _applied(ledger, sent)
        ledger.plan_push_ms.append((self.ctl.clock() - sent.sent_at) * 1000.0)
        return None

    def use(self, state: WorkerState, version: int) -> None:
        """A Decide-only worker applies a plan by deciding from it (there is no
        stream to ACK on): count it as acknowledged."""
        sent = state.plans.pending.pop(version, None)
        if sent is None:
            return
        state.counters.plans_used += 1
        _applied(state.plans, sent)

    def nack(self, state: WorkerState, msg: worker_pb2.Nack) -> plan_pb2.Rejection | None:
        ledger = state.plans
        sent = ledger.pending.get(msg.version)
        if sent is None or sent.nonce != msg.nonce:  # a wrong nonce leaves the plan in flight
            return self.ctl.reject(state, Invalid(R.REJECT_REASON_UNKNOWN_PLAN, "nack",
                                                  f"version={msg.version} nonce={msg.nonce!r} names no plan in "
                                                  "flight"))
        del ledger.pending[msg.version]
        state.counters.nacks += 1
        ledger.last_nack_reason = msg.reason
        log.warning("worker %s refused plan %d: %s", state.worker_id, msg.version, msg.reason)
        if sent.kind == "plan":
            ledger.refused_table = plan_key(sent.draft, sent.classes)
            if msg.version == ledger.current_version:
                # Our view returns to what the worker runs: the last plan it acked.
                ledger.current = ledger.in_force
                ledger.current_classes = ledger.in_force_classes
                ledger.current_version = ledger.acked_version if ledger.in_force is not None else 0
        else:
            # The overrides it refused are not in force: forget them so they are offered again on change.
            for rid in list(ledger.sent_overrides):
                if sent.draft.overrides.get(rid) == ledger.sent_overrides[rid]:
                    del ledger.sent_overrides[rid]
        return None

    def hello(self, state: WorkerState, running: int) -> None:
        """The worker says it decodes on plan version ``running``."""
        ledger = state.plans
        if ledger.current is not None and running < ledger.current_version:
            # It decodes on an older plan than ours (restarted, or another stream
            # had the id): it gets ours again at once, and its overrides with it.
            ledger.resend = True
            ledger.sent_overrides = {}
        if ledger.current is not None and running > ledger.current_version:
            # It decodes on a plan another replica made (it failed over and came back):
            # ours is stale, and unless our next table differed we would never push it
            # one. Plan it afresh, as a newcomer (push_due_plans serves those first).
            ledger.current = None
            ledger.sent_overrides = {}
        if running != ledger.acked_version:  # what it runs now is what it says it runs
            known = ledger.current is not None and running == ledger.current_version
            ledger.in_force = ledger.current if known else None  # None: its fallback, or a table we never made
            ledger.in_force_classes = ledger.current_classes
            ledger.acked_version = running
        # Versions only move forward, also across controller restarts: the
        # worker tells us the plan it runs and the next one must be newer.
        ledger.plan_version = max(ledger.plan_version, running)
        ledger.refused_table = None  # a new session may accept what the last one refused


def plan_key(draft: PlanDraft, classes: ClassSet) -> tuple:
    """What makes two plans the same plan: the table, each class's table and rule, each state's table."""
    states = tuple(sorted(draft.state_tables.items()))
    if classes.single:
        return (draft.table, states) if states else (draft.table,)
    return (draft.table, classes.default,
            tuple((c, draft.table_for(c.name)) for c in classes), states)


def _applied(ledger: PlanLedger, sent: SentPlan) -> None:
    if sent.kind == "plan" and sent.version > ledger.acked_version:
        ledger.acked_version = sent.version
        ledger.in_force = sent.draft
        ledger.in_force_classes = sent.classes
