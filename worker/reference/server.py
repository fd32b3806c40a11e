"""The reference worker process: a real model, a drafter, the engine loop, a
``SpeculationAgent`` following the controller, and a small HTTP JSON
endpoint on loopback.

Endpoint (``--listen``, default ``127.0.0.1:8471``; stdlib HTTP, one thread
per connection, the engine runs on its own thread):

``POST /v1/generate``
    body ``{"prompt": "text"}`` (wrapped in the chat template) or
    ``{"prompt_ids": [ints]}`` (used as is), plus optional
    ``"max_new_tokens"`` (default 64), ``"domain"`` (telemetry tag),
    ``"request_id"``, ``"request_class"`` (a class of the controller's
    policy: its table and its acceptance rule; empty or unknown: the default
    class). Answers when the request is done:
    ``{"request_id", "text", "token_ids", "generated_tokens", "steps",
    "accepted_tokens", "queue_s", "ttft_s", "latency_s"}``.
``GET /v1/health``
    worker id, model, drafter kind/version, plan version, controller
    connection, batch occupancy, engine totals and the decision the agent
    would give now at batch sizes 1..max_batch.

The worker's Hello carries the drafter's kind, version (the heads' version
id), limits and trained context, and CPU "hardware" hints.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

from policies.table import Decision
from protos.speculation.v1 import worker_pb2
from worker.reference.engine.calibrate import VerifyTiming, calibrate_verify
from worker.reference.engine.engine import Engine, static_decide
from worker.sdk.security import ClientSecurity
from worker.reference.threads import inherit_threads

log = logging.getLogger("specctl.worker")

__all__ = ["ReferenceWorker", "WorkerOptions", "build_drafter", "make_hello", "parse_static", "run_worker"]

DRAFTER_KINDS = {
    "medusa": worker_pb2.DRAFTER_KIND_MEDUSA,
    "eagle": worker_pb2.DRAFTER_KIND_EAGLE,
    "ngram": worker_pb2.DRAFTER_KIND_NGRAM,
}


@dataclass
class WorkerOptions:
    model: str = "smollm2-135m"
    drafter: str = "eagle"  # none | ngram | medusa | eagle
    heads: str | None = None
    controller: str | None = None
    listen: str = "127.0.0.1:8471"
    worker_id: str = ""
    max_batch: int = 8
    fallback_depth: int = 3
    static: str = ""
    max_depth: int = 6
    max_width: int = 4
    max_tree_nodes: int = 24
    # EAGLE: a request switched on catches up on at most this many of the tokens it skipped
    # (0 = all; see EagleDrafter.catch_up_window: it trades acceptance for a bounded switch-on).
    catch_up_window: int = 0
    # Seconds between checks of the heads directory for a new version (0 = never):
    # a retraining job writes new heads there and the worker rolls to them.
    heads_poll_s: float = 0.0
    # TLS / mutual TLS and the bearer token, when the controller has them on.
    security: ClientSecurity = field(default_factory=ClientSecurity)
    # "tuned": row-count-aware CPU kernels for the target's linears (worker.reference.engine.kernels); "default": F.linear.
    kernels: str = "tuned"
    # Time the verify step at a grid of batch shapes before serving and send it in the
    # Hello (worker.reference.engine.calibrate): the controller's cost model starts from it.
    calibrate: bool = True
    # A step-cost table written by `specctl calibrate` (worker.reference.engine.step_costs): its verify
    # rows go out as the Hello's calibration instead of timing at start-up.
    calibration: str = ""
    # "packed": the verify forward's matrix products run on each row's real entries only
    # (worker.reference.engine.packing); "padded": every row pays for the widest block.
    verify_layout: str = "packed"


def parse_static(text: str, default: Decision) -> Decision:
    """``"4"`` -> chain(4), ``"3x2"`` -> Decision(3, 2, 6), ``"3x2:5"`` -> Decision(3, 2, 5), ``"0"`` -> off.

    >>> parse_static("3x2:5", Decision.off())
    Decision(depth=3, width=2, max_nodes=5)
    """
    if not text:
        return default
    shape, _, nodes = text.partition(":")
    depth, _, width = shape.partition("x")
    d, w = int(depth), int(width or 1)
    if d == 0:
        return Decision.off()
    return Decision(d, w, int(nodes) if nodes else d * w)


def build_drafter(kind: str, model, heads_dir: str | None, model_name: str, max_depth: int = 6,
                  max_width: int = 4, max_tree_nodes: int = 24, log_fn=print, catch_up_window: int = 0):
    """A drafter by name; trained heads come from ``heads_dir`` or the
    on-first-use cache (``worker.reference.heads.ensure_heads``). On a target with tuned
    kernels, the heads' layers are tuned too. ``catch_up_window`` (EAGLE only; 0 = all):
    the most skipped tokens a switch-on catches up on."""
    if catch_up_window < 0:
        raise ValueError(f"catch_up_window must be >= 0 tokens (0 = all), got {catch_up_window}")
    if kind in ("none", "", None):
        return None
    if kind == "ngram":
        from worker.reference.drafters.ngram import NgramDrafter

        return NgramDrafter(max_depth=max_depth, max_width=max_width, max_tree_nodes=max_tree_nodes)
    if kind in ("medusa", "eagle"):
        from worker.reference.heads import ensure_heads
        from worker.reference.heads.store import HeadsBundle

        from worker.reference.engine.kernels import DRAFT_ROW_GRID, is_tuned, tune_model

        directory = heads_dir or ensure_heads(kind, model_name, log=log_fn)
        bundle = HeadsBundle.load(directory, kind)
        if kind == "medusa":
            from worker.reference.drafters.medusa import MedusaDrafter

            drafter = MedusaDrafter(bundle, model, max_width=max_width, max_tree_nodes=max_tree_nodes)
        else:
            from worker.reference.drafters.eagle import EagleDrafter

            drafter = EagleDrafter(bundle, model, max_depth=max_depth, max_width=max_width,
                                   max_tree_nodes=max_tree_nodes, catch_up_window=catch_up_window or None)
        # Tuned kernels for the heads too, lossy ones allowed: the target verifies what they propose.
        if is_tuned(model):
            tune_model(drafter.layers, allow_lossy=True, rows=DRAFT_ROW_GRID, log=log_fn)
        return drafter
    raise ValueError(f"unknown drafter {kind!r}: expected none, ngram, medusa or eagle")


VERIFY_LAYOUTS = {"packed": worker_pb2.VERIFY_LAYOUT_PACKED, "padded": worker_pb2.VERIFY_LAYOUT_PADDED}


def engine_layout(model, verify_layout: str) -> str:
    """The layout an :class:`Engine` on ``model`` runs when asked for ``verify_layout``:
    ``"packed"`` only where the model's layers can be packed (``packing.install_packing``)."""
    if verify_layout not in VERIFY_LAYOUTS:
        raise ValueError(f"verify_layout must be one of {sorted(VERIFY_LAYOUTS)}, got {verify_layout!r}")
    from worker.reference.engine.packing import install_packing

    if verify_layout == "packed" and install_packing(getattr(model, model.base_model_prefix)) > 0:
        return "packed"
    return "padded"


