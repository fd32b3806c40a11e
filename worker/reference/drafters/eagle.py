"""``eagle``: an autoregressive feature-level draft head with EAGLE-2 trees.

Per request the drafter keeps the head's own KV cache over *pairs*
``(f_t, x_{t+1})`` (target feature of token t, embedding of token t+1), at
position t. Each step:

1. **ingest** the features the target computed since the request last
   drafted: one head forward over the new pairs, appended to the request's
   cache. A request that does not draft only queues them (the prompt's at
   admission, ``ingest_prompts``, and every off step's), so speculation off
   costs no head forward; before a step's timed draft the engine has the
   requests about to draft run the head over their queue (``catch_up``), so
   a step's draft time covers this step's pairs only (root + accepted drafts
   of the step before). The output at the last pair, ``(f_{R-1}, x_R)``
   with ``x_R`` the root, predicts the root's feature ``f̂_R``; the draft LM
   head on it gives the level-1 candidates.
2. **expand** (EAGLE-2, Li et al. 2024b): at each level the ``width`` nodes
   with the highest cumulative probability (product along the path) are
   expanded: the pair ``(f̂_parent-output, node token)`` goes through the
   head, attending to the cached context plus the node's drafted ancestors
   (tree attention inside the draft), and its output's top-``width`` tokens
   become children. ``depth - 1`` head forwards for a tree of depth ``depth``,
   batched over requests.
3. **rerank**: the ``max_nodes`` nodes with the highest cumulative
   probability form the tree (prefix-closed: a child never beats its parent).

The draft LM head is the target's LM head restricted to the bundle's draft
vocabulary, so a draft level costs a fraction of a target LM head.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from policies.table import Decision
from worker.reference.drafters.base import DraftContext, DrafterLimits, DraftTree, draft_lm_head
from worker.reference.heads.modules import EagleHead
from worker.reference.heads.store import HeadsBundle

__all__ = ["EagleDrafter"]


@dataclass
class _State:
    pairs: int = 0  # pairs in the cache (= position of the next pair)
    k: torch.Tensor | None = None  # [Hkv, S, D]
    v: torch.Tensor | None = None
    last_out: torch.Tensor | None = None  # [d] head output at the last pair: f̂ of the root
    pending: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (feature index, features) not ingested


@dataclass
class _Node:
    token: int
    prob: float
    score: float  # log cumulative probability
    parent: int  # index into the node list, -1 = root
    level: int
    feat_in: torch.Tensor  # the parent pair's output: input feature of this node's pair
    kv_slot: int = -1  # index in the row's draft-local KV when expanded
    children: list[int] = field(default_factory=list)


def _pad_stack(tensors: list[torch.Tensor | None], shape_tail: tuple[int, ...], length: int,
               dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad ``[H, S_i, D]`` tensors to ``[B, H, length, D]`` + bool valid ``[B, length]`` on ``device``."""
    h, d = shape_tail
    if all(t is not None and t.shape[1] == length for t in tensors):  # nothing to pad (always so at batch 1)
        return torch.stack(tensors), torch.ones(len(tensors), length, dtype=torch.bool, device=device)
    out = torch.zeros(len(tensors), h, length, d, dtype=dtype, device=device)
    valid = torch.zeros(len(tensors), length, dtype=torch.bool, device=device)
    for i, t in enumerate(tensors):
        if t is not None and t.shape[1]:
            s = t.shape[1]
            out[i, :, length - s :] = t
            valid[i, length - s :] = True
    return out, valid


