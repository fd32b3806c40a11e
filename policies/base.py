"""The policy interface: observed state in, decisions out.

A policy is a pure function ``decide(state, observation) -> (PlanDraft, state)``.
Its own memory (EMAs, bandit counts, off-for-good flags, its random generator)
lives in the ``state`` value it returns and is handed back on the next call,
so a recorded sequence of observations replays to the same decisions offline.
Policies never import the controller: the controller builds an
:class:`Observation` from its telemetry store and models, and turns the
returned :class:`PlanDraft` into protocol messages.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Mapping, Protocol, Sequence, TypeVar

import numpy as np

from policies.classes import SINGLE, ClassSet
from policies.table import Decision, DecisionTable


@dataclass(frozen=True, slots=True)
class DrafterLimits:
    """What the worker's drafter can produce (from its Hello)."""

    kind: str = "eagle"
    version: str = ""
    max_depth: int = 8
    max_width: int = 4
    max_tree_nodes: int = 32
    trained_context_len: int = 0
    catch_up_window: int = 0  # tokens a switch-on catches up on at most; 0 = all it skipped

    def clamp(self, decision: Decision) -> Decision:
        return decision.clamp(self.max_depth, self.max_width, self.max_tree_nodes)


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """One request's part of one step."""

    request_id: str
    context_len: int
    depth: int
    width: int
    nodes: int
    accepted: int
    request_class: str = ""  # as reported (empty: the default class)


@dataclass(frozen=True, slots=True)
class ClassLoad:
    """One request class's recent traffic and latency on a worker (issue #29).

    ``share``: its share of request-steps; ``context_share`` / ``context_mean``
    as :class:`LoadProfile`'s, over its requests only. ``tpot_ms_p50`` /
    ``tpot_ms_p99``: time per output token over its recent requests (each
    request's step time over the tokens it emitted; 0 = not measured yet);
    ``tokens_per_step``: its mean ``τ + 1``; ``tail_tokens_per_step``: the
    same over its slowest requests (the 5 % with the highest TPOT, at least
    one; 0 = not measured): a p99 target is their TPOT, and they are mostly
    the requests the drafter follows worst; ``window_tokens_per_step``: the
    same over all its requests of the TPOT window (0 = not measured), the
    mean the tail is compared with (``tokens_per_step`` is decayed over a
    longer span and lags a change of plan).
    """

    share: float = 0.0
    context_share: tuple[float, ...] = ()
    context_mean: tuple[float, ...] = ()
    tpot_ms_p50: float = 0.0
    tpot_ms_p99: float = 0.0
    tokens_per_step: float = 0.0
    step_ms_mean: float = 0.0
    tail_tokens_per_step: float = 0.0
    window_tokens_per_step: float = 0.0


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """One engine step as the worker reported it.

    ``requests`` is empty when the policy does not ask for per-request
    outcomes (``Policy.wants_request_outcomes``); ``emitted`` then carries the
    step's token count.
    """

    step_id: int
    timestamp: float
    batch_size: int
    draft_ms: float
    verify_ms: float
    requests: tuple[RequestOutcome, ...] = ()
    emitted: int | None = None
    catch_up_ms: float = 0.0  # the drafter catching requests up before the draft

    @property
    def tokens(self) -> int:
        """Tokens emitted by the step: Σ (τ + 1)."""
        if self.emitted is not None:
            return self.emitted
        return sum(r.accepted + 1 for r in self.requests)

    @property
    def step_ms(self) -> float:
        return self.draft_ms + self.verify_ms + self.catch_up_ms


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    request_id: str
    steps: int
    generated_tokens: int
    accepted_tokens: int

    @property
    def accepted_per_step(self) -> float:
        return self.accepted_tokens / self.steps if self.steps else 0.0


