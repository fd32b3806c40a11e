"""Where alert events go besides WatchAlerts streams: a log, webhooks, a command.

Every sink takes ``emit(event, alert)`` on the event loop — ``event`` is
``"opened"``, ``"resolved"`` or ``"acknowledged"`` and ``alert`` the
``DriftAlert.to_dict()`` of the alert at that moment — and must return at
once: delivery happens elsewhere (a thread for webhooks, a subprocess for
the command), failures are logged and counted, and a sink that falls behind
drops events (counted) rather than slow the controller down.

* :class:`LogSink` — one JSON line per event on logger ``specctl.alerts``
  (WARNING for opened, INFO otherwise);
* :class:`WebhookSink` — ``POST`` of ``{"event": ..., "alert": {...}}`` as
  JSON to each URL, with a timeout and retries;
* :class:`CommandSink` — runs a command (e.g. one that starts a retraining
  job) with the same JSON on stdin and ``SPECCTL_ALERT_*`` variables in its
  environment; it should start the job and return, the timeout kills it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from typing import Any, Iterable, Protocol

log = logging.getLogger("specctl.sinks")
alert_log = logging.getLogger("specctl.alerts")

ALERT_EVENTS = ("opened", "resolved", "acknowledged")


def event_json(event: str, alert: dict[str, Any]) -> bytes:
    """The body every sink delivers: ``{"event": ..., "alert": {...}}``."""
    return json.dumps({"event": event, "alert": alert}, default=_plain).encode()


def _plain(obj: Any) -> Any:
    return obj.item() if hasattr(obj, "item") else str(obj)


def alert_env(event: str, alert: dict[str, Any]) -> dict[str, str]:
    """``SPECCTL_ALERT_*`` variables describing the event for a command.

    >>> env = alert_env("opened", {"id": "drift-000003", "action": "RETRAIN_HEADS", "severity": "WARNING",
    ...                            "status": "OPEN", "drafter_kind": "eagle", "drafter_version": "v1",
    ...                            "stratum": "ctx[0,1024)", "domain": "", "detector": "cusum",
    ...                            "expected_tau_change": -0.12})
    >>> env["SPECCTL_ALERT_EVENT"], env["SPECCTL_ALERT_ACTION"], env["SPECCTL_ALERT_EXPECTED_TAU_CHANGE"]
    ('opened', 'RETRAIN_HEADS', '-0.12')
    """
    env = {"SPECCTL_ALERT_EVENT": event}
    for key in ("id", "action", "severity", "status", "drafter_kind", "drafter_version", "stratum", "domain",
                "detector", "expected_tau_change"):
        value = alert.get(key)
        env[f"SPECCTL_ALERT_{key.upper()}"] = "" if value is None else str(value)
    return env


class Sink(Protocol):
    def emit(self, event: str, alert: dict[str, Any]) -> None: ...

    async def close(self, timeout: float) -> None: ...

    def stats(self) -> dict[str, int]: ...


class LogSink:
    """Structured JSON log lines on ``specctl.alerts``."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()

    def emit(self, event: str, alert: dict[str, Any]) -> None:
        level = logging.WARNING if event == "opened" else logging.INFO
        alert_log.log(level, event_json(event, alert).decode())
        self.counts["logged"] += 1

    async def close(self, timeout: float) -> None:
        return None

    def stats(self) -> dict[str, int]:
        return dict(self.counts)