class EagleDrafter:
    kind = "eagle"
    needs_hidden = True

    def __init__(self, bundle: HeadsBundle, model, max_depth: int = 6, max_width: int = 4,
                 max_tree_nodes: int = 32, catch_up_window: int | None = None) -> None:
        if bundle.kind != "eagle":
            raise ValueError(f"EagleDrafter needs eagle heads, got {bundle.kind}")
        # Where the target is: the head reads its features and embeddings there (``bundle.module`` moves).
        self.device = next(model.parameters()).device
        self.head: EagleHead = bundle.module.to(self.device).eval()
        self.vocab_map = bundle.vocab_map.to(self.device)
        # Every torch layer that drafting runs (``worker.reference.engine.kernels.tune_model`` may swap
        # their linears, so they are always reached through this dict).
        self.layers = torch.nn.ModuleDict({"head": self.head, "lm_head": draft_lm_head(model, bundle.vocab_map)})
        self.embed = model.get_input_embeddings()
        self.version = bundle.version
        self.limits = DrafterLimits(self.kind, self.version, max_depth, max_width, max(max_depth, max_tree_nodes),
                                    int(bundle.meta.get("trained_context_len", 0)))
        self.set_catch_up_window(catch_up_window)
        layer = self.head.layer
        self._kv_shape = (layer.kv_heads, layer.head_dim)
        self._state: dict[str, _State] = {}

    def set_catch_up_window(self, window: int | None) -> None:
        """From now on a catch-up runs only the newest ``window`` queued pairs of
        a request (None: all of them); ``limits.catch_up_window`` (what the
        Hello announces) follows. The pairs before them are never run: the head
        attends to what it cached before, a gap, then these, each at its own
        position. Drafts only: verification decides what is emitted, so any
        window is lossless; what it costs is acceptance (docs/reference-worker.md)."""
        if window is not None and window < 1:
            raise ValueError(f"catch_up_window must be >= 1 pairs or None (all), got {window!r}")
        self.limits = replace(self.limits, catch_up_window=window or 0)

    @property
    def catch_up_window(self) -> int | None:
        """Pairs a catch-up runs at most (None: all); set with :meth:`set_catch_up_window`."""
        return self.limits.catch_up_window or None

    # ------------------------------------------------------------ helpers
    def _run(self, states: list[_State], feats: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
             local_k: torch.Tensor | None, local_v: torch.Tensor | None, local_mask: torch.Tensor):
        """Head forward for ``B`` rows of ``T`` queries each.

        Keys = [row's cached pairs (left-padded) | draft-local keys | new keys];
        ``local_mask`` bool ``[B, T, E + T]`` says which draft-local and new
        keys each query sees (the cached pairs are always visible).
        """
        b, t, _ = feats.shape
        s = max((st.k.shape[1] if st.k is not None else 0 for st in states), default=0)
        past_k, past_valid = _pad_stack([st.k for st in states], self._kv_shape, s, feats.dtype, self.device)
        past_v, _ = _pad_stack([st.v for st in states], self._kv_shape, s, feats.dtype, self.device)
        if local_k is not None:
            past_k = torch.cat([past_k, local_k], dim=2)
            past_v = torch.cat([past_v, local_v], dim=2)
        mask = torch.cat([past_valid[:, None, :].expand(b, t, s), local_mask], dim=-1)[:, None]
        x = self.head.fc(torch.cat([feats, embeds], dim=-1))
        out, k, v = self.head.layer(x, positions, past_k, past_v, mask)
        return self.head.norm(out), k, v

    # ------------------------------------------------------------ ingest
    def _queue(self, ctx: DraftContext) -> _State:
        """The request's state, with its new features (if any) queued."""
        st = self._state.setdefault(ctx.request_id, _State())
        if ctx.hidden is not None and ctx.hidden.shape[0]:
            st.pending.append((len(ctx.tokens) - 1 - ctx.hidden.shape[0], ctx.hidden))
        return st

    def ingest_prompts(self, contexts: Sequence[DraftContext]) -> None:
        """Queue each admitted request's prompt features; the head runs over
        them when the request first drafts (``catch_up``)."""
        for ctx in contexts:
            self._queue(ctx)

    @torch.inference_mode()
    def catch_up(self, contexts: Sequence[DraftContext]) -> dict[str, int]:
        """Run the head over everything queued for these requests (the prompt
        and the steps they were off for) in one batched forward; ``hidden``
        of ``contexts`` is not read (this step's features come with
        ``propose``). Returns the features run per request."""
        return self._catch_up([(ctx, self._state[ctx.request_id]) for ctx in contexts if ctx.request_id in self._state])

    def _ingest(self, contexts: Sequence[DraftContext], decisions: Sequence[Decision]) -> None:
        """Queue every row's new features; run the head only for rows that
        draft this step (an off row's features wait: no draft cost while off)."""
        due = []
        for ctx, dec in zip(contexts, decisions):
            st = self._queue(ctx)
            if dec.depth > 0:
                due.append((ctx, st))
        self._catch_up(due)

    def _catch_up(self, due: Sequence[tuple[DraftContext, _State]]) -> dict[str, int]:
        """One head forward over the queued pairs of every row in ``due``,
        appended to each row's cache; returns the pairs run per request."""
        rows = []
        for ctx, st in due:
            if not st.pending:
                continue
            first = st.pending[0][0]  # feature index of the first queued feature
            hidden = st.pending[0][1] if len(st.pending) == 1 else torch.cat([h for _, h in st.pending])
            st.pending.clear()
            window = self.catch_up_window
            if window is not None and hidden.shape[0] > window:
                # Only the newest pairs: the head keeps what it cached before and skips the gap
                # (positions stay absolute, so the pairs it does see sit where they belong).
                skip = hidden.shape[0] - window
                hidden, first = hidden[skip:], first + skip
            if first < st.pairs:  # out of sync (should not happen): start over from these features
                st.pairs, st.k, st.v = first, None, None
            rows.append((ctx, st, hidden, first))
        if not rows:
            return {}
        t = max(h.shape[0] for _, _, h, _ in rows)
        d = rows[0][2].shape[1]
        feats = torch.zeros(len(rows), t, d, device=self.device)  # filled from the target's features, in place
        # Token ids and positions are built on the host and copied over once each.
        tokens = torch.zeros(len(rows), t, dtype=torch.long, device="cpu")
        positions = torch.zeros(len(rows), t, dtype=torch.long, device="cpu")
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool, device=self.device))
        local = causal.repeat(len(rows), 1, 1)
        for r, (ctx, st, hidden, first) in enumerate(rows):
            m = hidden.shape[0]
            feats[r, :m] = hidden.float()
            tokens[r, :m] = torch.tensor(ctx.tokens[first + 1 : first + 1 + m], device="cpu")
            positions[r] = first + torch.arange(t, device="cpu")
        tokens, positions = tokens.to(self.device), positions.to(self.device)
        out, k, v = self._run([st for _, st, _, _ in rows], feats, self.embed(tokens).float(), positions,
                              None, None, local)
        for r, (ctx, st, hidden, first) in enumerate(rows):
            m = hidden.shape[0]
            nk, nv = k[r, :, :m], v[r, :, :m]
            if st.k is not None:  # after the pairs cached before (and after a skipped gap, if any)
                st.k = torch.cat([st.k, nk], dim=1)
                st.v = torch.cat([st.v, nv], dim=1)
            else:  # no earlier pairs (first call, or restart): left-pad slots stand for pairs never seen
                st.k, st.v = nk.clone(), nv.clone()
            st.pairs = first + m
            st.last_out = out[r, m - 1].clone()
        return {ctx.request_id: hidden.shape[0] for ctx, _, hidden, _ in rows}

    # ------------------------------------------------------------ propose
    @torch.inference_mode()
    def propose(self, contexts: Sequence[DraftContext], decisions: Sequence[Decision]) -> list[DraftTree]:
        self._ingest(contexts, decisions)
        out = [DraftTree() for _ in contexts]
        active = [i for i, (c, d) in enumerate(zip(contexts, decisions))
                  if d.depth > 0 and self._state[c.request_id].last_out is not None]
        if not active:
            return out
        states = [self._state[contexts[i].request_id] for i in active]
        decs = [decisions[i] for i in active]
        nodes: list[list[_Node]] = [[] for _ in active]

        # level 1 from the root's predicted feature
        root_feats = torch.stack([st.last_out for st in states])
        self._add_children(nodes, [-1] * len(active), root_feats, decs, [0.0] * len(active), level=1)
        # draft-local KV of expanded nodes, per row
        local_k: list[list[torch.Tensor]] = [[] for _ in active]
        local_v: list[list[torch.Tensor]] = [[] for _ in active]
        max_depth = max(d.depth for d in decs)
        for level in range(1, max_depth):
            # frontier: top-width nodes of this level by cumulative score, rows still growing
            frontier = []
            for r, (row_nodes, d) in enumerate(zip(nodes, decs)):
                if level >= d.depth:
                    frontier.append([])
                    continue
                cands = [j for j, n in enumerate(row_nodes) if n.level == level]
                cands.sort(key=lambda j: -row_nodes[j].score)
                frontier.append(cands[: d.width])
            rows = [r for r in range(len(active)) if frontier[r]]
            if not rows:
                break
            t = max(len(frontier[r]) for r in rows)
            e = max(len(local_k[r]) for r in rows)
            dim = root_feats.shape[1]
            # Features and draft-local KV stay on the device (one copy per row); ids, positions and the
            # mask are built on the host and copied over once each.
            feats = torch.zeros(len(rows), t, dim, device=self.device)
            toks = torch.zeros(len(rows), t, dtype=torch.long, device="cpu")
            positions = torch.zeros(len(rows), t, dtype=torch.long, device="cpu")
            lmask = torch.zeros(len(rows), t, e + t, dtype=torch.bool, device="cpu")
            hk, hd = self._kv_shape
            lk = torch.zeros(len(rows), hk, e, hd, device=self.device)
            lv = torch.zeros(len(rows), hk, e, hd, device=self.device)
            for q, r in enumerate(rows):
                row_nodes = nodes[r]
                if local_k[r]:
                    lk[q, :, : len(local_k[r])] = torch.stack(local_k[r], dim=1)  # [Hkv, e_r, D]
                    lv[q, :, : len(local_v[r])] = torch.stack(local_v[r], dim=1)
                feats[q, : len(frontier[r])] = torch.stack([row_nodes[j].feat_in for j in frontier[r]])
                for a, j in enumerate(frontier[r]):
                    n = row_nodes[j]
                    toks[q, a] = n.token
                    positions[q, a] = states[r].pairs + level - 1
                    lmask[q, a, e + a] = True  # itself
                    p = n.parent
                    while p >= 0:  # drafted ancestors (all expanded, so they have KV)
                        lmask[q, a, row_nodes[p].kv_slot] = True
                        p = row_nodes[p].parent
                for a in range(len(frontier[r]), t):
                    lmask[q, a, e + a] = True  # padding queries see themselves only
            toks, positions, lmask = toks.to(self.device), positions.to(self.device), lmask.to(self.device)
            outs, k, v = self._run([states[r] for r in rows], feats, self.embed(toks).float(), positions,
                                   lk, lv, lmask)
            parents_idx, parent_feats, parent_scores, row_ids = [], [], [], []
            for q, r in enumerate(rows):
                for a, j in enumerate(frontier[r]):
                    n = nodes[r][j]
                    n.kv_slot = len(local_k[r])
                    local_k[r].append(k[q, :, a])
                    local_v[r].append(v[q, :, a])
                    row_ids.append(r)
                    parents_idx.append(j)
                    parent_feats.append(outs[q, a])
                    parent_scores.append(n.score)
            self._add_children_flat(nodes, row_ids, parents_idx, torch.stack(parent_feats), decs, parent_scores,
                                    level + 1)
        for r, i in enumerate(active):
            out[i] = self._select(nodes[r], decs[r])
        return out

    def _topk(self, feats: torch.Tensor, width: int) -> tuple[list[list[int]], list[list[float]]]:
        logits = self.layers["lm_head"](feats)  # [rows, draft vocab]
        top, idx = logits.topk(width, -1)  # [rows, width]
        p = (top - logits.logsumexp(-1, keepdim=True)).exp()  # softmax at the top entries only
        return self.vocab_map[idx].tolist(), p.tolist()

    def _add_children(self, nodes, parents, feats, decs, scores, level) -> None:
        width = max(d.width for d in decs)
        toks, probs = self._topk(feats, width)
        for r in range(len(nodes)):
            for tok, p in zip(toks[r][: decs[r].width], probs[r][: decs[r].width]):
                nodes[r].append(_Node(tok, p, scores[r] + _log(p), parents[r], level, feats[r]))

    def _add_children_flat(self, nodes, row_ids, parents, feats, decs, scores, level) -> None:
        width = max(decs[r].width for r in row_ids)
        toks, probs = self._topk(feats, width)
        for q, r in enumerate(row_ids):
            parent = parents[q]
            for tok, p in zip(toks[q][: decs[r].width], probs[q][: decs[r].width]):
                nodes[r][parent].children.append(len(nodes[r]))
                nodes[r].append(_Node(tok, p, scores[q] + _log(p), parent, level, feats[q]))

    @staticmethod
    def _select(row_nodes: list[_Node], d: Decision) -> DraftTree:
        order = sorted(range(len(row_nodes)), key=lambda j: (-row_nodes[j].score, row_nodes[j].level, j))
        keep: set[int] = set()
        for j in order:
            if len(keep) >= d.max_nodes:
                break
            p = row_nodes[j].parent
            if p < 0 or p in keep:
                keep.add(j)
        chosen = sorted(keep, key=lambda j: (row_nodes[j].level, j))
        new_index = {j: i for i, j in enumerate(chosen)}
        parents = [new_index[row_nodes[j].parent] if row_nodes[j].parent >= 0 else -1 for j in chosen]
        return DraftTree(parents, [row_nodes[j].token for j in chosen], [row_nodes[j].prob for j in chosen])

    def release(self, request_id: str) -> None:
        self._state.pop(request_id, None)


def _log(p: float) -> float:
    import math

    return math.log(p) if p > 0 else -1e30