class AcceptanceEstimate(Protocol):
    """Acceptance of the worker's drafter version, per context bucket.

    ``rank_probs(c)[k, r]`` is q_{k+1, r+1}: the probability that the rank-(r+1)
    candidate at position k+1 is the accepted one, given positions 1..k were
    accepted. Σ_r q_{k,r} ≤ 1; a chain's α_k is ``rank_probs(c)[k-1, 0]``.
    """

    context_edges: tuple[int, ...]
    max_depth: int
    max_width: int

    def rank_probs(self, context_bucket: int) -> np.ndarray:  # [depth, width]
        ...

    def sample_rank_probs(self, context_bucket: int, rng: np.random.Generator) -> np.ndarray:  # [depth, width]
        ...

    def effective_samples(self, context_bucket: int) -> np.ndarray:  # [depth]
        ...

    def offer_rate(self, context_bucket: int) -> float:
        """P(the drafter offers a draft at all | the decision asks for one):
        below 1 for a prompt-lookup drafter that finds no match; the
        acceptance above is conditional on an offer."""
        ...

    def offer_probs(self, context_bucket: int) -> np.ndarray:  # [depth, width]
        """``[k, r]``: P(the drafter offers a rank-(r+1) candidate at position
        k+1 | positions 1..k were accepted and the decision asks for it);
        ``[0, 0]`` is ``offer_rate``. ``rank_probs`` are conditional on the
        candidate being offered. All ones for a drafter that always fills the
        tree it is asked for (model heads)."""
        ...


class CostEstimate(Protocol):
    """Fitted step-time model of one worker (milliseconds).

    ``verify_ms``: the target forward over ``batch_tokens`` (Σ 1 + nodes)
    reading ``kv_tokens`` (Σ context lengths), its attention computing
    ``attn_pairs`` query-key pairs (Σ (1 + nodes) · context length; 0 leaves
    attention flops out). ``draft_ms``: drafting for a
    step whose deepest request drafts ``max_depth`` levels, whose requests
    draft ``total_nodes`` nodes in all and whose Σ depth_i·context_len_i is
    ``level_kv_tokens``.
    """

    def verify_ms(self, batch_tokens: np.ndarray | float, kv_tokens: np.ndarray | float,
                  attn_pairs: np.ndarray | float = 0.0) -> np.ndarray | float:
        ...

    def verify_sd_ms(self, batch_tokens: np.ndarray | float) -> np.ndarray | float:
        """Standard error of ``verify_ms`` at ``batch_tokens`` (0 where exact)."""
        ...

    def draft_ms(
        self,
        max_depth: np.ndarray | float,
        total_nodes: np.ndarray | float,
        batch_size: np.ndarray | float | None = None,
        level_kv_tokens: np.ndarray | float = 0.0,
    ) -> np.ndarray | float:
        ...

    def catch_up_ms(self, tokens: np.ndarray | float) -> np.ndarray | float:
        """Time for the drafter to catch up on ``tokens`` queued features."""
        ...


@dataclass(frozen=True, slots=True)
class LoadProfile:
    """The worker's recent load: batch sizes and context-length mix."""

    mean_batch_size: float = 1.0
    # Share of request-steps per context bucket (sums to 1) and the mean
    # context length inside each bucket (tokens).
    context_share: tuple[float, ...] = ()
    context_mean: tuple[float, ...] = ()
    # Share of request-steps per request state (index: ``policies.outcome`` state, its
    # previous step's outcome); empty before any step or where the controller keeps none.
    state_share: tuple[float, ...] = ()


@dataclass(frozen=True)
class Observation:
    """Everything a policy may look at for one worker at one decision time."""

    now: float
    worker_id: str
    drafter: DrafterLimits
    batch_edges: tuple[int, ...]
    context_edges: tuple[int, ...]
    acceptance: AcceptanceEstimate
    cost: CostEstimate
    load: LoadProfile
    # Steps and finished requests since the previous decide() of this worker.
    steps: tuple[StepOutcome, ...] = ()
    finished: tuple[FinishedRequest, ...] = ()
    # Requests in flight right now (ids seen in steps and not finished).
    active_requests: Mapping[str, int] = field(default_factory=dict)  # id -> context_len
    # Tokens each active request's drafter would catch up on if it drafted now:
    # its context since its last drafting step (all of it if it never drafted),
    # priced by ``cost.catch_up_ms``; empty for a worker that never reported one.
    catch_up_owed: Mapping[str, int] = field(default_factory=dict)  # id -> tokens
    max_batch_size: int = 256
    # The worker's forward pads every request's draft block to the largest
    # (``VERIFY_LAYOUT_PADDED``): it computes batch · (1 + max nodes) tokens.
    padded_verify: bool = False
    # Request classes (the policy file's; one ``default`` class without them), each
    # class's recent load keyed by name, and each active request's class.
    classes: ClassSet = SINGLE
    class_load: Mapping[str, ClassLoad] = field(default_factory=dict)
    active_classes: Mapping[str, str] = field(default_factory=dict)  # request id -> class name
    # Acceptance of the relaxed (typical) rule for classes that use it; None: not observed yet
    # (such a class is valued with ``acceptance``, the strict rule's, a lower bound).
    acceptance_typical: AcceptanceEstimate | None = None
    # The strict rule's acceptance of the request-steps in each request state
    # (``policies.outcome``: the outcome of the request's previous step), same strata as
    # ``acceptance``; extra views of the same evidence, empty where none was kept.
    acceptance_by_state: Mapping[int, AcceptanceEstimate] = field(default_factory=dict)


