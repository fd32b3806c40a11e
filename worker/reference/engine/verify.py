"""Tree verification on a Llama-family transformers model with a KV cache.

The ladder, one small function per rung:

1. ``prefill``            prompt minus its last token into an empty cache
2. ``build_tree_inputs``  positions + 4-D additive mask for [past KV | root | nodes]
3. ``verify_tree``        one target forward over root + draft nodes -> logits
4. ``greedy_accept``      longest draft path the target agrees with + bonus token
4b. ``typical_accept``    Medusa-2's relaxed rule: likely-enough drafts pass too
5. ``compact_cache``      keep only the accepted path's KV entries
6. ``greedy_decode``      the loop tying 1-5 together (reference / test oracle),
                          strict or typical per row

Sampled (non-greedy) verification, for chains and trees, lives in
``sampling.py``.

Acceptance rules
----------------
Every request is verified by one ``AcceptanceRule``. ``strict`` (the
default) is lossless: greedy verification keeps exactly the target's argmax
path, sampled verification keeps the target's law. ``typical`` is Medusa-2's
typical acceptance (Cai et al. 2024, section 2.3.1): a drafted token ``x``
whose parent position has target law ``p`` (temperature-adjusted as the
engine samples; temperature 1 for greedy requests) passes when

    p(x) > min(epsilon, delta * exp(-H(p)))      H in nats,

so a flat (uncertain) target accepts more, a peaked one less. Among the
children of the last accepted entry the first one that passes, in node
order, is taken; the token after the accepted path is the target's argmax
there (Medusa-2: "greedy decode the first token"). The argmax always passes
(it clears the bar whenever ``delta < 1``, as ``max p >= exp(-H)``; it is
let through explicitly for the edge cases), so on a chain typical accepts at
least what strict does; what it emits is no longer the target's greedy (or
sampled) output, only close to it.

Conventions
-----------
- The *root* is the last committed token; its KV is **not** in the cache when
  a step begins. A step feeds the block ``[root, node_0, ..., node_{n-1}]``
  (block coordinates: 0 = root, i+1 = draft node i; see ``tree.py``).
- ``logits[:, j]`` is the target's prediction for a *child* of block entry j,
  so draft node i is checked against ``argmax(logits[:, parent_block(i)])``.
- accepted length ``tau`` excludes the bonus token; a step emits ``tau + 1``.
- Position of a token = number of real (non-pad) tokens before it; this is
  what ``generate`` uses for left-padded batches, so outputs match it.

Batches
-------
Rows may hold different amounts of real history. The cache is one rectangular
``[batch, kv_heads, S, head_dim]`` tensor per layer, and a bool ``past_valid``
``[batch, S]`` marks which slots are real: left padding from the prompt, and
*holes* left by compaction when rows accept different lengths in one step
(every row keeps ``max_b(tau_b + 1)`` slots, shorter rows pad the tail). Holes
are masked out of attention and skipped by positions, so they cost memory and
bandwidth, never correctness. A serving engine would use a paged cache instead.

Only full-attention ``DynamicCache`` layers are supported (Llama, Qwen2,
Mistral without sliding window...).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from transformers import DynamicCache

from worker.reference.engine.tree import TreeBuffers

__all__ = [
    "STRICT",
    "Acceptance",
    "AcceptanceRule",
    "TreeInputs",
    "accept",
    "build_tree_inputs",
    "compact_cache",
    "greedy_accept",
    "greedy_decode",
    "prefill",
    "typical_accept",
    "typical_passes",
    "typical_threshold",
    "verify_tree",
]


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _cache_kwarg(model_type: type) -> str:
    """Name of the cache argument of ``model_type.forward``.

    transformers 5.x renamed ``past_key_values`` to ``cache`` (the old name is
    deprecated, not gone, in 5.2x); ask the signature instead of the version.
    """
    params = inspect.signature(model_type.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _forward(model, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
        **{_cache_kwarg(type(model)): cache},
    )
    return out.logits


def _full_attention_layers(cache: DynamicCache):
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False) or not hasattr(layer, "keys"):
            raise TypeError(
                f"compact_cache supports full-attention dynamic layers only, got {type(layer).__name__}"
            )
        yield layer


# --------------------------------------------------------------------------
# 1. prefill
# --------------------------------------------------------------------------


@torch.inference_mode()
def prefill(
    model, cache: DynamicCache, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Run all prompt tokens but the last (the first root) into ``cache``.

    Parameters
    ----------
    model : transformers causal LM (Llama family)
    cache : DynamicCache, empty
    input_ids : torch.Tensor
        long ``[batch, prompt_len]``, left-padded when rows differ in length.
    attention_mask : torch.Tensor, optional
        ``[batch, prompt_len]``, 1 = real token, 0 = left pad.

    Returns
    -------
    torch.Tensor
        bool ``[batch, prompt_len - 1]``: ``past_valid`` for the first step.
    """
    batch, length = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    attention_mask = attention_mask.to(input_ids.device).long()
    if not bool(attention_mask[:, -1].all()):
        raise ValueError("prefill needs left padding: the last prompt column must be real in every row")
    past = attention_mask[:, :-1]  # [batch, prompt_len - 1]
    if length > 1:
        positions = (past.cumsum(-1) - 1).clamp(min=0)  # pads get 0; they are masked anyway
        _forward(model, input_ids[:, :-1], past, positions, cache)
    return past.bool()


