"""llama.cpp's speculative decoding under the controller, through llama-cpp-python.

How the binding speculates (llama-cpp-python 0.3.x, ``Llama.generate``), which
is all this adapter relies on:

1. each step is one ``Llama.eval(tokens)``: the last sampled token followed by
   the draft, in one forward;
2. the loop samples at every evaluated position and keeps drafted tokens up to
   the first one the target disagrees with: ``Llama.n_tokens`` (the KV cache
   it keeps) is cut back to just past the last accepted draft;
3. then it calls ``draft_model(input_ids)`` with the kept tokens plus the new
   sample and evaluates whatever comes back in the next step.

:class:`ControlledPromptLookup` is that draft model. On each call it

- credits the step that just ran: tokens drafted, accepted (read from the
  ``n_tokens`` the engine kept), the step's time from its verify forward's
  start (the engine's own ``eval``, which :meth:`~ControlledPromptLookup.attach`
  wraps) to this call, the previous draft's time, the context length; one
  :class:`~worker.sdk.telemetry.StepTelemetry` per step to the agent;
- asks the agent for this step's depth (``agent.decide(request_id,
  context_len, 1)``, a table lookup): 0 drafts nothing and does not call the
  lookup at all;
- otherwise proposes up to that many tokens with the binding's own prompt
  lookup (``LlamaPromptLookupDecoding.find_candidate_pred_tokens``), wrapped,
  not rewritten;
- at depth 0 (``shadows=True``, the default) looks up the ``max_depth``-token
  chain it would have drafted anyway when the shadow trajectory says so (one
  open per request, :mod:`worker.sdk.shadow`), returns nothing, and judges
  that chain by the tokens the engine then emits: the step's telemetry
  carries the shadow it resolved, so the controller keeps learning the
  lookup's acceptance while speculation is off. The lookup is a scan of the
  context in numpy, outside ``draft_ms``.

No change to llama.cpp. What the binding does not expose, and what the
adapter infers instead (docs/integration.md says the same):

- one sequence per ``Llama``: every step has batch size 1;
- chains only: the binding verifies one drafted sequence, so width is 1 and
  the plan's node budget is the depth;
- no per-step hook: a step is recognised from the ``eval`` calls between two
  draft calls (one eval of ``1 + drafted`` tokens starting where the last
  draft began is a verify; anything else, a prompt being evaluated, starts a
  new request);
- the last step of a request is never credited: the caller stops reading the
  generator (``max_tokens``, a stop token) before the engine has compared
  every drafted token, so its outcome is unknown; it is counted in
  :attr:`LookupStats.unobserved_steps`;
- the prompt lookup has no confidence score; when it finds no match it offers
  nothing, reported as depth 0 with the requested depth kept
  (``requested_depth``), so the controller learns how often it offers.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Protocol, Sequence

import numpy as np
import numpy.typing as npt
from llama_cpp.llama_speculative import LlamaDraftModel, LlamaPromptLookupDecoding

from policies.table import Decision
from protos.speculation.v1 import worker_pb2
from worker.sdk.shadow import ShadowDrafts
from worker.sdk.telemetry import RequestSummary, RequestTelemetry, StepTelemetry

__all__ = ["ControlledPromptLookup", "LookupStats", "StepRecord", "calibrate", "check_lossless_setup",
           "llamacpp_hello"]

ENGINE_NAME = "llama.cpp"


class Decider(Protocol):
    """What the adapter needs of :class:`~worker.sdk.agent.SpeculationAgent`."""

    def decide(self, request_id: str, context_len: int, batch_size: int) -> Decision: ...

    def observe(self, step: StepTelemetry) -> None: ...

    def finish(self, summary: RequestSummary) -> None: ...


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One credited step, as the adapter saw it (kept when ``keep_records``)."""

    request_id: str
    context_len: int  # tokens in the KV cache before the verify forward
    requested_depth: int  # the decision's depth
    drafted: int  # tokens the engine verified after the last sampled one
    accepted: int  # drafted tokens it kept
    draft_ms: float
    verify_ms: float


@dataclass
class LookupStats:
    steps: int = 0  # credited steps, each reported to the agent
    requests: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    lookup_calls: int = 0  # calls into the binding's prompt lookup for a draft (none at depth 0)
    shadow_lookups: int = 0  # ... for a shadow draft at depth 0 (``shadows=True``)
    shadow_drafts: int = 0  # shadow drafts resolved and reported
    empty_offers: int = 0  # lookups that found no continuation
    unobserved_steps: int = 0  # last steps of requests, never compared in full (see the module doc)
    prompt_forwards: int = 0