@dataclass(frozen=True)
class PlanDraft:
    """A policy's answer: the table for every request, plus per-request
    overrides (the complete set wanted now; the controller sends the diff)."""

    table: DecisionTable
    overrides: Mapping[str, Decision] = field(default_factory=dict)
    expected_goodput_tok_s: float = 0.0
    reasons: Mapping[str, str] = field(default_factory=dict)  # request_id -> why overridden
    # Per request class (name -> table, same edges as ``table``); a class not listed
    # uses ``table``. Empty for a policy that treats every class alike.
    class_tables: Mapping[str, DecisionTable] = field(default_factory=dict)
    # Per request state (``policies.outcome``: AFTER_MISS, AFTER_HIT; same edges as
    # ``table``) for the requests ``table`` decides; a state not listed, and the default
    # state, use ``table``. Empty: no request's last outcome changes its decision.
    state_tables: Mapping[int, DecisionTable] = field(default_factory=dict)

    def table_for(self, request_class: str) -> DecisionTable:
        return self.class_tables.get(request_class, self.table)

    def table_for_state(self, state: int) -> DecisionTable:
        return self.state_tables.get(state, self.table)


ConfigT = TypeVar("ConfigT")


class Policy(ABC, Generic[ConfigT]):
    """Base class: configuration in ``__init__``, pure ``decide``."""

    name: str = "policy"
    # Model-based policies are judged by estimated goodput before a new plan
    # is pushed (hysteresis); rule-based ones push whenever their rule says.
    model_based: bool = False
    # The policy file's request classes (set by the preset loader); a policy
    # that ignores them gives every class its one table.
    classes: ClassSet = SINGLE
    # Whether observations carry every request's outcome per step (rule-based
    # engines' policies read them; model-based ones read the fitted models).
    wants_request_outcomes: bool = True

    def __init__(self, config: ConfigT) -> None:
        self.config = config

    @abstractmethod
    def initial_state(self, seed: int = 0) -> Any:
        """The state ``decide`` receives on its first call for a worker."""

    @abstractmethod
    def decide(self, state: Any, obs: Observation) -> tuple[PlanDraft, Any]:
        """Return the plan for ``obs`` and the state for the next call.

        Must not mutate ``state`` in place nor keep anything on ``self``:
        replaying the same observations from ``initial_state`` gives the same
        plans.
        """


def uniform_plan(decision: Decision, obs: Observation) -> DecisionTable:
    """A table with one decision everywhere, cut to the drafter's limits."""
    return DecisionTable.uniform(obs.drafter.clamp(decision), obs.batch_edges, obs.context_edges)


def per_batch_plan(
    decide_for_batch: Callable[[int], Decision], obs: Observation, breakpoints: Sequence[int] = ()
) -> DecisionTable:
    """A table whose rows depend on batch size only (the engines' tables).

    ``breakpoints`` are the batch sizes where the policy's answer may change;
    they become bucket edges so every batch size in a bucket gets exactly the
    decision the engine would give it. Each row is decided at its lower edge.
    """
    edges = tuple(sorted(set(obs.batch_edges) | {int(b) for b in breakpoints if b >= 1}))
    rows = [(obs.drafter.clamp(decide_for_batch(lower)),) * len(obs.context_edges) for lower in edges]
    return DecisionTable.from_rows(rows, edges, obs.context_edges)


__all__: Sequence[str] = (
    "AcceptanceEstimate",
    "ClassLoad",
    "CostEstimate",
    "Decision",
    "DecisionTable",
    "DrafterLimits",
    "FinishedRequest",
    "LoadProfile",
    "Observation",
    "PlanDraft",
    "Policy",
    "RequestOutcome",
    "StepOutcome",
    "per_batch_plan",
    "uniform_plan",
)