def make_hello(worker_id: str, model_name: str, model, drafter, max_batch: int,
               calibration: Sequence[VerifyTiming] = (), verify_layout: str = "packed") -> worker_pb2.Hello:
    """The Hello of a reference worker; ``verify_layout`` is what its engine runs
    (``Engine.verify_layout``; :func:`engine_layout` before the engine exists)."""
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    itemsize = next(model.parameters()).element_size()
    hello = worker_pb2.Hello(
        worker_id=worker_id,
        engine="specctl-reference",
        model=model_name,
        hardware=worker_pb2.Hardware(accelerator="cpu", count=1, weight_bytes=float(params * itemsize),
                                     kv_bytes_per_token=float(2 * cfg.num_hidden_layers * heads * head_dim * itemsize),
                                     params=float(params)),
        max_batch_size=max_batch,
        verify_layout=VERIFY_LAYOUTS[verify_layout],
        calibration=[worker_pb2.VerifySample(batch_size=t.batch_size, batch_tokens=t.batch_tokens,
                                             kv_tokens=t.kv_tokens, verify_ms=t.verify_ms, repeats=t.repeats)
                     for t in calibration],
    )
    if drafter is not None and drafter.kind in DRAFTER_KINDS:
        lim = drafter.limits
        hello.drafter.CopyFrom(worker_pb2.Drafter(
            kind=DRAFTER_KINDS[drafter.kind], version=drafter.version, max_depth=lim.max_depth,
            max_width=lim.max_width, max_tree_nodes=lim.max_tree_nodes, trained_context_len=lim.trained_context_len,
            catch_up_window=lim.catch_up_window))
    else:  # plain decoding: the controller still sees steps (depth 0 everywhere)
        hello.drafter.CopyFrom(worker_pb2.Drafter(kind=worker_pb2.DRAFTER_KIND_NGRAM, version="none", max_depth=1,
                                                  max_width=1, max_tree_nodes=1))
    return hello


