"""A request's last outcome: the state a decision may be conditioned on (issue #28).

Acceptance within a request is correlated: code being echoed is accepted
token after token, text the drafter cannot follow hardly at all, and a
request stays in such a span for tens of tokens. What a request did in its
previous step therefore says something about this one. Each request-step is
in one of three states, taken from the same request's previous step:

- :data:`AFTER_MISS` — the previous step drafted and accepted nothing
  (``depth > 0``, ``τ = 0``);
- :data:`AFTER_HIT` — the previous step drafted and accepted every level it
  drafted (``τ = depth``);
- :data:`DEFAULT` — anything else: the request's first step, a previous step
  that did not draft (plain), or one accepted part-way.

Why these three (measured on ``correlated-mixed`` under the goodput policy,
first-position acceptance of the drafting request-steps by what the previous
step did): after a miss 0.26, after a full accept 0.88, after a partial
accept 0.76, first steps 0.79, after a plain step 0.76. Partial, first and
plain sit together, so they share the default state; "accepted all but the
last level" (0.78) looks like them, not like a full accept, so a hit means
every level.

A plain step always resets a request to :data:`DEFAULT`. That is what keeps
an ``AFTER_MISS`` table that says "off" from being absorbing: a request it
turns off is plain for one step and is back in the default state, whose
table drafts whenever drafting pays for the average request; had the state
persisted through plain steps, a request that missed once would never draft
again and never produce the evidence that could switch it back on.

The values are those of ``speculation.v1.RequestState`` (``plan.proto``):
0 is ``REQUEST_STATE_UNSPECIFIED``, which is also what a worker that does not
track outcomes sends, and it is decided by the plan's default table.

>>> [STATE_NAMES[next_state(d, a)] for d, a in [(0, 0), (4, 0), (4, 4), (4, 2), (1, 1)]]
['default', 'after_miss', 'after_hit', 'default', 'after_hit']
"""

from __future__ import annotations

DEFAULT = 0  # REQUEST_STATE_UNSPECIFIED: first step, after a plain or a partly accepted step, or not tracked
AFTER_MISS = 1  # REQUEST_STATE_AFTER_MISS
AFTER_HIT = 2  # REQUEST_STATE_AFTER_HIT
STATES = (DEFAULT, AFTER_MISS, AFTER_HIT)
TRACKED_STATES = (AFTER_MISS, AFTER_HIT)  # the states a plan may carry a table of its own for
STATE_NAMES = {DEFAULT: "default", AFTER_MISS: "after_miss", AFTER_HIT: "after_hit"}


def next_state(depth: int, accepted: int) -> int:
    """The state of a request's next step after a step that drafted ``depth``
    levels (0: plain, also when the drafter offered nothing) and accepted
    ``accepted`` tokens of them (bonus token excluded)."""
    if depth <= 0:
        return DEFAULT
    if accepted <= 0:
        return AFTER_MISS
    if accepted >= depth:
        return AFTER_HIT
    return DEFAULT
