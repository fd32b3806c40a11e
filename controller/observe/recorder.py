"""Telemetry recording (``specctl serve --record FILE``) and reading it back.

The controller writes what it receives — every ``Hello``, every step report
and every ``RequestFinished``, valid or not — as gzip-compressed JSON lines,
one JSON object per line, in the order received::

    {"kind": "header", "format": "specctl-telemetry", "version": 1, "started_at": 1718000000.0}
    {"kind": "hello", "t": 12.5, "worker_id": "gpu-17", "hello": {...}}
    {"kind": "steps", "t": 12.6, "worker_id": "gpu-17", "dropped_steps": 0, "steps": [{...}, ...]}
    {"kind": "finished", "t": 12.9, "worker_id": "gpu-17", "finished": {...}}

``t`` is the controller's clock when the message arrived. Messages use the
``speculation.v1`` field names (``json_format`` for Hello; steps and finished
are written field by field, defaults omitted, which is much cheaper).

Buffering is bounded: :meth:`TelemetryRecorder.record` only enqueues the
received message (no serialisation on the caller's path) into a queue of
``max_pending`` entries; when the writer falls behind, new entries are
dropped and counted (``dropped``), never the caller blocked. A writer thread
serialises and compresses, and flushes every ``flush_interval_s`` with a
zlib sync flush, so a killed controller leaves a file readable up to its last
flush; :func:`read_recording` stops cleanly at a truncated end.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import queue
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

from google.protobuf import json_format

from protos.speculation.v1 import worker_pb2

log = logging.getLogger("specctl.recorder")

FORMAT = "specctl-telemetry"
VERSION = 1
_STOP = object()


class TelemetryRecorder:
    """Append received telemetry to a gzip JSONL file from a background thread.

    Parameters
    ----------
    path
        File to write (truncated first).
    clock
        Stamps each record (the controller's clock).
    max_pending
        Messages buffered between the caller and the writer.
    flush_interval_s
        Longest time between two flushes to disk while messages arrive.
    """

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.time, max_pending: int = 65536,
                 flush_interval_s: float = 1.0, compresslevel: int = 6) -> None:
        self.path = Path(path)
        self.clock = clock
        self.flush_interval_s = flush_interval_s
        self.dropped = 0
        self.written = 0
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = gzip.open(self.path, "wb", compresslevel=compresslevel)
        self._write_line({"kind": "header", "format": FORMAT, "version": VERSION, "started_at": time.time()})
        self._file.flush()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="specctl-recorder", daemon=True)
        self._thread.start()

    # -- the caller's side ---------------------------------------------------
    def _put(self, item: tuple) -> None:
        if self._closed:
            return
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1

    def hello(self, hello: worker_pb2.Hello) -> None:
        self._put(("hello", self.clock(), hello.worker_id, hello))

    def steps(self, worker_id: str, reports: worker_pb2.StepReports) -> None:
        self._put(("steps", self.clock(), worker_id, reports))

    def finished(self, worker_id: str, msg: worker_pb2.RequestFinished) -> None:
        self._put(("finished", self.clock(), worker_id, msg))

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, close the file (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout)
        if self.dropped:
            log.warning("recorder dropped %d messages (writer behind)", self.dropped)

    # -- the writer thread ---------------------------------------------------
    def _write_line(self, obj: dict) -> None:
        self._file.write(json.dumps(obj, separators=(",", ":")).encode() + b"\n")

    def _run(self) -> None:
        last_flush = time.monotonic()
        dirty = False
        try:
            while True:
                try:
                    item = self._queue.get(timeout=self.flush_interval_s)
                except queue.Empty:
                    item = None
                if item is _STOP:
                    break
                if item is not None:
                    try:
                        self._write_line(to_record(*item))
                        self.written += 1
                        dirty = True
                    except Exception:  # noqa: BLE001 - one bad message must not stop the recording
                        log.exception("cannot record a %s message", item[0])
                if dirty and time.monotonic() - last_flush >= self.flush_interval_s:
                    self._file.flush()  # zlib sync flush: readable up to here
                    last_flush, dirty = time.monotonic(), False
        finally:
            self._file.close()


# ------------------------------------------------------------------ encoding
def to_record(kind: str, t: float, worker_id: str, msg) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": kind, "t": t, "worker_id": worker_id}
    if kind == "hello":
        out["hello"] = json_format.MessageToDict(msg, preserving_proto_field_name=True)
    elif kind == "steps":
        out["dropped_steps"] = msg.dropped_steps
        out["steps"] = [step_to_dict(s) for s in msg.steps]
    elif kind == "finished":
        out["finished"] = {"request_id": msg.request_id, "generated_tokens": msg.generated_tokens,
                           "steps": msg.steps, "accepted_tokens": msg.accepted_tokens, "timestamp": msg.timestamp}
    return out


def step_to_dict(step: worker_pb2.StepReport) -> dict[str, Any]:
    requests = []
    for r in step.requests:
        d: dict[str, Any] = {"request_id": r.request_id, "context_len": r.context_len}
        if r.depth:
            d.update(depth=r.depth, width=r.width, nodes=r.nodes, accepted=r.accepted)
        if r.accepted_rank:
            d["accepted_rank"] = list(r.accepted_rank)
            d["level_candidates"] = list(r.level_candidates)
        if r.draft_confidence:
            d["draft_confidence"] = [round(c, 6) for c in r.draft_confidence]
        if r.domain:
            d["domain"] = r.domain
        for name in ("requested_depth", "requested_width", "requested_nodes", "caught_up_tokens", "request_class",
                     "acceptance_rule"):
            if getattr(r, name):
                d[name] = getattr(r, name)
        if r.shadows:
            d["shadows"] = [{"context_len": s.context_len, "requested_depth": s.requested_depth, "depth": s.depth,
                             "accepted": s.accepted} for s in r.shadows]
        requests.append(d)
    out = {"step_id": step.step_id, "timestamp": step.timestamp, "batch_size": step.batch_size,
           "draft_ms": step.draft_ms, "verify_ms": step.verify_ms, "requests": requests}
    if step.catch_up_ms:
        out["catch_up_ms"] = step.catch_up_ms
    return out


def step_from_dict(d: dict[str, Any]) -> worker_pb2.StepReport:
    step = worker_pb2.StepReport(step_id=d["step_id"], timestamp=d.get("timestamp", 0.0), batch_size=d["batch_size"],
                                 draft_ms=d.get("draft_ms", 0.0), verify_ms=d.get("verify_ms", 0.0),
                                 catch_up_ms=d.get("catch_up_ms", 0.0))
    for r in d.get("requests", ()):
        step.requests.add(**r)
    return step


def hello_from_dict(d: dict[str, Any]) -> worker_pb2.Hello:
    return json_format.ParseDict(d, worker_pb2.Hello())


def finished_from_dict(d: dict[str, Any]) -> worker_pb2.RequestFinished:
    return worker_pb2.RequestFinished(**d)


# ------------------------------------------------------------------- reading
def read_recording(path: str | Path) -> Iterator[dict[str, Any]]:
    """Records of a recording in order (the header included). A file cut short
    — a controller killed between two flushes — ends at its last whole line."""
    with gzip.open(path, "rb") as f:
        reader = io.BufferedReader(f)
        while True:
            try:
                line = reader.readline()
            except (EOFError, zlib.error, gzip.BadGzipFile) as err:
                log.info("%s ends early (%s): replaying what was flushed", path, err)
                return
            if not line:
                return
            if not line.endswith(b"\n"):
                return  # a partial last line
            yield json.loads(line)