class ReferenceWorker:
    """Engine thread + agent + HTTP endpoint, usable in-process (demo, tests)."""

    def __init__(self, model, tokenizer, drafter, model_name: str, opts: WorkerOptions) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.opts = opts
        host, _, port = opts.listen.rpartition(":")
        self.worker_id = opts.worker_id or f"ref-{socket.gethostname()}-{port}"
        self.calibration: list[VerifyTiming] = []
        if opts.calibration:
            from worker.reference.engine.step_costs import load_calibration

            self.calibration = load_calibration(opts.calibration, model)  # refuses another model's table
            log.info("calibration from %s: %d verify shapes", opts.calibration, len(self.calibration))
        elif opts.controller and opts.calibrate:
            self.calibration = calibrate_verify(model, opts.max_batch, opts.max_tree_nodes, progress=False)
            log.info("calibrated verify at %d batch shapes", len(self.calibration))
        self.verify_layout = engine_layout(model, opts.verify_layout)
        self.hello = make_hello(self.worker_id, model_name, model, drafter, opts.max_batch, self.calibration,
                                self.verify_layout)
        self.agent = None
        fallback = Decision.chain(opts.fallback_depth) if drafter is not None else Decision.off()
        if opts.controller:
            from worker.sdk.agent import AgentOptions, SpeculationAgent

            self.agent = SpeculationAgent(self.hello, opts.controller, AgentOptions(fallback=fallback),
                                          channel_credentials=opts.security.channel_credentials(),
                                          token=opts.security.token or None)
            # The plan in force says which classes may be verified with typical acceptance.
            decide, observer, classes = self.agent.decide, self.agent, self.agent.acceptance_rule
        else:
            decide, observer, classes = static_decide(parse_static(opts.static, fallback)), None, None
        self.engine = Engine(model, drafter, decide, observer=observer, max_batch=opts.max_batch, classes=classes,
                             packed=self.verify_layout == "packed")
        self.model_name = model_name
        self.rollouts: list[tuple[float, str, str]] = []  # (time, old version, new version)
        self._heads_checked = time.monotonic()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.httpd: ThreadingHTTPServer | None = None
        self.started = time.time()

    # ------------------------------------------------------------ lifecycle
    def start(self) -> "ReferenceWorker":
        if self.agent is not None:
            self.agent.start()
        self._thread = threading.Thread(target=self._loop, name="specctl-engine", daemon=True)
        self._thread.start()
        host, _, port = self.opts.listen.rpartition(":")
        self.httpd = ThreadingHTTPServer((host or "127.0.0.1", int(port)), _handler(self))
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, name="specctl-http", daemon=True).start()
        return self

    @property
    def address(self) -> str:
        assert self.httpd is not None
        host, port = self.httpd.server_address[:2]
        return f"{host}:{port}"

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
        if self._thread is not None:
            self._thread.join(10)
        if self.agent is not None:
            self.agent.close()

    def _loop(self) -> None:
        inherit_threads()  # ``--threads`` for MKL too, which counts per thread
        torch.set_grad_enabled(False)
        while not self._stop.is_set():
            self._maybe_roll_heads()
            if not self.engine.has_work():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                self.engine.step()
            except Exception:  # noqa: BLE001 - a bad step must not kill the worker silently
                log.exception("engine step failed; failing the active requests")
                for row in list(self.engine.rows):
                    row.req.output.append(-1)
                    row.req.done.set()
                self.engine.rows.clear()
                from worker.reference.engine.kv import BatchKV

                self.engine.kv = BatchKV.empty(self.model)

    # ------------------------------------------------------------ roll-out
    def _maybe_roll_heads(self) -> None:
        """Between two engine steps: swap in heads a retraining job wrote.

        The heads' ``<kind>.json`` is written after the weights, so a version
        seen there is complete. Requests in flight keep going with the new
        heads: they draft from the next hidden state the engine hands the
        drafter (an EAGLE head sees only the context from the swap on), and
        the output stays exact since verification decides every token. The
        agent announces the new version on its live stream, so the
        controller starts a new baseline for it.
        """
        if self.opts.heads_poll_s <= 0 or not self.opts.heads or self.engine.drafter is None:
            return
        now = time.monotonic()
        if now - self._heads_checked < self.opts.heads_poll_s:
            return
        self._heads_checked = now
        old = self.engine.drafter
        version = _heads_version_on_disk(self.opts.heads, old.kind)
        if not version or version == old.version:
            return
        try:
            new = build_drafter(old.kind, self.model, self.opts.heads, self.model_name, self.opts.max_depth,
                                self.opts.max_width, self.opts.max_tree_nodes, log_fn=log.info,
                                catch_up_window=self.opts.catch_up_window)
        except (OSError, ValueError, RuntimeError) as err:  # a half-copied directory: try at the next poll
            log.warning("cannot load new %s heads from %s: %s", old.kind, self.opts.heads, err)
            return
        for row in self.engine.rows:
            old.release(row.req.request_id)
        self.engine.drafter = new
        self.hello = make_hello(self.worker_id, self.model_name, self.model, new, self.opts.max_batch,
                                self.calibration, self.engine.verify_layout)
        if self.agent is not None:
            self.agent.roll_drafter(self.hello.drafter)
        self.rollouts.append((time.time(), old.version, new.version))
        log.info("rolled %s heads %s -> %s", old.kind, old.version, new.version)

    # ------------------------------------------------------------ requests
    def encode(self, text: str) -> list[int]:
        from worker.reference.prompts import chat_ids

        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: send prompt_ids")
        return chat_ids(self.tokenizer, text)

    def generate(self, body: dict) -> dict:
        if "prompt_ids" in body:
            ids = [int(t) for t in body["prompt_ids"]]
        elif "prompt" in body:
            ids = self.encode(str(body["prompt"]))
        else:
            raise ValueError("body needs 'prompt' (text) or 'prompt_ids' (list of ints)")
        max_new = int(body.get("max_new_tokens", 64))
        if not 0 <= max_new <= 4096:
            raise ValueError(f"max_new_tokens {max_new} must be in 0..4096")
        req = self.engine.submit(ids, max_new, request_id=body.get("request_id") or None,
                                 domain=str(body.get("domain", "")),
                                 request_class=str(body.get("request_class", "")))
        self._wake.set()
        req.done.wait()
        if req.output and req.output[-1] == -1:
            raise RuntimeError("the engine failed while running this request")
        text = self.tokenizer.decode(req.output, skip_special_tokens=True) if self.tokenizer is not None else ""
        return {
            "request_id": req.request_id,
            "text": text,
            "token_ids": req.output,
            "generated_tokens": len(req.output),
            "steps": req.steps,
            "accepted_tokens": req.accepted_tokens,
            "queue_s": round(req.t_admit - req.t_submit, 4),
            "ttft_s": round(req.t_first_token - req.t_submit, 4) if req.output else None,
            "latency_s": round(req.t_done - req.t_submit, 4),
        }

    def health(self) -> dict:
        s = self.engine.stats
        d = self.hello.drafter
        decisions = {}
        if self.engine.drafter is not None:
            for b in range(1, self.opts.max_batch + 1):
                dec = self.engine.drafter.limits.clamp(self.engine.decide("probe", 256, b))
                decisions[str(b)] = [dec.depth, dec.width, dec.max_nodes]
        agent = self.agent
        return {
            "worker_id": self.worker_id,
            "model": self.hello.model,
            "drafter": self.opts.drafter,
            "drafter_version": d.version,
            "controller": self.opts.controller or "",
            "connected": bool(agent and agent.stats.connected),
            "plan_version": agent.plan_version if agent else 0,
            "active": len(self.engine.rows),
            "waiting": self.engine.waiting,
            "steps": s.steps,
            "tokens": s.tokens,
            "finished": s.finished,
            "mean_accepted": round(s.mean_accepted, 4),
            "draft_s": round(s.draft_s, 3),
            "verify_s": round(s.verify_s, 3),
            "uptime_s": round(time.time() - self.started, 1),
            "decisions_by_batch": decisions,
        }


