"""Lossless speculative *sampling*: the emitted tokens follow the target's law.

Greedy verification (``verify.greedy_accept``, ``batch.greedy_path``) keeps
a draft token iff it is the target's argmax. With sampling (temperature > 0)
the target's next token is random, and verification must make the emitted
token follow the target's distribution ``p`` exactly, whatever the drafter
proposed. Two schemes, one per draft shape:

- ``sample_accept_chain``: one candidate per position, drawn from the
  drafter's ``q`` (Leviathan et al. 2023; Chen et al. 2023), batched.
- ``sample_accept_tree``: several candidates per node: recursive rejection
  sampling over the siblings (SpecInfer's multi-step speculative sampling,
  Miao et al. 2024; without replacement as in Recursive Speculative
  Decoding, Jeon et al. 2024), one row at a time.

The one-candidate lemma both rest on
------------------------------------
Let the drafter propose ``x ~ q`` and accept it with probability
``min(1, p(x)/q(x))``. Then

- P(emit x by acceptance) = ``q(x) min(1, p(x)/q(x)) = min(p(x), q(x))``;
- P(reject) = ``1 - sum_y min(p, q) = sum_y max(0, p - q) =: Z``;
- on rejection we draw from the residual ``r = max(0, p - q) / Z``, so
  P(emit x by resampling) = ``max(0, p(x) - q(x))``,

and the two add up to ``p(x)``. Nothing in the lemma needs the fallback to
be a *direct* draw from ``r``: any procedure whose output follows ``r``
will do, e.g. another round of the same lemma with a new candidate. That is
the whole tree scheme below.

Requests verified with typical acceptance (``verify.AcceptanceRule``) do
not come here: they trade this exactness for longer accepted runs
(``verify.typical_passes``, ``batch.typical_path``), and the engine keeps
the two apart row by row, so the lemma still holds for every strict row of
a mixed batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

__all__ = ["ChainSample", "TreeSample", "sample_accept_chain", "sample_accept_tree"]


# --------------------------------------------------------------------------
# chains, batched
# --------------------------------------------------------------------------


class ChainSample(NamedTuple):
    """``tau``: long ``[batch]`` draft tokens accepted; ``next_token``: long
    ``[batch]``, the token emitted after them (resample or bonus)."""

    tau: torch.Tensor
    next_token: torch.Tensor


def sample_accept_chain(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    generator: torch.Generator | None = None,
) -> ChainSample:
    """Speculative-sampling rejection for a chain (the lemma, position by position).

    Position k is only reached if 1..k-1 were accepted, and then p and q are
    the conditionals given that same prefix, so the lemma applies at every
    position. If all d drafts pass, the target's distribution after the last
    one is free: draw the bonus from it.

    Parameters
    ----------
    target_probs : torch.Tensor
        ``[batch, d+1, vocab]``; row k = target distribution for position k
        (given the root and drafts < k); row d is for the bonus.
    draft_probs : torch.Tensor
        ``[batch, d, vocab]``, the distributions the drafts were sampled from.
    draft_tokens : torch.Tensor
        long ``[batch, d]``.
    generator : torch.Generator, optional

    Returns
    -------
    ChainSample
        Emitted tokens are ``draft_tokens[b, :tau[b]]`` then ``next_token[b]``.
    """
    batch, d = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)
    p_x = target_probs[:, :d].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [batch, d]
    q_x = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)  # [batch, d]

    # u < min(1, p/q)  <=>  u*q < p  for u in [0, 1); no division by q.
    u = torch.rand(batch, d, generator=generator, device=draft_tokens.device, dtype=p_x.dtype)
    accepted = u * q_x < p_x  # [batch, d]
    tau = accepted.long().cumprod(-1).sum(-1)  # [batch]: first rejection (or d)

    # Next-token law: residual norm(max(0, p - q)) at the rejected position,
    # or plain p at position d when every draft passed.
    residual = (target_probs[:, :d] - draft_probs).clamp(min=0)  # [batch, d, vocab]
    laws = torch.cat([residual, target_probs[:, d:]], dim=1)  # [batch, d+1, vocab]
    law = laws[rows, tau]  # [batch, vocab]
    mass = law.sum(-1, keepdim=True)
    # mass == 0 means p == q there, where rejection has probability 0; fall back
    # to p so a rounding-level event cannot produce NaNs.
    law = torch.where(mass > 0, law / mass.clamp(min=torch.finfo(law.dtype).tiny), target_probs[rows, tau])
    next_token = torch.multinomial(law, 1, generator=generator).squeeze(-1)  # [batch]
    return ChainSample(tau, next_token)


# --------------------------------------------------------------------------
# trees, one row
# --------------------------------------------------------------------------


class TreeSample(NamedTuple):
    """``path``: block indices root-first of the accepted entries (``path[0]
    == 0``, the root); ``next_token``: the token emitted after them."""

    path: list[int]
    next_token: int


def sample_accept_tree(
    target_probs: torch.Tensor,
    parents: Sequence[int],
    tokens: Sequence[int],
    proposal: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> TreeSample:
    """Recursive rejection sampling down a draft tree: the output follows ``p``.

    At a node with children ``x_1 .. x_k`` (in node order) start from the
    target's law there, ``p_1 = p``, and the law the first candidate was
    drawn from, ``q_1``. For ``i = 1 .. k``:

    - accept ``x_i`` with probability ``min(1, p_i(x_i) / q_i(x_i))``; on
      acceptance emit it and recurse into ``x_i``'s children with the
      target's law after ``x_i``;
    - on rejection move to the residual ``p_{i+1} = norm(max(p_i - q_i, 0))``
      and to the law of the next candidate, ``q_{i+1}``.

    If every child is rejected, draw from ``p_{k+1}`` and stop; at a leaf
    draw the bonus from the target's law after it.

    Why it is exact: by the lemma (module docstring), round i turns "a
    candidate with law q_i, then a procedure that outputs ``p_{i+1}``" into
    an output with law ``p_i``. Round k's fallback is a direct draw from
    ``p_{k+1}``; by induction from the last round back, the node's output
    follows ``p_1 = p``. The lemma needs ``x_i``'s law given everything
    before it (earlier siblings, their rejection) to be exactly ``q_i``;
    how many candidates a node gets may depend on anything the drafter knew
    before drawing them, never on the candidates themselves or on the target.
    Accepting ``x_i`` moves one level down, where p and q are the
    conditionals given the emitted prefix, and the argument repeats.

    Candidate laws ``q_i`` supported:

    - ``proposal is None``: *deterministic* candidates (top-k, n-gram
      lookup...): ``q_i`` is a point mass on ``x_i``, so ``x_i`` is
      accepted with probability ``p_i(x_i)`` and the residual is ``p_i``
      with ``x_i`` removed, renormalised. Exact for any drafter.
    - ``proposal`` given: the siblings were drawn one after the other
      *without replacement* from the parent's draft law ``q``:
      ``q_1 = q`` and ``q_{i+1}`` is ``q_i`` with ``x_i`` removed,
      renormalised. Removing ``x_i`` loses nothing: it can only be rejected
      when ``p_i(x_i) < q_i(x_i)``, and then ``p_{i+1}(x_i) = 0``.

    Parameters
    ----------
    target_probs : torch.Tensor
        ``[n+1, vocab]`` in block coordinates: row 0 is the target's law
        after the root, row ``i + 1`` its law after draft node i.
    parents, tokens : sequence of int
        The draft tree (``parents[i] == -1``: a child of the root), nodes in
        topological order; siblings are tried in node order.
    proposal : torch.Tensor, optional
        ``[n, vocab]``: row i is the law node i's *parent* drew its children
        from (siblings share it). ``None``: deterministic candidates.
    generator : torch.Generator, optional

    Returns
    -------
    TreeSample

    Raises
    ------
    ValueError
        If a candidate has zero proposal probability (it cannot have been
        drawn from its law, so the scheme would not be exact).

    Examples
    --------
    A target that is sure of token 2 after the root and of 5 after it:
    a tree offering 1 then 2 at the root accepts 2, then draws the bonus.

    >>> p = torch.zeros(4, 8)
    >>> p[0, 2] = p[1, 0] = p[2, 5] = p[3, 7] = 1.0
    >>> sample_accept_tree(p, [-1, -1, 0], [1, 2, 3])
    TreeSample(path=[0, 2], next_token=5)
    """
    n = len(parents)
    if len(tokens) != n or target_probs.shape[0] != n + 1:
        raise ValueError(f"tree of {len(parents)} parents and {len(tokens)} tokens needs {n + 1} target rows, "
                         f"got {target_probs.shape[0]}")
    if proposal is not None and proposal.shape[0] != n:
        raise ValueError(f"proposal has {proposal.shape[0]} rows for {n} draft nodes")
    children: list[list[int]] = [[] for _ in range(n + 1)]  # block coordinates
    for i, parent in enumerate(parents):
        children[parent + 1].append(i + 1)

    path = [0]
    node = 0
    law = target_probs[0]
    while children[node]:
        kids = children[node]
        q = None
        if proposal is not None:
            q = proposal[kids[0] - 1].to(device=law.device, dtype=law.dtype)
            q = q / q.sum()
        chosen = 0
        for kid in kids:
            x = int(tokens[kid - 1])
            q_x = 1.0 if q is None else float(q[x])
            if q is not None and q_x <= 0.0:
                raise ValueError(f"draft node {kid - 1} (token {x}) has proposal probability 0 "
                                 "after its earlier siblings: it cannot have been drawn from it")
            # On the generator's device (a CUDA generator cannot draw a CPU tensor), else the law's.
            u = float(torch.rand((), generator=generator, dtype=torch.float64,
                                 device=generator.device if generator is not None else law.device))
            if u * q_x < float(law[x]):  # u < min(1, p/q) without dividing by q
                chosen = kid
                break
            # Rejected: residual p <- norm(max(p - q, 0)); a point mass only removes x.
            if q is None:
                residual = law.clone()
                residual[x] = 0.0
            else:
                residual = (law - q).clamp(min=0.0)
            mass = residual.sum()
            # mass == 0 only when p == q, where rejection has probability 0;
            # keep p so a rounding-level event cannot produce NaNs.
            law = residual / mass if mass > 0 else law
            if q is not None:  # the next sibling was drawn without x
                q = q.clone()
                q[x] = 0.0
                left = q.sum()
                q = q / left if left > 0 else q
        if not chosen:
            return TreeSample(path, int(torch.multinomial(law, 1, generator=generator)))
        path.append(chosen)
        node = chosen
        law = target_probs[chosen]
    return TreeSample(path, int(torch.multinomial(law, 1, generator=generator)))