@dataclass(slots=True)
class _Forward:
    n_past: int  # Llama.n_tokens when the eval began
    tokens: int
    started: float  # the adapter's clock when the eval began


@dataclass(slots=True)
class _Draft:
    """The draft handed to the engine, waiting for its verify."""

    request_id: str
    n_past: int  # where the verify forward will start: the last sampled token's position
    decision: Decision
    tokens: int  # drafted tokens returned
    draft_ms: float


@dataclass(slots=True)
class _Request:
    request_id: str
    domain: str
    prompt_tokens: int
    steps: int = 0
    accepted: int = 0
    last_context: int = 0


@dataclass
class _Naming:
    """Caller-given request id and domain for the next request (``request()``)."""

    request_id: str | None = None
    domain: str = ""
    used: bool = False  # a request already took ``request_id``
    counter: Iterator[int] = field(default_factory=lambda: itertools.count(1))


class ControlledPromptLookup(LlamaDraftModel):
    """A llama-cpp-python draft model whose depth the controller sets per step.

    Parameters
    ----------
    agent
        The worker's :class:`~worker.sdk.agent.SpeculationAgent` (anything
        with ``decide``, ``observe`` and ``finish``); may be given to
        :meth:`attach` instead, since the agent's Hello describes the Llama
        that this draft model is built into.
    max_depth
        Most tokens one draft may hold (the Hello's ``drafter.max_depth``).
    max_ngram_size
        Longest suffix the prompt lookup matches (the binding's default, 2).
    worker_tag
        Prefix of the request ids the adapter makes up when the caller names none.
    keep_records
        Keep every credited step in :attr:`records` (tests, benchmarks).
    trim_prompt_logits
        Evaluate prompts with the last position's logits only (the binding
        computes them for every prompt token once a draft model is set, which
        costs SmolLM2 about a decode step per prompt; a verify forward always
        keeps all of them). Set False if you read prompt logprobs
        (``echo=True`` with ``logprobs``).
    shadows
        At depth 0, look up the chain anyway and report how it would have
        fared (shadow drafts, :mod:`worker.sdk.shadow`); False: no lookup at
        depth 0 at all.

    Usage::

        draft = ControlledPromptLookup(max_depth=8)
        llm = Llama(model_path=..., draft_model=draft, flash_attn=True, logits_all=True)
        hello = llamacpp_hello(llm, "worker-1", max_depth=8, calibration=calibrate(llm))
        draft.attach(llm, SpeculationAgent(hello, "controller:50051").start())
        with draft.request("req-1", domain="code"):
            text = llm.create_completion(prompt, max_tokens=128, temperature=0.0)
    """

    def __init__(self, agent: Decider | None = None, *, max_depth: int = 10, max_ngram_size: int = 2,
                 worker_tag: str = "llamacpp", keep_records: bool = False, trim_prompt_logits: bool = True,
                 shadows: bool = True, clock: Callable[[], float] = time.perf_counter) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        if max_ngram_size < 1:
            raise ValueError(f"max_ngram_size must be >= 1, got {max_ngram_size}")
        self.agent = agent
        self.max_depth = max_depth
        self.max_ngram_size = max_ngram_size
        self.worker_tag = worker_tag
        self.trim_prompt_logits = trim_prompt_logits
        self.stats = LookupStats()
        self.records: list[StepRecord] | None = [] if keep_records else None
        self._clock = clock
        self._llama = None
        self._inner_eval = None
        self._forwards: list[_Forward] = []  # evals since the last draft call
        self._pending: _Draft | None = None
        self._request: _Request | None = None
        self._naming = _Naming()
        self._step_ids = itertools.count(1)
        self._shadows = ShadowDrafts(max_depth) if shadows else None

    # ------------------------------------------------------------ set-up
    def attach(self, llama, agent: Decider | None = None) -> "ControlledPromptLookup":
        """Time ``llama``'s forwards (its ``eval``, wrapped on this instance only)
        and start asking ``agent`` (or the one given at construction).

        ``llama`` must have been built with ``draft_model=self``, ``flash_attn=True``
        and ``logits_all=True`` (:func:`check_lossless_setup` says why)."""
        if agent is not None:
            self.agent = agent
        if self.agent is None:
            raise ValueError("no agent: pass the worker's SpeculationAgent to attach(llama, agent)")
        if getattr(llama, "draft_model", None) is not self:
            raise ValueError("llama.draft_model is not this adapter: build it with Llama(..., draft_model=adapter)")
        if self._llama is not None:
            raise ValueError("this adapter is already attached to a Llama; make one adapter per Llama")
        check_lossless_setup(llama)
        inner = llama.eval
        forwards = self._forwards
        trim = self.trim_prompt_logits and hasattr(llama, "_logits_all")

        def timed_eval(tokens: Sequence[int]) -> None:
            n_past = llama.n_tokens
            pending = self._pending
            verify = pending is not None and n_past == pending.n_past and len(tokens) <= 1 + pending.tokens
            t0 = self._clock()
            if verify or not trim:
                inner(tokens)
            else:
                # A prompt: only its last position's logits are sampled from. The binding
                # would compute and copy the LM head for every prompt token (a draft model
                # turns logits_all on), about a decode step's worth per prompt here.
                llama._logits_all = False
                try:
                    inner(tokens)
                finally:
                    llama._logits_all = True
            forwards.append(_Forward(n_past, len(tokens), t0))
            if len(forwards) > 8:  # evals outside generate (embeddings, a caller's own): keep the newest
                del forwards[:-8]

        llama.eval = timed_eval
        self._llama, self._inner_eval = llama, inner
        return self

    def detach(self) -> None:
        """Give ``llama`` its own ``eval`` back and close the open request."""
        self.end_request()
        if self._llama is not None:
            del self._llama.eval  # the instance attribute; the class's method shows again
            self._llama = self._inner_eval = None

    @contextlib.contextmanager
    def request(self, request_id: str, domain: str = "") -> Iterator[None]:
        """Name the next request the engine runs (``domain`` tags it for drift
        strata); on exit the request is reported finished."""
        self.end_request()
        self._naming.request_id, self._naming.domain, self._naming.used = request_id, domain, False
        try:
            yield
        finally:
            self.end_request()
            self._naming.request_id, self._naming.domain = None, ""

    def end_request(self) -> None:
        """Report the open request finished (its last step stays uncredited)."""
        req = self._request
        if req is None:
            return
        if self._pending is not None:
            self.stats.unobserved_steps += 1
        self._pending = None
        self._request = None
        if self._shadows is not None:  # its last step is never credited: nothing to judge them by
            self._shadows.drop(req.request_id)
        self._forwards.clear()  # the last verify belongs to the request that ended
        self.agent.finish(RequestSummary(
            request_id=req.request_id,
            generated_tokens=max(0, req.last_context - req.prompt_tokens),
            steps=req.steps,
            accepted_tokens=req.accepted,
            timestamp=time.time(),
        ))

    # --------------------------------------------------- the engine's call
    def __call__(self, input_ids: npt.NDArray[np.intc], /, **kwargs) -> npt.NDArray[np.intc]:
        # input_ids: (kept + 1,) — the KV cache the engine kept plus the token it just sampled
        if self._llama is None:
            raise RuntimeError("ControlledPromptLookup.attach(llama) was not called: the adapter times the "
                               "engine's forwards and reads what it kept from the Llama it drafts for")
        n_past = len(input_ids) - 1  # where the next verify forward starts
        self._credit(input_ids, self._clock())
        req = self._request
        req.last_context = len(input_ids)

        t0 = self._clock()
        decision = self.agent.decide(req.request_id, n_past, 1)
        depth = min(decision.depth, self.max_depth)
        if depth > 0:
            self.stats.lookup_calls += 1
            found = LlamaPromptLookupDecoding.find_candidate_pred_tokens(
                input_ids=input_ids, max_ngram_size=self.max_ngram_size, num_pred_tokens=depth)
            draft = np.array(found, dtype=np.intc)  # a copy: ``found`` is a view of the engine's buffer
            if len(draft) == 0:
                self.stats.empty_offers += 1
        else:
            draft = np.empty(0, dtype=np.intc)
        self._pending = _Draft(req.request_id, n_past, decision, len(draft), (self._clock() - t0) * 1e3)
        if self._shadows is not None and depth > 0:
            self._shadows.drop(req.request_id)  # it drafts: its verified tokens are the evidence
        elif self._shadows is not None and self._shadows.wants(req.request_id):  # after the draft's clock
            self.stats.shadow_lookups += 1
            found = LlamaPromptLookupDecoding.find_candidate_pred_tokens(
                input_ids=input_ids, max_ngram_size=self.max_ngram_size, num_pred_tokens=self.max_depth)
            self._shadows.start(req.request_id, n_past, [int(t) for t in found])
        return draft

    # ------------------------------------------------------- bookkeeping
    def _credit(self, input_ids: npt.NDArray[np.intc], now: float) -> None:
        """Credit the step that ran since the last call, or start a request.

        The step's verify time runs from its forward's start to this call: the
        forward, sampling each position and cutting the cache back, and what the
        caller does between tokens — all a step costs the engine besides
        drafting. Timing the forward alone left out about 0.5 ms of each
        speculative step's sampling and rejection on SmolLM2, enough to make a
        one-token draft look break-even when it lost 5 % of wall-clock speed."""
        n_past = len(input_ids) - 1
        forwards, pending = list(self._forwards), self._pending
        self._forwards.clear()
        kept = self._llama.n_tokens
        verify = forwards[0] if len(forwards) == 1 else None
        if (pending is not None and self._request is not None and verify is not None
                and verify.n_past == pending.n_past and verify.tokens <= 1 + pending.tokens
                and pending.n_past + 1 <= kept == n_past <= pending.n_past + verify.tokens):
            # One forward from where the draft began, of at most the drafted tokens (the engine
            # trims a draft at the context's end): a verify. Kept tokens = last sample + accepted.
            # The step emitted the accepted drafts and the new sample: what follows its root.
            emitted = input_ids[pending.n_past + 1:].tolist() if self._shadows is not None else []
            self._report(pending, drafted=verify.tokens - 1, accepted=kept - pending.n_past - 1,
                         verify_ms=(now - verify.started) * 1e3, emitted=emitted)
            return
        # Anything else is a prompt being evaluated: a new request starts here.
        if pending is not None and self._request is not None:
            self.stats.unobserved_steps += 1
            self._pending = None
        self.stats.prompt_forwards += len(forwards)
        self._start_request(prompt_tokens=n_past)

    def _start_request(self, prompt_tokens: int) -> None:
        if self._request is not None:
            self.end_request()
        naming = self._naming
        if naming.request_id is None:
            rid = f"{self.worker_tag}-{next(naming.counter)}"
        elif naming.used:  # a second generate inside one ``request()`` block: its own id
            rid = f"{naming.request_id}.{next(naming.counter)}"
        else:
            rid, naming.used = naming.request_id, True
        self._request = _Request(rid, naming.domain, prompt_tokens)
        self.stats.requests += 1

    def _report(self, draft: _Draft, drafted: int, accepted: int, verify_ms: float, emitted: list[int]) -> None:
        req = self._request
        shadows = self._shadows.emitted(req.request_id, emitted) if self._shadows is not None else []
        self.stats.shadow_drafts += len(shadows)
        req.steps += 1
        req.accepted += accepted
        d = draft.decision
        self.stats.steps += 1
        self.stats.drafted_tokens += drafted
        self.stats.accepted_tokens += accepted
        self._pending = None
        self.agent.observe(StepTelemetry(
            step_id=next(self._step_ids),
            timestamp=time.time(),
            batch_size=1,
            draft_ms=draft.draft_ms,
            verify_ms=verify_ms,
            requests=[RequestTelemetry(
                request_id=req.request_id,
                context_len=draft.n_past,
                depth=drafted,
                width=1 if drafted else 0,
                nodes=drafted,
                accepted=accepted,
                domain=req.domain,
                requested_depth=d.depth,
                requested_width=d.width,
                requested_nodes=d.max_nodes,
                shadows=shadows,
            )],
        ))
        if self.records is not None:
            self.records.append(StepRecord(req.request_id, draft.n_past, d.depth, drafted, accepted,
                                           draft.draft_ms, verify_ms))