def _handler(worker: ReferenceWorker):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # quiet: the load generator makes many requests
            log.debug("http: " + fmt, *args)

        def _send(self, code: int, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # noqa: N802
            if self.path.rstrip("/") in ("/v1/health", "/health"):
                self._send(200, worker.health())
            else:
                self._send(404, {"error": f"no route {self.path}; try POST /v1/generate or GET /v1/health"})

        def do_POST(self):  # noqa: N802
            if self.path.rstrip("/") != "/v1/generate":
                self._send(404, {"error": f"no route {self.path}; try POST /v1/generate"})
                return
            try:
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length) or b"{}")
                if not isinstance(body, dict):
                    raise ValueError("body must be a JSON object")
                self._send(200, worker.generate(body))
            except (ValueError, TypeError, json.JSONDecodeError) as err:
                self._send(400, {"error": str(err)})
            except Exception as err:  # noqa: BLE001
                self._send(500, {"error": f"{type(err).__name__}: {err}"})

    return Handler


def _heads_version_on_disk(directory: str, kind: str) -> str:
    try:
        return str(json.loads((Path(directory) / f"{kind}.json").read_text()).get("version", ""))
    except (OSError, ValueError):
        return ""


def load_worker(opts: WorkerOptions, log_fn=print) -> ReferenceWorker:
    from worker.reference.models import load_model

    lm = load_model(opts.model, tune_kernels=opts.kernels == "tuned", log=log_fn)
    for p in lm.model.parameters():
        p.requires_grad_(False)
    drafter = build_drafter(opts.drafter, lm.model, opts.heads, opts.model, opts.max_depth, opts.max_width,
                            opts.max_tree_nodes, log_fn=log_fn, catch_up_window=opts.catch_up_window)
    return ReferenceWorker(lm.model, lm.tokenizer, drafter, opts.model, opts)


def run_worker(opts: WorkerOptions) -> int:
    worker = load_worker(opts).start()
    d = worker.hello.drafter
    print(f"specctl worker {worker.worker_id}: model {opts.model}, drafter {opts.drafter} ({d.version}), "
          f"max batch {opts.max_batch}; controller {opts.controller or 'none (static decisions)'}; "
          f"HTTP on http://{worker.address}/v1/generate", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.is_set():
            stop.wait(1.0)
    finally:
        worker.stop()
    return 0
