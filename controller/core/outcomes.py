"""Acceptance per request state: the strict rule's evidence split by each
request's recent outcomes (:mod:`policies.outcome`, issue #28).

One :class:`~controller.models.acceptance.AcceptanceModel` per state (the
default state, after a miss, after a full accept, resting), each with the
pooled strict model's settings (context buckets, half-life, evidence cap,
prior) and the same strata (drafter kind and version, context bucket).
:func:`controller.core.ingest.apply_step` buffers every strict request-step's
evidence under its state, and :func:`controller.core.ingest.fold_evidence`
hands it to the pooled model as before and also to its state's model; the
pooled model, drift detection and ``accept_counts`` do not change. The
policy reads them as ``Observation.acceptance_by_state``. The default
state's model plans the table a tracking worker gives its default-state
requests (``REQUEST_STATE_OTHER``); ``Plan.table`` stays planned from the
pooled model (:mod:`policies.state_tables` says why).

These models stay on the controller that ingested the steps: several
replicas sharing acceptance through Redis share the pooled models only
(``controller.fleet.acceptance_sync``); a worker that moves replicas starts
its state models afresh there, and until they hold enough evidence its plans
carry no state tables (:mod:`policies.state_tables`).
"""

from __future__ import annotations

from typing import Sequence

from controller.core.state import WorkerState
from controller.models.acceptance import AcceptanceModel, AcceptancePrior, AcceptanceView
from policies.outcome import STATES


class StateAcceptanceModels:
    """The per-state acceptance models of one controller.

    Parameters
    ----------
    context_edges, half_life_s, max_evidence, prior
        As the pooled strict model's (:class:`AcceptanceModel`).
    """

    def __init__(self, context_edges: Sequence[int], half_life_s: float, max_evidence: float,
                 prior: AcceptancePrior) -> None:
        self.models = {s: AcceptanceModel(context_edges, half_life_s=half_life_s, max_evidence=max_evidence,
                                          prior=prior) for s in STATES}

    def tick(self, now: float) -> None:
        for model in self.models.values():
            model.tick(now)

    def views(self, state: WorkerState) -> dict[int, AcceptanceView]:
        """Each tracked state's acceptance for ``state``'s drafter; a state with
        no evidence for it yet is left out (``view`` would create empty strata)."""
        limits = state.limits
        return {s: model.view(state.drafter_key, limits.max_depth, limits.max_width)
                for s, model in self.models.items() if model.peek(state.drafter_key) is not None}