# ------------------------------------------------------------ start-up

def check_lossless_setup(llama) -> None:
    """Refuse a ``Llama`` whose speculative output would not be its plain output.

    Two settings of llama-cpp-python 0.3.x, measured on SmolLM2-135M (Q4_1, CPU):

    - ``flash_attn``: without it, a token's logits depend on how many tokens its
      forward held (max |Δlogit| 1.44 between one-at-a-time and blocks of 2-8,
      greedy argmax flipped), so drafting changes greedy output; with it they are
      bit-identical;
    - ``logits_all``: the binding sizes its logits buffer by ``n_batch`` unless
      ``logits_all=True`` is passed, but a draft model makes it keep every
      position's logits, so generation fails once the context passes ``n_batch``.
    """
    import llama_cpp

    params = getattr(llama, "context_params", None)
    if params is not None and params.flash_attn_type != llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED:
        raise ValueError(f"flash_attn = {params.flash_attn_type!r} (not enabled): llama.cpp's attention without it "
                         f"gives a token different logits in a multi-token forward, so drafted output is not the "
                         f"plain greedy output; build the Llama with flash_attn=True")
    scores = getattr(llama, "scores", None)
    if scores is not None and scores.shape[0] < llama.n_ctx():
        raise ValueError(f"logits_all = False: the Llama keeps logits for {scores.shape[0]} positions (n_batch) but "
                         f"speculation needs all n_ctx = {llama.n_ctx()}; build it with logits_all=True")