class WebhookSink:
    """POST every event of ``events`` to every URL, from one background thread.

    Parameters
    ----------
    urls : iterable of str
        ``http://`` or ``https://`` endpoints.
    timeout_s : float
        Per attempt (connect + response).
    retries : int
        Extra attempts after a failure, ``backoff_s`` × 2^k apart.
    events : iterable of str
        Which events are sent.
    max_pending : int
        Deliveries queued at most; beyond it new ones are dropped (counted).
    """

    def __init__(self, urls: Iterable[str], timeout_s: float = 5.0, retries: int = 2,
                 events: Iterable[str] = ALERT_EVENTS, max_pending: int = 1000, backoff_s: float = 0.5) -> None:
        self.urls = list(urls)
        self.timeout_s = timeout_s
        self.retries = retries
        self.events = frozenset(events)
        self.backoff_s = backoff_s
        self.counts: Counter = Counter()
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specctl-webhook", daemon=True)
        self._thread.start()

    def emit(self, event: str, alert: dict[str, Any]) -> None:
        if event not in self.events:
            return
        body = event_json(event, alert)
        for url in self.urls:
            try:
                self._queue.put_nowait((url, body, alert.get("id", "")))
            except queue.Full:
                self.counts["dropped"] += 1
                log.warning("webhook %s: %d deliveries pending, dropped %s of %s", url, self._queue.qsize(), event,
                            alert.get("id"))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._deliver(*item)

    def _deliver(self, url: str, body: bytes, alert_id: str) -> None:
        request = urllib.request.Request(url, data=body, method="POST",
                                         headers={"Content-Type": "application/json", "User-Agent": "specctl"})
        error = ""
        for attempt in range(self.retries + 1):
            if attempt:
                if self._stop.wait(self.backoff_s * 2 ** (attempt - 1)):
                    break  # closing: no more waiting
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    response.read()
                self.counts["sent"] += 1
                return
            except urllib.error.HTTPError as err:
                error = f"HTTP {err.code} {err.reason}"
            except (urllib.error.URLError, OSError, ValueError) as err:
                error = f"{type(err).__name__}: {getattr(err, 'reason', err)}"
        self.counts["failed"] += 1
        log.error("webhook %s: alert %s not delivered after %d attempt(s): %s", url, alert_id, attempt + 1, error)

    async def close(self, timeout: float) -> None:
        """Deliver what is queued within ``timeout``; the rest is given up (logged)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._queue.put_nowait(None)
                break
            except queue.Full:
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
        await asyncio.to_thread(self._thread.join, max(0.0, deadline - time.monotonic()))
        self._stop.set()  # a delivery still retrying gives up
        left = self._queue.qsize()
        if self._thread.is_alive() or left:
            log.error("webhook: closing with deliveries still pending (%d queued)", left)

    def stats(self) -> dict[str, int]:
        return dict(self.counts)


class CommandSink:
    """Run ``argv`` for every event of ``events`` whose action is in ``actions``.

    The event JSON goes to the command's stdin; ``SPECCTL_ALERT_*`` variables
    are added to the controller's environment. At most ``max_concurrent``
    commands run at once and ``max_pending`` wait; a command running past
    ``timeout_s`` is killed. Output (stdout and stderr, first 2 kB) is logged.
    """

    def __init__(self, argv: Iterable[str], timeout_s: float = 60.0, events: Iterable[str] = ("opened",),
                 actions: Iterable[str] = ("RETRAIN_HEADS", "EXTEND_TRAINING_CONTEXT", "INVESTIGATE"),
                 max_concurrent: int = 2, max_pending: int = 100) -> None:
        self.argv = list(argv)
        if not self.argv:
            raise ValueError("argv must name a command, got an empty list")
        self.timeout_s = timeout_s
        self.events = frozenset(events)
        self.actions = frozenset(actions)
        self.max_pending = max_pending
        self.counts: Counter = Counter()
        self._slots = asyncio.Semaphore(max_concurrent)
        self._tasks: set[asyncio.Task] = set()

    def emit(self, event: str, alert: dict[str, Any]) -> None:
        if event not in self.events or alert.get("action") not in self.actions:
            return
        if len(self._tasks) >= self.max_pending:
            self.counts["dropped"] += 1
            log.warning("command %s: %d runs pending, dropped %s of %s", self.argv[0], len(self._tasks), event,
                        alert.get("id"))
            return
        task = asyncio.get_running_loop().create_task(self._run(event, alert))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, event: str, alert: dict[str, Any]) -> None:
        async with self._slots:
            name, alert_id = self.argv[0], alert.get("id")
            try:
                proc = await asyncio.create_subprocess_exec(
                    *self.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.STDOUT, env={**os.environ, **alert_env(event, alert)})
            except OSError as err:
                self.counts["failed"] += 1
                log.error("command %s for alert %s could not start: %s", name, alert_id, err)
                return
            self.counts["started"] += 1
            try:
                output, _ = await asyncio.wait_for(proc.communicate(event_json(event, alert)), self.timeout_s)
            except (TimeoutError, asyncio.CancelledError) as err:
                proc.kill()
                await proc.wait()
                self.counts["timed_out"] += 1
                log.error("command %s for alert %s killed after %.1f s", name, alert_id, self.timeout_s)
                if isinstance(err, asyncio.CancelledError):
                    raise
                return
            text = output.decode(errors="replace")[:2048].strip()
            if proc.returncode == 0:
                self.counts["succeeded"] += 1
                log.info("command %s for alert %s (%s) done%s", name, alert_id, event, f": {text}" if text else "")
            else:
                self.counts["failed"] += 1
                log.error("command %s for alert %s exited %d: %s", name, alert_id, proc.returncode, text)

    async def close(self, timeout: float) -> None:
        """Let running commands finish within ``timeout``, then kill them."""
        if not self._tasks:
            return
        _, pending = await asyncio.wait(set(self._tasks), timeout=timeout)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)

    def stats(self) -> dict[str, int]:
        return dict(self.counts)
