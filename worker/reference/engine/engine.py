"""The reference engine: continuous batching with per-request speculation.

One ``Engine.step()``:

1. **admit** waiting requests (up to ``max_batch`` rows): prefill their
   whole prompts together (left-padded) into a fresh ``BatchKV``, merge it
   into the batch's, and take each request's first token from the logits
   after its last prompt token (argmax, or a sample), as ``generate`` does;
   a drafter that keeps per-request state over the target's features
   (``CatchUp``: EAGLE's head cache) queues the prompt's here;
2. **decide** per row: ``decide(request_id, context_len, batch_size)`` →
   ``Decision`` (``SpeculationAgent.decide`` or any callable), clamped to the
   drafter's limits; depth 0 = plain decoding for that row;
3. **draft** (timed): ``drafter.propose`` for every row (off rows get an
   empty tree; the drafter still ingests their hidden states). Rows about
   to draft first catch up on what their drafter queued while they were
   off (``CatchUp``; timed apart, not in the step's draft time);
4. **verify** (timed): one forward of the target's decoder over every row's
   ``[root | draft nodes]`` block (own tree mask per row, padded to the
   largest; off the CPU its attention is cascaded, ``cascade.py``), its
   matrix products on the real entries only when padding is a fifth of the
   block or more (``packing.py``), LM head on the real entries only,
   acceptance per row (greedy, or recursive rejection sampling when
   ``temperature > 0``; typical acceptance for rows
   whose rule says so), KV compaction to the accepted paths;
5. **commit**: emitted tokens (accepted drafts + bonus, cut at EOS /
   ``max_new_tokens``), hidden states of the accepted entries queued for the
   drafter, telemetry to the observer (draft ms, verify ms, per-position
   outcome, context length), finished rows leave the batch.

**Shadow drafts** (``worker.sdk.shadow``): with a drafter whose proposals
are nearly free and deterministic (``shadows = True``: prompt lookup), a
strict row whose decision is off gets the chain of the drafter's depth
proposed before the step when the shadows' trajectory says so (one open per
request, ``ShadowDrafts.wants``), outside the step's draft and verify times
(``EngineStats.shadow_s``), never verified; the tokens the row emits resolve
it, and the row's telemetry of the step that did carries the outcome
(``RequestTelemetry.shadows``): acceptance evidence for a request that does
not draft. A row that drafts drops its open shadow.

Greedy verification accepts a draft token only when it is the target's
argmax after the accepted prefix, so the output is token for token what
``model.generate(do_sample=False)`` produces, whatever the drafter does.
With ``temperature > 0`` every emitted token follows the target's
``softmax(logits / temperature)`` given the tokens before it, whatever the
drafter does (``sampling.sample_accept_tree``; chains and trees alike).

Both hold for requests verified with the *strict* rule, the default. A
request may instead be verified with Medusa-2's *typical* acceptance
(``verify.AcceptanceRule``): its own ``acceptance`` at ``submit``, else its
class's rule (``classes``: a policy's ``ClassSet`` or a name-to-rule
mapping), else the engine's ``acceptance``. Rules are per row within one
batch: a typical row never changes what a strict row beside it emits (each
row's acceptance reads its own logits only). A typical row accepts a draft
whose target probability clears ``min(epsilon, delta * exp(-H))`` and emits
the target's argmax after the accepted path, also at ``temperature > 0``
(Medusa-2), so it trades exactness for longer accepted runs. Every
request-step's telemetry says which rule verified it.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from policies.table import Decision
from worker.reference.drafters.base import EMPTY_TREE, CatchUp, DraftContext, Drafter, DraftTree
from worker.reference.engine.attention import use_grouped_attention
from worker.reference.engine.batch import RowOutcome, build_block, greedy_path, row_outcome, typical_path
from worker.reference.engine.cascade import PREFIX_VALID_KWARG, use_cascade_attention
from worker.reference.engine.kv import BatchKV, SlotCache
from worker.reference.engine.packing import install_packing, packed_rows, real_entries
from worker.reference.engine.sampling import sample_accept_tree
from worker.reference.engine.verify import STRICT, AcceptanceRule, _cache_kwarg, typical_passes
from worker.sdk.shadow import ShadowDrafts
from worker.sdk.telemetry import RequestSummary, RequestTelemetry, StepTelemetry

__all__ = ["Engine", "EngineStats", "Request", "rule_source", "static_decide"]

DecideFn = Callable[..., Decision]
"""``(request_id, context_len, batch_size[, request_class]) -> Decision``."""

# Process-wide counters: step ids must grow strictly per worker and request
# ids must not repeat, also when one agent watches several Engine instances
# one after the other (benchmarks) — the controller rejects anything else.
_STEP_IDS = itertools.count(1)
_REQUEST_IDS = itertools.count()


def static_decide(decision: Decision) -> DecideFn:
    """A decide callable that always answers ``decision``."""

    def decide(request_id: str, context_len: int, batch_size: int) -> Decision:
        return decision

    return decide


def rule_source(classes) -> Callable[[str], AcceptanceRule | None]:
    """A request class's acceptance rule, from where the engine learns it.

    ``classes`` may be a policy's ``ClassSet`` (an empty or unknown name is
    the default class), a mapping of class names to anything
    ``AcceptanceRule.parse`` takes (an unlisted name: ``None``, i.e. the
    engine's own ``acceptance``), or a callable ``name -> rule`` read at
    every step, e.g. ``SpeculationAgent.acceptance_rule`` (the rule the plan
    in force allows the class). ``None``: no class has a rule of its own.

    >>> from policies.classes import parse_classes
    >>> rule = rule_source(parse_classes({"chat": {}, "bulk": {"acceptance": "typical"}}, "bulk", "inline"))
    >>> rule("chat").kind, rule("bulk"), rule("other").kind
    ('strict', AcceptanceRule(kind='typical', epsilon=0.09, delta=0.3), 'typical')
    >>> rule_source({"bulk": ("typical", 0.3, 0.5)})("chat") is None
    True
    """
    if classes is None:
        return lambda name: None
    if hasattr(classes, "classes") and hasattr(classes, "default"):  # policies.classes.ClassSet
        rules = {c.name: AcceptanceRule.make_typical(c.typical_epsilon, c.typical_delta) if c.relaxed else STRICT
                 for c in classes.classes}
        default = rules[classes.default]
        return lambda name: rules.get(name, default)
    if callable(classes):
        cached = functools.lru_cache(maxsize=64)(AcceptanceRule.parse)  # called per row and step: plans repeat rules

        def parse(value) -> AcceptanceRule:
            try:
                return cached(value)
            except TypeError:  # unhashable (a list): parse it each time
                return AcceptanceRule.parse(value)

        return lambda name: parse(classes(name))
    rules = {str(name): AcceptanceRule.parse(rule) for name, rule in classes.items()}
    return rules.get


def _takes_class(decide: DecideFn) -> bool:
    """Whether ``decide`` takes a fourth argument, the request's class
    (``SpeculationAgent.decide`` does; ``static_decide``'s and most test
    callables do not, and are then called with three)."""
    try:
        params = inspect.signature(decide).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 4 or any(p.kind is p.VAR_POSITIONAL for p in params)


@dataclass(eq=False)
class Request:
    """A generation request and, once done, its result.

    ``request_class``: the class it named ("" = none); ``acceptance``: its
    own rule, overriding its class's (``None`` = the class's)."""

    request_id: str
    prompt: list[int]
    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    domain: str = ""
    request_class: str = ""
    acceptance: AcceptanceRule | None = None
    output: list[int] = field(default_factory=list)
    steps: int = 0
    accepted_tokens: int = 0
    t_submit: float = 0.0
    t_admit: float = 0.0
    t_first_token: float = 0.0
    t_done: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)
    on_done: Callable[["Request"], None] | None = None

    @property
    def finished(self) -> bool:
        return self.done.is_set()


@dataclass
class EngineStats:
    steps: int = 0
    tokens: int = 0  # generated tokens, all requests
    row_steps: int = 0
    spec_row_steps: int = 0  # row-steps that drafted (a non-empty tree)
    draft_nodes: int = 0  # Σ nodes verified
    accepted: int = 0  # Σ τ
    typical_row_steps: int = 0  # row-steps verified with typical acceptance (in row_steps too)
    typical_accepted: int = 0  # Σ τ over them (in accepted too)
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0
    catch_up_s: float = 0.0  # drafter catch-ups of rows switched on (``CatchUp``), outside draft_s
    shadow_drafts: int = 0  # shadow drafts resolved and reported (``worker.sdk.shadow``)
    shadow_s: float = 0.0  # proposing them, outside draft_s and verify_s
    repacks: int = 0
    finished: int = 0

    @property
    def mean_accepted(self) -> float:
        """Mean τ (accepted draft tokens per row-step)."""
        return self.accepted / self.row_steps if self.row_steps else 0.0


@dataclass(eq=False)
class _Row:
    req: Request
    tokens: list[int]  # committed; the root last
    pending: list[torch.Tensor] = field(default_factory=list)  # hidden states not yet given to the drafter


class Engine:
    """Continuous-batching engine with per-request speculation, greedy or sampled.

    Parameters
    ----------
    model : transformers causal LM (Llama family: ``model.model`` + ``lm_head``)
    drafter : Drafter, optional
        ``None`` = plain decoding for everybody.
    decide : callable, optional
        ``(request_id, context_len, batch_size[, request_class]) -> Decision``,
        e.g. ``SpeculationAgent.decide``; default: a depth-4 chain with a drafter,
        off without one. Clamped to the drafter's limits.
    observer : object, optional
        Gets ``observe(StepTelemetry)`` after every step and
        ``finish(RequestSummary)`` per finished request (``SpeculationAgent``).
    max_batch : int
        Rows per step; more requests wait.
    eos_token_id : int or list of int, optional
        Default: the model's ``generation_config.eos_token_id``.
    temperature : float
        0 = greedy (lossless against ``generate(do_sample=False)``); > 0 =
        sampling from ``softmax(logits / temperature)`` (lossless in
        distribution).
    seed : int, optional
        Seed of the sampling generator (``temperature > 0``).
    cascade : bool, optional
        Verify through cascade attention (``cascade.py``: the cached prefix
        without a mask, the block with its tree mask, merged by log-sum-exp)
        instead of one masked attention over the whole context. ``None``
        (default): on when the model is off the CPU; the CPU keeps its tuned
        masked path. ``True`` raises on a model whose attention is not SDPA.
    acceptance : AcceptanceRule, str or tuple, optional
        The rule of requests whose class gives none (``AcceptanceRule.parse``:
        ``"strict"``, ``("typical", epsilon, delta)``...); default strict.
    classes : ClassSet, mapping or callable, optional
        Class name -> rule (``rule_source``; e.g. ``agent.acceptance_rule``;
        replace with ``set_classes``). A request's own ``acceptance``
        overrides its class's. ``decide`` gets a request's class as a fourth
        argument when it takes one (``SpeculationAgent.decide``).
    shadows : bool, optional
        Propose shadow drafts for off rows (module docstring). ``None``
        (default): when the drafter says its proposals are cheap and
        deterministic (``drafter.shadows``); ``True`` with any other drafter
        raises.
    packed : bool
        Verify packed (``packing.py``, the default): the decoder's matrix
        products run on the real entries of a step's block only, so a row
        that drafts less than the widest pays for its own entries. False:
        every row is padded to the widest (``verify_layout`` says which the
        engine runs; a worker tells its controller in ``Hello``).
    """

    def __init__(
        self,
        model,
        drafter: Drafter | None = None,
        decide: DecideFn | None = None,
        observer=None,
        max_batch: int = 8,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int = 0,
        repack_hole_fraction: float = 0.25,
        temperature: float = 0.0,
        seed: int | None = None,
        cascade: bool | None = None,
        acceptance: AcceptanceRule | str | tuple | None = None,
        classes=None,
        shadows: bool | None = None,
        packed: bool = True,
    ) -> None:
        if not temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        self.model = model
        use_grouped_attention(model)  # verify blocks are masked multi-token queries: no KV-head copies
        on_cpu = next(model.parameters()).device.type == "cpu"
        self.cascade = (not on_cpu if cascade is None else bool(cascade)) and use_cascade_attention(model)
        if cascade and not self.cascade:
            raise ValueError(f"cascade attention needs a model on SDPA, this one runs "
                             f"{getattr(model.config, '_attn_implementation', None)!r}")
        self.base = getattr(model, model.base_model_prefix)
        self.packed = bool(packed) and install_packing(self.base) > 0
        self.lm_head = model.get_output_embeddings()
        self._cache_kw = _cache_kwarg(type(self.base))
        self.drafter = drafter
        cheap = drafter is not None and getattr(drafter, "shadows", False)
        if shadows and not cheap:
            raise ValueError(f"shadow drafts need a drafter with cheap, deterministic proposals (shadows = True), "
                             f"not {getattr(drafter, 'kind', None)!r}")
        self.shadows = ShadowDrafts(drafter.limits.max_depth) if cheap and shadows is not False else None
        if decide is None:
            decide = static_decide(Decision.chain(4) if drafter is not None else Decision.off())
        self.decide = decide
        self._decide_takes_class = _takes_class(decide)
        self.observer = observer
        self.max_batch = max_batch
        if eos_token_id is None:
            gen = getattr(model, "generation_config", None)
            eos_token_id = getattr(gen, "eos_token_id", None) if gen is not None else None
        if eos_token_id is None:
            eos = frozenset()
        elif isinstance(eos_token_id, int):
            eos = frozenset([eos_token_id])
        else:
            eos = frozenset(int(e) for e in eos_token_id)
        self.eos = eos
        self.pad_token_id = pad_token_id
        self.repack_hole_fraction = repack_hole_fraction
        self.device = next(model.parameters()).device
        self.temperature = float(temperature)
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self.acceptance = AcceptanceRule.parse(acceptance)
        self.set_classes(classes)
        self.kv = BatchKV.empty(model, self.device)
        self.rows: list[_Row] = []
        self._waiting: deque[Request] = deque()
        self._lock = threading.Lock()
        self.stats = EngineStats()

    # ------------------------------------------------------------ rules
    def set_classes(self, classes) -> None:
        """Replace the class -> rule mapping (a policy reload); requests in
        flight follow the new rules from their next step on."""
        self._class_rule = rule_source(classes)

    def rule_for(self, req: Request) -> AcceptanceRule:
        """The rule a request is verified with now: its own, else its class's,
        else the engine's."""
        if req.acceptance is not None:
            return req.acceptance
        rule = self._class_rule(req.request_class)
        return self.acceptance if rule is None else rule

    # ------------------------------------------------------------ requests
    def submit(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        request_id: str | None = None,
        domain: str = "",
        eos_token_id: int | Sequence[int] | None = None,
        on_done: Callable[[Request], None] | None = None,
        request_class: str = "",
        acceptance: AcceptanceRule | str | tuple | None = None,
    ) -> Request:
        """Queue a request (thread-safe); it joins the batch at the next step.

        ``request_class`` names its class (its rule comes from ``classes``);
        ``acceptance`` gives it a rule of its own (``AcceptanceRule.parse``)."""
        if not prompt:
            raise ValueError("a prompt needs at least one token")
        eos = self.eos if eos_token_id is None else frozenset(
            [eos_token_id] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id])
        req = Request(request_id or f"req-{next(_REQUEST_IDS)}", [int(t) for t in prompt], int(max_new_tokens), eos,
                      domain, request_class, None if acceptance is None else AcceptanceRule.parse(acceptance),
                      t_submit=time.perf_counter(), on_done=on_done)
        with self._lock:
            self._waiting.append(req)
        return req

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def verify_layout(self) -> str:
        """``"packed"`` or ``"padded"``: what a step's forward computes (``Hello.verify_layout``)."""
        return "packed" if self.packed else "padded"

    def has_work(self) -> bool:
        return bool(self.rows or self._waiting)

    def run(self, until: Callable[[], bool] | None = None) -> None:
        """Step until no request is active or waiting (or ``until()``)."""
        while self.has_work() and not (until and until()):
            self.step()

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Submit ``prompts``, run to completion, return their new tokens in order."""
        reqs = [self.submit(p, max_new_tokens) for p in prompts]
        self.run()
        return [r.output for r in reqs]

    # ------------------------------------------------------------ admission
    @torch.inference_mode()
    def _admit(self) -> list[Request]:
        """Admit waiting requests; those already done (no budget, or the first
        token ends them)."""
        joiners: list[Request] = []
        with self._lock:
            while self._waiting and len(self.rows) + len(joiners) < self.max_batch:
                joiners.append(self._waiting.popleft())
        if not joiners:
            return []
        t0 = time.perf_counter()
        done_now = []
        live = []
        for req in joiners:
            req.t_admit = t0
            if req.max_new_tokens <= 0:
                done_now.append(req)
            else:
                live.append(req)
        if live:
            fresh, hidden, last_logits = self._prefill([r.prompt for r in live])
            self.kv.merge(fresh)
            # The prefill's last logits give every request its first token, as a
            # step's bonus token would: the token becomes the first root.
            firsts = self._accept([EMPTY_TREE] * len(live), last_logits, [1] * len(live),
                                  [self.rule_for(r) for r in live])
            rows = [_Row(req, list(req.prompt)) for req in live]
            first_row = len(self.rows)
            self.rows.extend(rows)
            finished = [first_row + i for i, (row, o) in enumerate(zip(rows, firsts))
                        if self._emit(row, o.tokens, time.perf_counter())]
            wants_hidden = self.drafter is not None and self.drafter.needs_hidden
            if isinstance(self.drafter, CatchUp):  # queued: the head runs when the request first drafts
                self.drafter.ingest_prompts([DraftContext(row.req.request_id, row.tokens, h, len(row.req.prompt))
                                             for row, h in zip(rows, hidden)])
            elif wants_hidden:
                for row, h in zip(rows, hidden):
                    row.pending.append(h)
            done_now += self._drop(finished)
        self.stats.prefill_s += time.perf_counter() - t0
        for req in done_now:
            self._finish_request(req)
        return done_now

    def _prefill(self, prompts: list[list[int]]) -> tuple[BatchKV, list[torch.Tensor], torch.Tensor]:
        """Whole prompts into a fresh cache (left-padded): the cache, each
        prompt's features ``[len, hidden]`` and the logits after its last
        token ``[batch, vocab]``."""
        b = len(prompts)
        width = max(len(p) for p in prompts)
        cache = SlotCache.for_model(self.model)
        valid = torch.zeros(b, width, dtype=torch.bool, device=self.device)
        ids = torch.full((b, width), self.pad_token_id, dtype=torch.long, device="cpu")  # host, then one copy
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, device="cpu")
            valid[i, width - len(p) :] = True
        ids = ids.to(self.device)
        mask = valid.long()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.base(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                        **{self._cache_kw: cache})
        h = out.last_hidden_state  # [b, width, hidden]; left padding: the last column is real in every row
        hidden = [h[i, width - len(p) :].clone() for i, p in enumerate(prompts)]
        return BatchKV(cache, valid), hidden, self.lm_head(h[:, -1])  # logits [b, vocab]

    # ------------------------------------------------------------ the step
    @torch.inference_mode()
    def step(self) -> list[Request]:
        """One engine step; returns the requests that finished in it."""
        admitted_done = self._admit()
        if not self.rows:
            return admitted_done
        batch = len(self.rows)
        ctx = self.kv.real_lengths().tolist()
        decisions = self._decisions(ctx, batch)
        rules = [self.rule_for(row.req) for row in self.rows]  # once per step: telemetry reports these
        caught, catch_up_s = self._catch_up(decisions)
        self._propose_shadows(decisions, rules, ctx)

        t0 = time.perf_counter()
        trees = self._draft(decisions)
        self._sync()
        t1 = time.perf_counter()

        outcomes, hidden = self._verify([row.tokens[-1] for row in self.rows], trees, rules)
        t2 = time.perf_counter()

        if self.kv.maybe_repack(self.repack_hole_fraction):
            self.stats.repacks += 1
        return admitted_done + self._commit(decisions, trees, outcomes, hidden, ctx, t1 - t0, t2 - t1, caught,
                                            catch_up_s, rules)

    def _verify(self, roots: list[int], trees: list[DraftTree],
                rules: list[AcceptanceRule] | None = None) -> tuple[list[RowOutcome], torch.Tensor]:
        """The timed verify of a step: one forward of the decoder over every row's ``[root | nodes]``
        block, the LM head on the real entries, acceptance (``rules``: per row, default strict), KV
        compaction, and a wait for the device. Returns the outcomes and the block's hidden states
        ``[batch, N+1, hidden]`` (``step_costs.py`` times this same call at a grid of shapes)."""
        batch = len(roots)
        block = build_block(roots, trees, self.kv.valid, self.model.dtype, self.pad_token_id)
        past_len = self.kv.length
        # Cascade: the attention reads the prefix's real slots from here and only the block part of the mask.
        cascade = {PREFIX_VALID_KWARG: self.kv.valid} if self.cascade else {}  # bool [batch, past_len]
        real = real_entries(block.sizes, self.device) if self.packed else None  # None: the block runs dense
        with packed_rows(real, batch, max(block.sizes)):
            out = self.base(input_ids=block.ids, attention_mask=block.attention_mask, position_ids=block.position_ids,
                            use_cache=True, **{self._cache_kw: self.kv.cache}, **cascade)
        hidden = out.last_hidden_state  # [batch, N+1, hidden]
        entries = torch.cat([hidden[b, : block.sizes[b]] for b in range(batch)])  # LM head on real entries only
        outcomes = self._accept(trees, self.lm_head(entries), block.sizes, rules or [STRICT] * batch)
        k_max = max(len(o.path) for o in outcomes)
        paths = torch.full((batch, k_max), -1, dtype=torch.long, device="cpu")  # host: compact moves what it needs
        for b, o in enumerate(outcomes):
            paths[b, : len(o.path)] = torch.tensor(o.path, device="cpu")
        self.kv.compact(past_len, paths)
        self._sync()
        return outcomes, hidden

    def _sync(self) -> None:
        """Wait for the device's queued work, so that step times measure it (no-op on the CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _accept(self, trees: list[DraftTree], logits: torch.Tensor, sizes: list[int],
                rules: list[AcceptanceRule]) -> list[RowOutcome]:
        """Per row: the accepted path and the token after it; ``logits``
        ``[Σ sizes, vocab]`` holds every row's real block entries in order.

        Strict rows: greedy (argmax path) or recursive rejection sampling;
        typical rows: the first passing child down the tree, then the
        argmax. Each row reads only its own slice of ``logits``, so a row's
        rule cannot change another row's outcome."""
        starts = [0]
        for size in sizes:
            starts.append(starts[-1] + size)
        probs = (torch.softmax(logits.float() / self.temperature, dim=-1) if self.temperature > 0.0
                 else None)  # [Σ sizes, vocab]: the sampled law, also the typical bar's
        # [Σ sizes]: greedy picks (greedy rows, typical bonuses); all-strict sampling needs none
        targets = logits.argmax(-1).tolist() if probs is None or any(r.typical for r in rules) else []
        outcomes = []
        for b, (tree, rule) in enumerate(zip(trees, rules)):
            lo, hi = starts[b], starts[b + 1]
            if rule.typical:
                # Greedy requests: the bar is computed on the temperature-1 law (Medusa-2).
                law = probs[lo:hi] if probs is not None else torch.softmax(logits[lo:hi].float(), dim=-1)
                passes = typical_passes(law, tree.parents, tree.tokens, rule).tolist() if tree.num_nodes else []
                path, token = typical_path(tree, passes, targets[lo:hi])
            elif probs is None:
                path, token = greedy_path(tree, targets[lo:hi])
            else:
                path, token = sample_accept_tree(probs[lo:hi], tree.parents, tree.tokens, tree.proposal,
                                                 self.generator)
            outcomes.append(row_outcome(tree, path, token))
        return outcomes

    def _decisions(self, ctx: list[int], batch: int) -> list[Decision]:
        if self.drafter is None:
            return [Decision.off()] * batch
        limits = self.drafter.limits
        if self._decide_takes_class:
            return [limits.clamp(self.decide(row.req.request_id, ctx[b], batch, row.req.request_class))
                    for b, row in enumerate(self.rows)]
        return [limits.clamp(self.decide(row.req.request_id, ctx[b], batch)) for b, row in enumerate(self.rows)]

    def _catch_up(self, decisions: list[Decision]) -> tuple[dict[str, int], float]:
        """Rows about to draft run their drafter over what it queued while
        they were off (``CatchUp``), before the timed draft; returns the
        tokens caught up on per request and the seconds it took."""
        if not isinstance(self.drafter, CatchUp):
            return {}, 0.0
        due = [DraftContext(row.req.request_id, row.tokens, None, len(row.req.prompt))
               for row, d in zip(self.rows, decisions) if d.depth > 0]
        if not due:
            return {}, 0.0
        t0 = time.perf_counter()
        caught = self.drafter.catch_up(due)
        seconds = time.perf_counter() - t0
        self.stats.catch_up_s += seconds
        return caught, seconds

    def _propose_shadows(self, decisions: list[Decision], rules: list[AcceptanceRule], ctx: list[int]) -> None:
        """Off strict rows whose shadow trajectory proposes now (``ShadowDrafts.wants``)
        propose the chain of the shadows' depth, before the step emits their token;
        outside the step's draft and verify times."""
        shadows = self.shadows
        if shadows is None:
            return
        due = [b for b, (row, d, rule) in enumerate(zip(self.rows, decisions, rules))
               if d.depth == 0 and not rule.typical and shadows.wants(row.req.request_id)]
        if not due:
            return
        t0 = time.perf_counter()
        contexts = [DraftContext(self.rows[b].req.request_id, self.rows[b].tokens, None,
                                 len(self.rows[b].req.prompt)) for b in due]
        trees = self.drafter.propose(contexts, [Decision.chain(shadows.depth)] * len(due))
        for b, tree in zip(due, trees):
            shadows.start(self.rows[b].req.request_id, ctx[b], tree.tokens)
        self.stats.shadow_s += time.perf_counter() - t0

    def _draft(self, decisions: list[Decision]) -> list[DraftTree]:
        if self.drafter is None:
            return [EMPTY_TREE] * len(self.rows)
        contexts = []
        for row in self.rows:
            hidden = None
            if row.pending:
                hidden = row.pending[0] if len(row.pending) == 1 else torch.cat(row.pending)
                row.pending.clear()
            contexts.append(DraftContext(row.req.request_id, row.tokens, hidden, len(row.req.prompt)))
        trees = self.drafter.propose(contexts, decisions)
        if len(trees) != len(self.rows):
            raise ValueError(f"drafter {self.drafter.kind} returned {len(trees)} trees for {len(self.rows)} rows")
        for tree, d in zip(trees, decisions):
            if tree.num_nodes and (tree.num_nodes > d.max_nodes or tree.depth() > d.depth
                                   or tree.max_children() > d.width):
                raise ValueError(
                    f"drafter {self.drafter.kind} returned a tree (nodes {tree.num_nodes}, depth {tree.depth()}, "
                    f"width {tree.max_children()}) outside its decision {d}"
                )
        return trees

    def _commit(self, decisions, trees, outcomes, hidden, ctx, draft_s, verify_s, caught, catch_up_s,
                rules) -> list[Request]:
        now = time.perf_counter()
        wants_hidden = self.drafter is not None and self.drafter.needs_hidden
        telemetry = []
        finished: list[int] = []
        shadows = self.shadows
        for b, (row, tree, o) in enumerate(zip(self.rows, trees, outcomes)):
            req = row.req
            depth = tree.depth() if tree.num_nodes else 0
            done = self._emit(row, o.tokens, now)
            if done:
                finished.append(b)
            resolved = ()
            if shadows is not None:
                if decisions[b].depth:  # it drafts: a proposal of its own, and its verified tokens are evidence
                    shadows.drop(req.request_id)
                else:
                    resolved = shadows.emitted(req.request_id, o.tokens)
                    if done:
                        resolved += shadows.finish(req.request_id)
                    self.stats.shadow_drafts += len(resolved)
            telemetry.append(RequestTelemetry(
                request_id=req.request_id,
                context_len=ctx[b],
                depth=depth,
                width=tree.max_children() if depth else 0,
                nodes=tree.num_nodes,
                accepted=o.accepted,
                accepted_rank=o.accepted_rank if depth else (),
                level_candidates=o.level_candidates if depth else (),
                draft_confidence=o.draft_confidence if depth else (),
                domain=req.domain,
                requested_depth=decisions[b].depth,
                requested_width=decisions[b].width if decisions[b].depth else 0,
                requested_nodes=decisions[b].max_nodes if decisions[b].depth else 0,
                caught_up_tokens=caught.get(req.request_id, 0),
                request_class=req.request_class,
                acceptance_rule=rules[b].kind,
                shadows=resolved,
            ))
            if wants_hidden:
                row.pending.append(hidden[b, o.path].clone())
            req.steps += 1
            req.accepted_tokens += o.accepted
            self.stats.row_steps += 1
            self.stats.spec_row_steps += depth > 0
            self.stats.draft_nodes += tree.num_nodes
            self.stats.accepted += o.accepted
            if rules[b].typical:
                self.stats.typical_row_steps += 1
                self.stats.typical_accepted += o.accepted
        self.stats.steps += 1
        self.stats.draft_s += draft_s
        self.stats.verify_s += verify_s
        if self.observer is not None:
            self.observer.observe(StepTelemetry(next(_STEP_IDS), time.time(), len(self.rows), draft_s * 1e3,
                                                verify_s * 1e3, telemetry, catch_up_s * 1e3))
        done = self._drop(finished)
        for req in done:
            self._finish_request(req)
        return done

    def _emit(self, row: _Row, tokens: list[int], now: float) -> bool:
        """Commit ``tokens`` to the row, cut at EOS / ``max_new_tokens``;
        True when that finished the request."""
        req = row.req
        row.tokens.extend(tokens)
        if not req.output:
            req.t_first_token = now
        for tok in tokens:
            req.output.append(tok)
            self.stats.tokens += 1
            if tok in req.eos_token_ids or len(req.output) >= req.max_new_tokens:
                return True
        return False

    def _drop(self, finished: list[int]) -> list[Request]:
        """Take rows ``finished`` (indices) out of the batch and its cache; their requests."""
        done = [self.rows[b].req for b in finished]
        if finished:
            gone = set(finished)
            keep = [b for b in range(len(self.rows)) if b not in gone]
            self.rows = [self.rows[b] for b in keep]
            self.kv.select(keep)
        return done

    def _finish_request(self, req: Request) -> None:
        req.t_done = time.perf_counter()
        self.stats.finished += 1
        if self.drafter is not None:
            self.drafter.release(req.request_id)
        if self.shadows is not None:
            self.shadows.drop(req.request_id)
        if self.observer is not None:
            self.observer.finish(RequestSummary(req.request_id, len(req.output), req.steps, req.accepted_tokens,
                                                time.time()))
        req.done.set()
        if req.on_done is not None:
            req.on_done(req)