# --------------------------------------------------------------------------
# 2. inputs for one tree step
# --------------------------------------------------------------------------


class TreeInputs(NamedTuple):
    """Model inputs for one verify step besides the token ids."""

    position_ids: torch.Tensor  # [batch, n+1] long
    attention_mask: torch.Tensor  # [batch, 1, n+1, past+n+1] additive float


def build_tree_inputs(tree: TreeBuffers, past_valid: torch.Tensor, dtype: torch.dtype) -> TreeInputs:
    """Positions and the 4-D additive mask for ``[past KV | root | nodes]``.

    Parameters
    ----------
    tree : TreeBuffers
    past_valid : torch.Tensor
        bool ``[batch, past]``; True where a cache slot holds a real token.
    dtype : torch.dtype
        The model's compute dtype (SDPA wants the mask in the query's dtype).

    Returns
    -------
    TreeInputs
        Every block entry sees all real past slots, itself and its ancestors.
    """
    batch, past = past_valid.shape
    device = past_valid.device
    width = tree.num_nodes + 1
    # Root position = real tokens before it; nodes sit at root + their depth.
    root_pos = past_valid.sum(-1, dtype=torch.long)  # [batch]
    position_ids = root_pos[:, None] + tree.position_offsets.to(device)[None]  # [batch, n+1]

    sees_past = past_valid[:, None, :].expand(batch, width, past)  # [batch, n+1, past]
    sees_tree = tree.attn_mask.to(device)[None].expand(batch, width, width)  # [batch, n+1, n+1]
    allowed = torch.cat([sees_past, sees_tree], dim=-1)  # [batch, n+1, past+n+1]

    # Additive form: 0 = attend, dtype-min = blocked (finite, so no NaN; every
    # row has at least itself unmasked, so no row is fully blocked).
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return TreeInputs(position_ids, mask[:, None])  # [batch, 1, n+1, past+n+1]


# --------------------------------------------------------------------------
# 3. verify
# --------------------------------------------------------------------------