def calibrate(llama, max_tokens: int = 11, contexts: Sequence[int] = (64, 512), repeats: int = 5,
              filler: bytes = b"The quick brown fox jumps over the lazy dog. ") -> list[worker_pb2.VerifySample]:
    """Time ``llama``'s forwards of 1..``max_tokens`` tokens after each context length:
    the ``Hello.calibration`` a worker sends so the cost model starts from this
    machine's curve. Leaves the Llama empty (its next generate evaluates the prompt)."""
    eval_ = llama.eval
    if isinstance(llama.draft_model, ControlledPromptLookup) and llama.draft_model._inner_eval is not None:
        eval_ = llama.draft_model._inner_eval  # not the timed one: calibration is no step
    need = max(contexts) + max_tokens
    piece = llama.tokenize(filler, add_bos=False)
    ids = (piece * (need // max(1, len(piece)) + 1))[:need]
    out = []
    for kv in contexts:
        if kv + max_tokens > llama.n_ctx():
            raise ValueError(f"contexts: {kv} + {max_tokens} tokens exceeds the Llama's n_ctx ({llama.n_ctx()})")
        llama.reset()
        eval_(ids[:kv])
        for q in range(1, max_tokens + 1):
            times = []
            for _ in range(repeats + 1):  # the first is a warm-up
                llama.n_tokens = kv  # eval drops the KV cache past n_tokens first
                t0 = time.perf_counter()
                eval_(ids[kv:kv + q])
                times.append((time.perf_counter() - t0) * 1e3)
            out.append(worker_pb2.VerifySample(batch_size=1, batch_tokens=q, kv_tokens=kv,
                                               verify_ms=float(np.median(times[1:])), repeats=repeats))
    llama.reset()
    return out


def llamacpp_hello(llama, worker_id: str, *, max_depth: int, max_ngram_size: int = 2,
                   calibration: Sequence[worker_pb2.VerifySample] = ()) -> worker_pb2.Hello:
    """The Hello of a llama.cpp worker: its model, sizes from the GGUF metadata,
    the prompt-lookup drafter's limits (a chain of at most ``max_depth``)."""
    meta = dict(getattr(llama, "metadata", {}) or {})
    arch = meta.get("general.architecture", "llama")

    def num(key: str) -> float:
        try:
            return float(meta.get(f"{arch}.{key}", 0) or 0)
        except ValueError:
            return 0.0

    layers, heads, heads_kv, width = (num("block_count"), num("attention.head_count"),
                                      num("attention.head_count_kv"), num("embedding_length"))
    head_dim = width / heads if heads else 0.0
    path = Path(getattr(llama, "model_path", "") or "")
    model = meta.get("general.name") or path.stem or "unknown"
    return worker_pb2.Hello(
        worker_id=worker_id,
        engine=ENGINE_NAME,
        model=str(model),
        hardware=worker_pb2.Hardware(
            accelerator="cpu", count=1,
            # a quantized model reads its file's worth of weights per forward
            weight_bytes=float(path.stat().st_size) if path.is_file() else 0.0,
            kv_bytes_per_token=2 * layers * (heads_kv or heads) * head_dim * 2,  # K and V, f16 cache
            params=float(llama.n_params()) if hasattr(llama, "n_params") else 0.0),
        max_batch_size=1,
        verify_layout=worker_pb2.VERIFY_LAYOUT_PACKED,
        drafter=worker_pb2.Drafter(kind=worker_pb2.DRAFTER_KIND_NGRAM,
                                   version=f"llama.cpp-prompt-lookup-n{max_ngram_size}",
                                   max_depth=max_depth, max_width=1, max_tree_nodes=max_depth),
        calibration=list(calibration),
    )
