"""A request's recent outcomes: the state a decision may be conditioned on (issue #28).

Acceptance within a request is correlated: code being echoed is accepted
token after token, text the drafter cannot follow hardly at all, and a
request stays in such a span for tens of tokens. What a request did in its
last steps therefore says something about this one. Each request-step is in
one of four states, taken from the same request's previous steps:

- :data:`AFTER_MISS` — the previous step drafted and accepted nothing
  (``depth > 0``, ``τ = 0``);
- :data:`AFTER_HIT` — the previous step drafted and accepted every level it
  drafted (``τ = depth``);
- :data:`RESTING` — the last step that drafted missed, and the request has
  run plain since, for at most :data:`REST_STEPS` steps;
- :data:`DEFAULT` — anything else: the request's first step, a previous step
  accepted part-way, a plain step not after a miss, or a rest that ran out.

Why these (measured on ``correlated-mixed`` under the goodput policy,
first-position acceptance of the drafting request-steps by what the previous
step did): after a miss 0.26, after a full accept 0.88, after a partial
accept 0.76, first steps 0.79, after a plain step 0.76. Partial, first and
plain sit together, so they share the default state; "accepted all but the
last level" (0.78) looks like them, not like a full accept, so a hit means
every level.

**Resting.** Where drafting is dear (a burst of 128 requests) the table
after a miss says off, and with three states the request was back in the
default state one plain step later, still inside the span it missed in
(spans the drafter cannot follow last tens of tokens, a plain step emits
one): it drafted again by the default table, missed again, and so every
other step. Those requests were a large part of what the default state
drafted, which pulled the pooled acceptance the default table is planned
from down to 0.56-0.6 and, at bursts, switched the default table off for
everyone (on correlated-mixed the requests inside near-copy spans drafted on
only 42 % of their burst steps; the oracle on all). A request that missed
now rests: it keeps its own state through up to :data:`REST_STEPS` plain
steps, whose table the policy plans from the acceptance of the requests
that drafted while resting (low while the span lasts).

**No absorbing off.** A rest ends after :data:`REST_STEPS` plain steps and
any other plain step resets a request to :data:`DEFAULT`, so a table that
says off in :data:`AFTER_MISS` or :data:`RESTING` holds for at most
``1 + REST_STEPS`` steps: the request is then back in the default state,
whose table drafts whenever drafting pays for the average request; had a
state persisted through plain steps without bound, a request that missed
once would never draft again and never produce the evidence that could
switch it back on.

The state values are those of ``speculation.v1.RequestState``
(``plan.proto``): 0 is ``REQUEST_STATE_UNSPECIFIED``, which is also what a
worker that does not track outcomes sends, and it is decided by the plan's
table. A worker that tracks decides its default-state requests by the table
keyed :data:`OTHER` when the plan has one (planned from the default state's
own acceptance), so ``Plan.table`` stays the plan for requests about which
nothing is known. :data:`RESTING` and :data:`OTHER` came after the first
two: a plan carries their tables in ``Plan.later_state_tables``, which a
worker that does not know a state there skips (one that predates them
ignores the field), so such a worker decides those requests by
``Plan.table``, as it always did.

>>> [STATE_NAMES[next_state(d, a).state] for d, a in [(0, 0), (4, 0), (4, 4), (4, 2), (1, 1)]]
['default', 'after_miss', 'after_hit', 'default', 'after_hit']
>>> s = next_state(4, 0)
>>> [STATE_NAMES[(s := next_state(0, 0, s)).state] for _ in range(REST_STEPS + 1)][-2:]
['resting', 'default']
"""

from __future__ import annotations

from typing import Callable, Iterable, NamedTuple, TypeVar