@torch.inference_mode()
def verify_tree(
    model,
    cache: DynamicCache,
    root_and_nodes_ids: torch.Tensor,
    tree: TreeBuffers,
    past_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """One target forward over the root and all draft nodes.

    Appends ``n + 1`` entries to every cache layer (undo with
    ``compact_cache``).

    Parameters
    ----------
    model : transformers causal LM
    cache : DynamicCache
        Holds the past, not the root.
    root_and_nodes_ids : torch.Tensor
        long ``[batch, n+1]``; column 0 the root, column i+1 draft node i.
    tree : TreeBuffers
    past_valid : torch.Tensor, optional
        bool ``[batch, past]``; default: every cache slot is real.

    Returns
    -------
    torch.Tensor
        ``[batch, n+1, vocab]`` logits; entry j predicts j's children.
    """
    batch, width = root_and_nodes_ids.shape
    if width != tree.num_nodes + 1:
        raise ValueError(f"got {width} ids for a tree of {tree.num_nodes} nodes (+1 root)")
    past = cache.get_seq_length()
    if past_valid is None:
        past_valid = torch.ones(batch, past, dtype=torch.bool, device=root_and_nodes_ids.device)
    if past_valid.shape != (batch, past):
        raise ValueError(f"past_valid is {tuple(past_valid.shape)}, cache holds {(batch, past)}")
    inputs = build_tree_inputs(tree, past_valid, model.dtype)
    return _forward(model, root_and_nodes_ids, inputs.attention_mask, inputs.position_ids, cache)


# --------------------------------------------------------------------------
# 4. greedy acceptance
# --------------------------------------------------------------------------


class Acceptance(NamedTuple):
    """Result of one verify step, per row.

    ``path``: long ``[batch, depth+1]`` block indices root-first (``path[:, 0]
    == 0``), -1 padded; ``bonus``: long ``[batch]``, the target's token after
    the last accepted entry (the next root).
    """

    path: torch.Tensor
    bonus: torch.Tensor

    @property
    def tau(self) -> torch.Tensor:
        """Accepted draft tokens per row, bonus excluded: long ``[batch]``."""
        return (self.path >= 0).sum(-1) - 1


def greedy_accept(logits: torch.Tensor, node_tokens: torch.Tensor, tree: TreeBuffers) -> Acceptance:
    """Longest root-to-node path whose every token is the target's argmax.

    Greedy verification accepts draft node i iff its token equals
    ``argmax logits[parent(i)]`` and its parent was accepted; the output is
    then exactly what greedy decoding of the target would produce. Among
    equally long paths the first leaf (lowest block index) wins.

    Parameters
    ----------
    logits : torch.Tensor
        ``[batch, n+1, vocab]`` from ``verify_tree``.
    node_tokens : torch.Tensor
        long ``[batch, n]``, the draft tokens (root excluded).
    tree : TreeBuffers

    Returns
    -------
    Acceptance
    """
    target = logits.argmax(-1)  # [batch, n+1]: target's pick after each entry
    parent = _parent_block(tree, logits.device)  # [n]
    ok = node_tokens == target[:, parent]  # [batch, n]
    return _deepest_path(ok, target, tree)


def _parent_block(tree: TreeBuffers, device) -> torch.Tensor:
    """long ``[n]``: block index of each draft node's parent (0 = the root)."""
    return torch.tensor(tree.parents, dtype=torch.long, device=device) + 1


def _deepest_path(ok: torch.Tensor, target: torch.Tensor, tree: TreeBuffers) -> Acceptance:
    """The deepest root-to-node path whose every node is ``ok``, and the bonus.

    Parameters
    ----------
    ok : torch.Tensor
        bool ``[batch, n]``: draft node i may be accepted if its parent is.
    target : torch.Tensor
        long ``[batch, n+1]``: the token emitted after each block entry.
    tree : TreeBuffers

    Returns
    -------
    Acceptance
        Among equally deep paths the first leaf (lowest block index) wins.
    """
    batch = ok.shape[0]
    device = ok.device
    ok_block = torch.cat([torch.ones_like(ok[:, :1]), ok], dim=1)  # [batch, n+1]; the root is always in
    paths = tree.retrieve_paths.to(device)  # [leaves, D+1]
    child = paths[:, 1:]  # [leaves, D]
    real = child >= 0
    # Pad -1 would index the last entry; clamp, then mask with `real`.
    match = ok_block[:, child.clamp(min=0)] & real[None]  # [batch, leaves, D]
    run = match.long().cumprod(-1).sum(-1)  # [batch, leaves]: accepted prefix length

    best = run.argmax(-1)  # [batch]; argmax returns the first maximum
    tau = run.gather(1, best[:, None]).squeeze(1)  # [batch]
    path = paths[best]  # [batch, D+1]
    keep = torch.arange(paths.shape[1], device=device)[None] <= tau[:, None]
    path = torch.where(keep, path, torch.full_like(path, -1))
    last = path.gather(1, tau[:, None]).squeeze(1)  # [batch] block index of last accepted
    bonus = target[torch.arange(batch, device=device), last]
    return Acceptance(path, bonus)


# --------------------------------------------------------------------------
# 4b. typical acceptance (relaxed, per request)
# --------------------------------------------------------------------------

ACCEPTANCE_KINDS = ("strict", "typical")


@dataclass(frozen=True, slots=True)
class AcceptanceRule:
    """How one request's drafts are verified: ``strict`` or ``typical``.

    Parameters
    ----------
    kind : str
        ``"strict"`` (lossless, the default) or ``"typical"``.
    epsilon, delta : float
        Typical acceptance only: a draft passes when its target probability
        exceeds ``min(epsilon, delta * exp(-H))``; both in (0, 1] (the
        policy file's bounds, ``policies/classes.py``). Medusa's defaults:
        epsilon 0.09, delta = sqrt(epsilon) = 0.3.

    Examples
    --------
    >>> AcceptanceRule.parse(("typical", 0.09))
    AcceptanceRule(kind='typical', epsilon=0.09, delta=0.3)
    >>> AcceptanceRule.parse(None) == STRICT
    True
    """

    kind: str = "strict"
    epsilon: float = 0.0
    delta: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ACCEPTANCE_KINDS:
            raise ValueError(f"acceptance rule {self.kind!r}: must be one of {ACCEPTANCE_KINDS}")
        if self.kind == "typical":
            for name in ("epsilon", "delta"):
                value = getattr(self, name)
                if not 0.0 < value <= 1.0:
                    raise ValueError(f"typical acceptance needs 0 < {name} <= 1, got {value}")
        elif self.epsilon or self.delta:
            raise ValueError("strict acceptance takes no epsilon / delta")

    @property
    def typical(self) -> bool:
        return self.kind == "typical"

    @classmethod
    def make_typical(cls, epsilon: float, delta: float | None = None) -> "AcceptanceRule":
        """Typical acceptance; ``delta`` defaults to ``sqrt(epsilon)`` as in Medusa."""
        eps = float(epsilon)
        return cls("typical", eps, round(math.sqrt(eps), 12) if delta is None else float(delta))

    @classmethod
    def parse(cls, value) -> "AcceptanceRule":
        """``None`` / ``"strict"`` / ``"typical"`` (Medusa's defaults) /
        ``("typical", epsilon[, delta])`` / an ``AcceptanceRule``."""
        if value is None:
            return STRICT
        if isinstance(value, AcceptanceRule):
            return value
        if isinstance(value, str):
            return STRICT if value == "strict" else cls.make_typical(0.09) if value == "typical" else cls(value)
        kind, *params = value
        if kind != "typical":
            return cls(kind, *params)
        return cls.make_typical(*params)


STRICT = AcceptanceRule()


def typical_threshold(probs: torch.Tensor, epsilon, delta) -> torch.Tensor:
    """``min(epsilon, delta * exp(-H))`` per position.

    Parameters
    ----------
    probs : torch.Tensor
        ``[..., vocab]``, the target's law at each position.
    epsilon, delta : float or torch.Tensor
        Scalars, or tensors broadcasting against ``probs.shape[:-1]``.

    Returns
    -------
    torch.Tensor
        ``[...]``, float32.
    """
    entropy = torch.special.entr(probs.float()).sum(-1)  # [...] nats; entr(0) = 0, no NaN
    return torch.minimum(torch.as_tensor(delta, dtype=torch.float32, device=probs.device) * torch.exp(-entropy),
                         torch.as_tensor(epsilon, dtype=torch.float32, device=probs.device))


def typical_passes(probs: torch.Tensor, parents: Sequence[int], tokens: Sequence[int],
                   rule: AcceptanceRule) -> torch.Tensor:
    """Which draft nodes of one row clear the typical bar at their parent.

    Parameters
    ----------
    probs : torch.Tensor
        ``[n+1, vocab]`` in block coordinates (row 0: after the root).
    parents, tokens : sequence of int
        The draft tree (``parents[i] == -1``: a child of the root).
    rule : AcceptanceRule
        A typical rule.

    Returns
    -------
    torch.Tensor
        bool ``[n]``; the parent's argmax always passes.

    Examples
    --------
    A flat target after the root (H = log 4): bar = min(0.3, 0.5 / 4) = 0.125.

    >>> p = torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 3)
    >>> typical_passes(p, [-1, -1], [1, 3], AcceptanceRule("typical", 0.3, 0.5)).tolist()
    [True, False]
    """
    parent = torch.tensor(list(parents), dtype=torch.long, device=probs.device) + 1  # [n]
    node = torch.tensor(list(tokens), dtype=torch.long, device=probs.device)  # [n]
    at_parent = probs[parent]  # [n, vocab]
    p_x = at_parent.gather(-1, node[:, None]).squeeze(-1)  # [n]
    bar = typical_threshold(at_parent, rule.epsilon, rule.delta)  # [n]
    return (p_x > bar) | (node == at_parent.argmax(-1))


def _first_among_siblings(passes: torch.Tensor, tree: TreeBuffers) -> torch.Tensor:
    """bool ``[batch, n]``: node passes and no earlier sibling (node order) does.

    That is the walk "at each accepted entry take the first child that
    passes": only the nodes left True can be on the accepted path, at most
    one per parent, so the deepest all-True path *is* that walk.
    """
    parents = torch.tensor(tree.parents, dtype=torch.long, device=passes.device)  # [n]
    order = torch.arange(len(tree.parents), device=passes.device)
    earlier = (parents[:, None] == parents[None, :]) & (order[None, :] < order[:, None])  # [n, n]: j before i
    shadowed = (passes[:, None, :] & earlier[None]).any(-1)  # [batch, n]
    return passes & ~shadowed


def typical_accept(logits: torch.Tensor, node_tokens: torch.Tensor, tree: TreeBuffers, epsilon, delta,
                   temperature: float = 1.0) -> Acceptance:
    """Medusa-2's typical acceptance along a draft tree, batched.

    Parameters
    ----------
    logits : torch.Tensor
        ``[batch, n+1, vocab]`` from ``verify_tree``.
    node_tokens : torch.Tensor
        long ``[batch, n]``.
    tree : TreeBuffers
    epsilon, delta : float or torch.Tensor
        Scalars or ``[batch]`` (one rule per row).
    temperature : float
        The law the bar is computed on: ``softmax(logits / temperature)``
        (1 for greedy requests).

    Returns
    -------
    Acceptance
        The first passing child (node order) at each accepted entry, down
        to where none passes; the bonus is the target's argmax there.
    """
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [batch, n+1, vocab]
    target = logits.argmax(-1)  # [batch, n+1]
    parent = _parent_block(tree, logits.device)  # [n]
    at_parent = probs[:, parent]  # [batch, n, vocab]
    p_x = at_parent.gather(-1, node_tokens[..., None]).squeeze(-1)  # [batch, n]
    eps = torch.as_tensor(epsilon, dtype=torch.float32, device=logits.device).reshape(-1, 1)  # [batch|1, 1]
    dlt = torch.as_tensor(delta, dtype=torch.float32, device=logits.device).reshape(-1, 1)
    bar = typical_threshold(at_parent, eps, dlt)  # [batch, n]
    passes = (p_x > bar) | (node_tokens == target[:, parent])  # [batch, n]
    return _deepest_path(_first_among_siblings(passes, tree), target, tree)


def accept(logits: torch.Tensor, node_tokens: torch.Tensor, tree: TreeBuffers,
           rules: AcceptanceRule | Sequence[AcceptanceRule] = STRICT) -> Acceptance:
    """Greedy verification with one rule per row: strict rows exactly as
    ``greedy_accept``, typical rows by ``typical_accept`` (temperature 1).

    Parameters
    ----------
    logits : torch.Tensor
        ``[batch, n+1, vocab]``.
    node_tokens : torch.Tensor
        long ``[batch, n]``.
    tree : TreeBuffers
    rules : AcceptanceRule or sequence of AcceptanceRule
        One for every row, or one per row.

    Returns
    -------
    Acceptance
    """
    batch = logits.shape[0]
    rules = [rules] * batch if isinstance(rules, AcceptanceRule) else list(rules)
    if len(rules) != batch:
        raise ValueError(f"{len(rules)} acceptance rules for {batch} rows")
    strict = greedy_accept(logits, node_tokens, tree)
    relaxed = [r.typical for r in rules]
    if not any(relaxed):
        return strict
    eps = [r.epsilon if r.typical else 1.0 for r in rules]  # strict rows: any valid bar, their result is dropped
    dlt = [r.delta if r.typical else 1.0 for r in rules]
    typical = typical_accept(logits, node_tokens, tree, eps, dlt)
    use = torch.tensor(relaxed, device=logits.device)  # [batch]
    return Acceptance(torch.where(use[:, None], typical.path, strict.path),
                      torch.where(use, typical.bonus, strict.bonus))


# --------------------------------------------------------------------------
# 5. cache compaction
# --------------------------------------------------------------------------


@torch.inference_mode()
def compact_cache(
    cache: DynamicCache, past_len: int, accepted_node_indices: torch.Tensor | Sequence[int]
) -> torch.Tensor:
    """Keep only the accepted path's KV from the block a verify step appended.

    After ``verify_tree`` each layer holds ``past_len + n + 1`` slots; the
    accepted entries (root + accepted nodes, block coordinates) are gathered
    into slots ``past_len .. past_len + K - 1`` and the rest is cropped.
    Entries kept keep their KV as computed: RoPE was applied at the node's
    true position and the node only saw its ancestors, which is exactly the
    KV a plain causal pass over the accepted tokens would have produced.

    Parameters
    ----------
    cache : DynamicCache
    past_len : int
        Cache length before the verify step.
    accepted_node_indices : torch.Tensor or sequence of int
        ``[batch, K_max]`` or ``[K_max]`` block indices, -1 padded (e.g.
        ``Acceptance.path``).

    Returns
    -------
    torch.Tensor
        bool ``[batch, K]`` with ``K = max_b(tau_b + 1)``: which kept slots
        are real; append it to ``past_valid``. Rows that accepted less get
        holes (False) at the tail.
    """
    idx = torch.as_tensor(accepted_node_indices, dtype=torch.long)
    if idx.ndim == 1:
        idx = idx[None]
    kept_len = int((idx >= 0).sum(-1).max())
    idx = idx[:, :kept_len]
    valid = idx >= 0  # [batch, K]
    # Holes copy the root's entry (any in-block slot would do; they are masked).
    src = past_len + idx.clamp(min=0)  # [batch, K] absolute slots
    total = cache.get_seq_length()  # past_len + n + 1
    for layer in _full_attention_layers(cache):
        batch, heads, _, dim = layer.keys.shape
        gather_idx = src.to(layer.keys.device)[:, None, :, None].expand(batch, heads, kept_len, dim)
        for name in ("keys", "values"):
            kv = getattr(layer, name)  # [batch, kv_heads, total, head_dim]
            picked = kv.gather(2, gather_idx)  # a copy, so the write below cannot alias
            kv[:, :, past_len : past_len + kept_len] = picked
    cache.crop(-(total - past_len - kept_len))  # negative = tokens to drop (5.x)
    return valid.to(src.device)


# --------------------------------------------------------------------------
# 6. the greedy loop
# --------------------------------------------------------------------------

Drafter = Callable[[list[list[int]]], tuple[TreeBuffers, torch.Tensor]]
"""Given each row's committed tokens (prompt without pads + generated, the
root last), return this step's tree and its node tokens ``[batch, n]``."""


def greedy_decode(
    model,
    input_ids: torch.Tensor,
    drafter: Drafter,
    max_new_tokens: int,
    attention_mask: torch.Tensor | None = None,
    eos_token_id: int | None = None,
    rules: AcceptanceRule | Sequence[AcceptanceRule] = STRICT,
) -> tuple[list[list[int]], list[int]]:
    """Greedy speculative decoding; strict rows equal ``generate(do_sample=False)``.

    Parameters
    ----------
    model : transformers causal LM
    input_ids : torch.Tensor
        long ``[batch, prompt_len]``, left-padded.
    drafter : Drafter
        Called once per step; may change the tree shape from step to step.
    max_new_tokens : int
    attention_mask : torch.Tensor, optional
        ``[batch, prompt_len]`` 1 = real, 0 = left pad.
    eos_token_id : int, optional
        A row stops after emitting it (kept in its output, like ``generate``).
    rules : AcceptanceRule or sequence of AcceptanceRule
        One for all rows or one per row (``accept``); the strict rows' output
        is ``generate``'s whatever the others do.

    Returns
    -------
    (new_tokens, taus)
        ``new_tokens[b]``: generated ids of row b (at most ``max_new_tokens``);
        ``taus``: accepted draft tokens of every row-step, for statistics.
    """
    batch = input_ids.shape[0]
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    cache = DynamicCache(config=model.config)
    past_valid = prefill(model, cache, input_ids, attention_mask)  # [batch, prompt_len-1]
    root = input_ids[:, -1]  # [batch]
    committed = [row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask)]
    new: list[list[int]] = [[] for _ in range(batch)]
    done = [max_new_tokens <= 0] * batch
    taus: list[int] = []

    while not all(done):
        tree, nodes = drafter(committed)  # nodes: [batch, n]
        nodes = nodes.to(input_ids.device).long()
        block = torch.cat([root[:, None], nodes], dim=1)  # [batch, n+1]
        past_len = cache.get_seq_length()
        logits = verify_tree(model, cache, block, tree, past_valid)  # [batch, n+1, vocab]
        acc = accept(logits, nodes, tree, rules)
        past_valid = torch.cat([past_valid, compact_cache(cache, past_len, acc.path)], dim=1)
        root = acc.bonus

        for b in range(batch):
            path = acc.path[b][acc.path[b] >= 0].tolist()
            emitted = block[b, path[1:]].tolist() + [int(acc.bonus[b])]
            committed[b].extend(emitted)  # rows that are done keep going (batch shape), unread
            if done[b]:
                continue
            taus.append(len(path) - 1)
            for tok in emitted:
                new[b].append(tok)
                if tok == eos_token_id or len(new[b]) >= max_new_tokens:
                    done[b] = True
                    break
    return new, taus
