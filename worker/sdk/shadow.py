"""Shadow drafts: acceptance evidence from requests that do not draft.

A request whose decision is off yields no acceptance evidence, so a
controller whose model says "off" learns it was wrong only by drafting
(probes): live traffic that became easier to draft for than the traffic the
model was fitted on stays off. Where proposing a draft is nearly free and
deterministic given the context (prompt lookup), an engine can propose one
anyway for an off request, not verify it, and compare it with the tokens the
target then emits. Under the strict rule the number of leading draft tokens
matched has the law of τ for the same chain verified (greedy: verification
accepts exactly the argmax plain decoding emits; sampling: a deterministic
draft token is accepted with the target's probability of it, the probability
plain sampling emits it), so the controller adds it to the acceptance model
as a verified chain (``speculation.v1.ShadowDraft`` states the rules).

:class:`ShadowDrafts` is the bookkeeping, engine-agnostic. Which steps
propose one matters, because the controller reads shadows as drafts: their
acceptance must be that of the steps a drafting request would propose at.
A request drafting chains of the drafter's depth ``D`` proposes after each
verification, so it skips the positions inside every run it accepted (a
full accept and its bonus token). Shadows follow that trajectory: one is
open per request at a time; the next is proposed at the first off step after
it resolved, one step later after a full match (the bonus token a verified
chain would have emitted). Proposing at every off step instead counts the
positions inside runs the drafter follows, where it matches most: on the
engine benchmark's n-gram at batch 4 those shadows offered a draft at 0.56
of the steps and were accepted at 0.49-0.51 of the first positions against
0.39-0.42 and 0.35-0.49 for the verified drafts of the same runs, and the
controller drafted two-token chains that lost to plain decoding.

>>> shadows = ShadowDrafts(depth=3)
>>> shadows.wants("r1")
True
>>> shadows.start("r1", context_len=100, draft=[7, 8, 9])
>>> shadows.emitted("r1", [7])                 # 7 matched, two to go
[]
>>> shadows.emitted("r1", [8, 5])              # 8 matched, 5 is not 9: resolved
[ShadowOutcome(context_len=100, requested_depth=3, depth=3, accepted=2)]
>>> shadows.start("r1", context_len=102, draft=[4])
>>> shadows.emitted("r1", [4])                 # matched whole: the next step is the bonus token's
[ShadowOutcome(context_len=102, requested_depth=3, depth=1, accepted=1)]
>>> shadows.wants("r1"), shadows.wants("r1")
(False, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["ShadowDrafts", "ShadowOutcome"]


@dataclass(frozen=True, slots=True)
class ShadowOutcome:
    """A resolved shadow draft (``speculation.v1.ShadowDraft``): proposed at
    ``context_len`` tokens, ``requested_depth`` tokens asked, ``depth`` offered
    (0 = no draft), ``accepted`` leading tokens of it emitted by the target."""

    context_len: int
    requested_depth: int
    depth: int
    accepted: int

    def __post_init__(self) -> None:
        if not (self.context_len >= 0 and self.requested_depth >= 1 and 0 <= self.depth <= self.requested_depth
                and 0 <= self.accepted <= self.depth):
            raise ValueError(f"shadow outcome {self} must have context_len >= 0, requested_depth >= 1, "
                             "0 <= depth <= requested_depth and 0 <= accepted <= depth")


@dataclass(slots=True)
class _Open:
    context_len: int
    draft: tuple[int, ...]
    matched: int = 0


class ShadowDrafts:
    """Open shadow drafts of an engine's requests, one per request at most.

    Parameters
    ----------
    depth : int
        Tokens asked of the drafter per shadow (>= 1): the deepest position it
        gives evidence for, and the depth of the drafting trajectory whose
        proposal steps the shadows follow (module docstring).
    """

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"shadow depth must be >= 1, got {depth}")
        self.depth = depth
        self._open: dict[str, _Open] = {}
        self._bonus: set[str] = set()  # matched whole: the next step is the bonus token's, no proposal
        self.started = 0
        self.resolved = 0

    def wants(self, request_id: str) -> bool:
        """Whether ``request_id`` proposes a shadow at this off step (call once per
        step: after a full match it answers False once, for the bonus token's step)."""
        if request_id in self._open:
            return False
        if request_id in self._bonus:
            self._bonus.discard(request_id)
            return False
        return True

    def start(self, request_id: str, context_len: int, draft: Sequence[int]) -> None:
        """The drafter's first-ranked chain for ``request_id``, proposed with
        ``context_len`` tokens committed and before the step's token is
        emitted (empty: it offered nothing). At most ``depth`` tokens are kept."""
        if request_id in self._open:
            raise ValueError(f"request {request_id!r} already has a shadow draft open")
        self._open[request_id] = _Open(context_len, tuple(int(t) for t in draft[: self.depth]))
        self.started += 1

    def emitted(self, request_id: str, tokens: Sequence[int]) -> list[ShadowOutcome]:
        """Tokens ``request_id`` emitted in one step, in order: the outcome of its
        shadow if they resolved it (a mismatch, or every draft token matched),
        else ``[]`` (still open, or none open)."""
        shadow = self._open.get(request_id)
        if shadow is None:
            return []
        draft = shadow.draft
        used = 0  # tokens that matched
        for token in tokens:
            if shadow.matched == len(draft) or draft[shadow.matched] != token:
                break
            shadow.matched += 1
            used += 1
        else:
            if shadow.matched < len(draft):
                return []  # every emitted token matched and the draft goes on
        del self._open[request_id]
        if draft and shadow.matched == len(draft) and used == len(tokens):
            self._bonus.add(request_id)  # the bonus token a verified chain would emit is still to come
        self.resolved += 1
        return [ShadowOutcome(shadow.context_len, self.depth, len(draft), shadow.matched)]

    def finish(self, request_id: str) -> list[ShadowOutcome]:
        """``request_id`` left: what its open shadow showed (the tokens matched so
        far, as a chain that deep accepted whole; ``[]`` when none matched)."""
        self._bonus.discard(request_id)
        shadow = self._open.pop(request_id, None)
        if shadow is None or shadow.matched == 0:
            return []
        self.resolved += 1
        return [ShadowOutcome(shadow.context_len, self.depth, shadow.matched, shadow.matched)]

    def drop(self, request_id: str) -> None:
        """Forget ``request_id``'s open shadow: it drafts for real (that step is a
        proposal of its own trajectory), or it left."""
        self._open.pop(request_id, None)
        self._bonus.discard(request_id)

    def open_count(self) -> int:
        """Shadows open now, all requests."""
        return len(self._open)