DEFAULT = 0  # REQUEST_STATE_UNSPECIFIED: first step, after a partial accept or a plain step, or not tracked
AFTER_MISS = 1  # REQUEST_STATE_AFTER_MISS
AFTER_HIT = 2  # REQUEST_STATE_AFTER_HIT
RESTING = 3  # REQUEST_STATE_RESTING
# REQUEST_STATE_OTHER: not a state a request is put in but the key of the default state's own
# table (PlanDraft.state_tables, Plan.later_state_tables), which a worker that tracks outcomes
# uses for its requests in the default state; Plan.table stays the table for everyone else.
OTHER = 4
STATES = (DEFAULT, AFTER_MISS, AFTER_HIT, RESTING)
TRACKED_STATES = (AFTER_MISS, AFTER_HIT, RESTING)  # the states a worker keeps per request
TABLE_STATES = (AFTER_MISS, AFTER_HIT, RESTING, OTHER)  # the keys a plan's state tables may have
FIRST_STATES = (AFTER_MISS, AFTER_HIT)  # every tracking worker knows them: Plan.state_tables
STATE_NAMES = {DEFAULT: "default", AFTER_MISS: "after_miss", AFTER_HIT: "after_hit", RESTING: "resting",
               OTHER: "other"}

T = TypeVar("T")


def split_first_states(items: Iterable[T], state_of: Callable[[T], int]) -> tuple[list[T], list[T]]:
    """``items`` (state tables, or anything keyed by a state) split as a plan carries them:
    those whose ``state_of`` is in :data:`FIRST_STATES` (``Plan.state_tables``), then the
    rest (``Plan.later_state_tables``), each in the order given.

    >>> split_first_states([(RESTING, "r"), (AFTER_MISS, "m"), (OTHER, "o"), (AFTER_HIT, "h")], lambda i: i[0])
    ([(1, 'm'), (2, 'h')], [(3, 'r'), (4, 'o')])
    """
    first: list[T] = []
    later: list[T] = []
    for item in items:
        (first if state_of(item) in FIRST_STATES else later).append(item)
    return first, later


def table_key(state: int) -> int:
    """The key of ``state``'s own table in a plan (:data:`OTHER` for the default state)."""
    return OTHER if state == DEFAULT else state

# Plain steps a request rests after a miss before it is back in the default state. A span the
# drafter cannot follow lasts tens of tokens and a plain step emits one, so most rests end inside
# the span they began in; longer rests would also hold the requests that missed inside a span
# the drafter follows (a 0.8-acceptance span misses one first position in five) for longer.
REST_STEPS = 8


class RequestState(NamedTuple):
    """Where a request stands: its :data:`STATES` value and, while :data:`RESTING`,
    the plain steps it has run since its miss (1 .. :data:`REST_STEPS`; 0 otherwise)."""

    state: int = DEFAULT
    rested: int = 0


UNTRACKED = RequestState()

# A RequestState as one int (what the controller keeps per active request): the state in the
# low STATE_BITS bits, the rest count above them; a state that is not resting packs to itself.
STATE_BITS = 3
STATE_MASK = (1 << STATE_BITS) - 1


def pack_state(state: int, rested: int = 0) -> int:
    """``RequestState(state, rested)`` as one int; :func:`unpack_state` inverts it.

    >>> pack_state(AFTER_HIT), pack_state(RESTING, 2), unpack_state(pack_state(RESTING, 2))
    (2, 19, RequestState(state=3, rested=2))
    """
    return state | rested << STATE_BITS


def unpack_state(code: int) -> RequestState:
    return RequestState(code & STATE_MASK, code >> STATE_BITS)


def next_state(depth: int, accepted: int, previous: RequestState = UNTRACKED) -> RequestState:
    """The state of a request's next step after a step that drafted ``depth``
    levels (0: plain, also when the drafter offered nothing) and accepted
    ``accepted`` tokens of them (bonus token excluded), the request having been
    in ``previous`` (its first step: :data:`UNTRACKED`)."""
    if depth <= 0:
        if previous.state == AFTER_MISS:
            return RequestState(RESTING, 1)
        if previous.state == RESTING and previous.rested < REST_STEPS:
            return RequestState(RESTING, previous.rested + 1)
        return UNTRACKED
    if accepted <= 0:
        return RequestState(AFTER_MISS)
    if accepted >= depth:
        return RequestState(AFTER_HIT)
    return UNTRACKED
