"""Drift alerts in the running controller: the monitor fed off the ingest path, its events fanned out.

The drift monitor costs several microseconds per request-step, and a busy
controller ingests 100 k request-steps a second, so it never runs on the
ingest path:

* :class:`MonitorFeed` — on ingest (a ``Controller.on_step_rows`` hook) it
  keeps a fixed subset of requests, chosen by a hash of the request id so
  every step of a kept request is kept, and buffers their rows (bounded,
  oldest dropped and counted). The housekeeping tick feeds the buffer to the
  monitor within a CPU budget; when the monitor cannot keep up the subset
  shrinks to what the budget affords (and grows back, never past
  ``sample_fraction``, when it can).
* :class:`DriftAlerting` — owns the monitor, the :class:`~controller.alerts.store.StateStore`
  and the sinks. Every monitor event (opened, resolved) and every
  acknowledgement goes to the store, to each WatchAlerts stream's own bounded
  queue (a watcher that falls behind is ended, never waited for), and to the
  sinks. At start it restores the monitor's baselines and open alerts from
  the store; it saves the baselines every ``store.save_interval_s``, soon
  after an alert opens or resolves, and at shutdown.

Several replicas (``state: {backend: redis}``) share their alerts through
``DriftAlerting.fleet`` (:class:`controller.fleet.alerts.FleetAlerts`, duck-typed
here so this module needs no Redis client): events this replica originates
also go to the fleet's log; events other replicas originate come back through
:meth:`DriftAlerting.mirror` into the local store and the WatchAlerts streams
(not the sinks: the replica that originated an event ran them); history and
acknowledgements are read fleet-wide. With one monitor per drafter version
fleet-wide (``state.drift_monitor: fleet``, :mod:`controller.fleet.drift_owner`)
the feed forwards every kept step to the fleet (``MonitorFeed.forward``) and
its monitor is fed, within the same budget, the steps of the versions this
replica runs, from every replica (``MonitorFeed.push_inbound``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections import Counter, deque
from dataclasses import asdict
from typing import Any, Callable, Sequence

from controller.alerts.proto import alert_to_proto
from controller.alerts.sinks import CommandSink, LogSink, Sink, WebhookSink
from controller.alerts.store import StateStore
from controller.config import AlertSettings, ServerConfig
from controller.drift.alerts import DriftAlert, Status
from controller.drift.monitor import AcceptanceDriftMonitor, MonitorConfig
from controller.protocol import TYPICAL, RequestRow
from protos.speculation.v1 import controller_pb2

log = logging.getLogger("specctl.alerting")

HASH_SPACE = 1 << 32
MIN_FRACTION = 1.0 / 4096


def hash_threshold(fraction: float) -> int:
    """Requests whose ``crc32(request_id)`` is below this are monitored."""
    return min(HASH_SPACE, max(1, int(round(fraction * HASH_SPACE))))


def is_sampled(request_id: str, fraction: float) -> bool:
    """Is this request in the monitored subset at ``fraction``? (The same answer on every step and restart.)

    Subsets nest: a smaller fraction keeps a part of a larger one's requests.

    >>> ids = [f"req-{i}" for i in range(10_000)]
    >>> half = {r for r in ids if is_sampled(r, 0.5)}
    >>> quarter = {r for r in ids if is_sampled(r, 0.25)}
    >>> quarter < half, round(len(half) / len(ids), 2), round(len(quarter) / len(ids), 2)
    (True, 0.5, 0.25)
    >>> all(is_sampled(r, 1.0) for r in ids)
    True
    """
    return zlib.crc32(request_id.encode()) < hash_threshold(fraction)


class MonitorFeed:
    """Hashed subset of requests, buffered on ingest, fed to the monitor within a CPU budget.

    Parameters
    ----------
    monitor : AcceptanceDriftMonitor
    sample_fraction : float
        Largest share of requests monitored.
    max_buffered : int
        Request-steps the buffer holds; beyond it the oldest steps are dropped.
    adapt_every_s : float
        How often (``wall`` seconds) the subset is resized to the monitor's measured cost.
    timer : callable or None
        CPU-budget clock; None (the default): the monitor's ``cpu_clock``, the thread's CPU time, so time the
        process spends waiting for a core (a busy machine) is not charged to the monitor, and the monitor's
        calibrations (``calibration_s``) are measured on the same clock as the budget they are taken out of.
    wall : callable
        Clock of the resizing windows.
    """

    def __init__(self, monitor: AcceptanceDriftMonitor, sample_fraction: float = 1.0, max_buffered: int = 10_000,
                 adapt_every_s: float = 1.0, timer: Callable[[], float] | None = None,
                 wall: Callable[[], float] = time.monotonic) -> None:
        if not 0.0 < sample_fraction <= 1.0:
            raise ValueError(f"sample_fraction must be in (0, 1], got {sample_fraction!r}")
        self.monitor = monitor
        self.max_fraction = sample_fraction
        self.fraction = sample_fraction
        self._threshold = hash_threshold(sample_fraction)
        self.max_buffered = max_buffered
        self.adapt_every_s = adapt_every_s
        self._timer = timer if timer is not None else monitor.cpu_clock
        self._wall = wall
        self._buffer: deque = deque()
        self.buffered = 0  # request-steps waiting
        self.dropped = 0  # request-steps dropped from a full buffer
        self.observed = 0  # request-steps the monitor has seen
        self.errors = 0
        # Monitor CPU seconds observing one request-step, calibrations left out, over the last few windows:
        # the price of a step, the one the fleet's owner prices its budget with too
        # (controller.fleet.drift_owner.CapacityEstimate: the same totals, observe_total_s over observed).
        # A calibration (tens of ms when baselines complete) does not grow with the steps sampled, so it is
        # not a price per step; the budget still pays for it (the debt drain() pays back).
        self.cost_s: float | None = None
        self._observe_sum = 0.0
        self._done_sum = 0
        self._overflowed = False
        self._debt = 0.0  # time used beyond the budget, paid back by later ticks
        self._window_start = wall()
        self._window_added = self._window_done = 0
        self._window_observe = self._window_budget = 0.0
        # Several replicas (controller.fleet.drift_owner): every kept step goes to ``forward`` (the
        # fleet's evidence outbox), and the monitor is fed ``inbound`` steps (its drafter versions'
        # outcomes from every replica, back from the fleet) instead.
        self.forward: Callable[[Any, str, float, Sequence[Any]], None] | None = None
        self.inbound: deque = deque()
        self.inbound_buffered = 0
        # Inbound steps kept at most (the oldest beyond it are shed): the fleet's owner sets it to what its
        # monitor works off in a few seconds; ``max_buffered`` until it does.
        self.inbound_limit = max_buffered
        self.forwarded = 0
        # Per drafter version, the fleet-wide hash threshold its monitor's owner published (the fraction its
        # monitor keeps up with): applied below this replica's own, so every replica keeps the same requests.
        self.version_thresholds: dict[tuple[str, str], int] = {}
        self.budget_total_s = 0.0  # CPU seconds of budget handed to drain() so far (the owner's capacity)
        # CPU seconds drain() spent so far, and the part of it observing request-steps (calibrations left
        # out): the rest — forwarding, calibrations, callbacks — is overhead the budget pays before any step.
        self.spent_total_s = 0.0
        self.observe_total_s = 0.0
        self.forward_total_s = 0.0  # ... and the part forwarding this replica's kept steps (``forwarded`` of them)
        self.drains = 0
        self.drains_cut = 0  # drains that ran out of budget with steps still queued: the monitor is the limit

    # ------------------------------------------------------------ ingest path
    def on_rows(self, state: Any, step: Any, rows: Sequence[RequestRow]) -> None:
        """``Controller.on_step_rows`` hook: keep the subset's rows of one applied step."""
        threshold = self._threshold
        if self.version_thresholds:
            limits = state.limits
            fleet = self.version_thresholds.get((str(limits.kind), str(limits.version)))
            if fleet is not None and fleet < threshold:
                threshold = fleet
        kept = []
        crc32 = zlib.crc32
        for row in rows:
            if row.acceptance_rule == TYPICAL:
                continue  # relaxed acceptance (a class's rule) is kept out of drift detection
            if threshold < HASH_SPACE and crc32(row.request_id.encode()) >= threshold:
                continue
            # (context_len, accepted, depth, ranks, candidates, domain) in observe_request's order
            kept.append((row.context_len, row.accepted, row.depth, row.accepted_rank or (), row.level_candidates or (),
                         row.domain))
        if not kept:
            return
        self._buffer.append((state.limits, state.worker_id, step.timestamp, kept))
        self.buffered += len(kept)
        self._window_added += len(kept)
        while self.buffered > self.max_buffered:
            dropped = self._buffer.popleft()[3]
            self.buffered -= len(dropped)
            self.dropped += len(dropped)
            self._overflowed = True  # resize at the next drain, not at the end of the window

    # -------------------------------------------------------- housekeeping
    def drain(self, budget_s: float) -> int:
        """Feed buffered steps to the monitor for about ``budget_s`` of time; returns request-steps fed.

        A step is never split; time spent past the budget (a recalibration
        inside the monitor) is paid back by skipping the next ticks' work.
        With :attr:`forward` set, every buffered step is handed on first (a
        cheap append) and the budget goes to :attr:`inbound` instead.
        """
        timer = self._timer
        start = timer()
        self.budget_total_s += budget_s
        if self.forward is not None and self._buffer:
            forwarding = timer()
            self._forward_all()
            self.forward_total_s += timer() - forwarding
        if self.forward is not None and self.inbound_buffered > self.inbound_limit:
            self._shed_inbound()
        allowed = budget_s - self._debt
        done = 0
        queue = self._buffer if self.forward is None else self.inbound
        if allowed > 0.0 and queue:
            observe = self.monitor.observe_request
            clock = self.monitor.clock
            observing = timer()
            calibrated = self.monitor.calibration_s
            while queue:
                item = queue.popleft()
                limits, worker, timestamp, kept = item[:4]
                now = timestamp or clock()
                try:
                    for ctx, accepted, depth, ranks, cands, domain in kept:
                        observe(limits, ctx, accepted, depth, ranks, cands, domain, now, worker)
                    if len(item) > 4 and item[4] is not None:
                        item[4]()
                except Exception:  # noqa: BLE001 - a monitor fault must not stop plans being pushed
                    self.errors += 1
                    if self.errors <= 3 or self.errors % 1000 == 0:
                        log.exception("drift monitor failed on a step of %s (%d failures)", worker, self.errors)
                done += len(kept)
                if timer() - start >= allowed:
                    break
            if self.forward is None:
                self.buffered -= done
            else:
                self.inbound_buffered -= done
            self.observed += done
            observe_s = max(0.0, timer() - observing - (self.monitor.calibration_s - calibrated))
            self.observe_total_s += observe_s
            self._window_observe += observe_s
        self.drains += 1
        if queue:
            self.drains_cut += 1
        elapsed = timer() - start
        self.spent_total_s += elapsed
        self._debt = max(0.0, self._debt + elapsed - budget_s)
        self._window_done += done
        self._window_budget += budget_s
        now = self._wall()
        if self._overflowed or now - self._window_start >= self.adapt_every_s:
            self._adapt(now)
        return done

    def _forward_all(self) -> None:
        forwarded = 0
        buffer, forward = self._buffer, self.forward
        while buffer:
            limits, worker, timestamp, kept = buffer.popleft()
            try:
                forward(limits, worker, timestamp, kept)
            except Exception:  # noqa: BLE001 - a fault on the way out must not stop plans being pushed
                self.errors += 1
                if self.errors <= 3 or self.errors % 1000 == 0:
                    log.exception("drift evidence of %s not forwarded (%d failures)", worker, self.errors)
            forwarded += len(kept)
        self.buffered -= forwarded
        self.forwarded += forwarded

    def set_version_fractions(self, fractions: dict[tuple[str, str], float]) -> None:
        """The fleet-wide sample fraction of each drafter version that has one (``(kind, version)`` keys);
        a version left out is sampled at this replica's own fraction."""
        self.version_thresholds = {key: hash_threshold(f) for key, f in fractions.items()}

    def push_inbound(self, limits: Any, worker: str, timestamp: float, kept: Sequence[Sequence[Any]],
                     after: Callable[[], None] | None = None) -> None:
        """Queue a step of another replica's (or this one's, back from the fleet) for the monitor; ``after``
        is called once it is fed (with :attr:`forward` set; the fleet's reader bounds what it queues)."""
        self.inbound.append((limits, worker, timestamp, kept, after))
        self.inbound_buffered += len(kept)

    def _shed_inbound(self) -> None:
        """Drop the oldest inbound steps beyond :attr:`inbound_limit`, as a full buffer does: evidence the monitor
        would reach only seconds late (a start-up burst admitted before the fleet's fraction settled took
        the fleet benchmark's owner ~40 s to work off, and a drop waited behind it). Their ``after`` is
        called, so the fleet's reader moves past them; they are counted as dropped."""
        inbound = self.inbound
        while self.inbound_buffered > self.inbound_limit and inbound:
            item = inbound.popleft()
            self.inbound_buffered -= len(item[3])
            self.dropped += len(item[3])
            if item[4] is not None:
                try:
                    item[4]()
                except Exception:  # noqa: BLE001 - the reader's bookkeeping must not stop plans being pushed
                    self.errors += 1
                    log.exception("drift evidence callback failed while shedding a backlog")

    def purge_inbound(self, drop: Callable[[Any], bool]) -> int:
        """Forget queued inbound steps whose limits ``drop`` selects (their ``after`` is not called);
        returns the request-steps forgotten."""
        kept, gone = deque(), 0
        for item in self.inbound:
            if drop(item[0]):
                gone += len(item[3])
            else:
                kept.append(item)
        self.inbound = kept
        self.inbound_buffered -= gone
        return gone

    def _adapt(self, now: float) -> None:
        """Resize the subset so that arrivals fill 80 % of the budget; drop a backlog it cannot work off.

        The cost per request-step (:attr:`cost_s`) is averaged over the last
        few windows and leaves calibrations out: a recalibration (tens of ms,
        once in a while) does not grow with the subset, so it is paid from the
        budget (the 20 % left over, the debt the next ticks pay back) rather
        than read as the price of every step.
        """
        self._observe_sum = 0.7 * self._observe_sum + self._window_observe
        self._done_sum = 0.7 * self._done_sum + self._window_done
        if self._done_sum >= 50:
            self.cost_s = self._observe_sum / self._done_sum
        if self.forward is not None:
            pass  # steps are forwarded whole each tick: the owner's reader bounds what its monitor is fed
        elif self.cost_s is None and self._overflowed:
            self.fraction = max(self.fraction / 4.0, MIN_FRACTION)  # no cost known yet: back off
            self._threshold = hash_threshold(self.fraction)
        elif self.cost_s:
            capacity = self._window_budget / self.cost_s  # request-steps the budget affords per window
            while self.buffered > capacity and self._buffer:  # stale by the time it would be fed
                dropped = self._buffer.popleft()[3]
                self.buffered -= len(dropped)
                self.dropped += len(dropped)
            if self._window_added:
                target = self.fraction * 0.8 * capacity / self._window_added
                target = min(self.max_fraction, 2.0 * self.fraction, max(target, self.fraction / 4.0, MIN_FRACTION))
                if not 0.8 <= target / self.fraction <= 1.25 or target == self.max_fraction != self.fraction:
                    log.info("drift monitor: %.1f µs per request-step, monitoring %.4f → %.4f of requests",
                             self.cost_s * 1e6, self.fraction, target)
                    self.fraction = target
                    self._threshold = hash_threshold(target)
        self._window_start = now
        self._overflowed = False
        self._window_added = self._window_done = 0
        self._window_observe = self._window_budget = 0.0

    def stats(self) -> dict[str, Any]:
        return {"sample_fraction": self.fraction, "buffered": self.buffered, "dropped": self.dropped,
                "observed": self.observed, "errors": self.errors, "forwarded": self.forwarded,
                "inbound": self.inbound_buffered,
                "fleet_fractions": {f"{k[0]}/{k[1]}": t / HASH_SPACE for k, t in self.version_thresholds.items()},
                "us_per_request_step": None if self.cost_s is None else self.cost_s * 1e6}


class WatcherOverflow(Exception):
    """A WatchAlerts stream fell further behind than its queue."""


class Watcher:
    """One WatchAlerts stream's bounded queue of events."""

    def __init__(self, maxsize: int, drafter_version: str = "") -> None:
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=maxsize)
        self.drafter_version = drafter_version
        self.overflowed = False
        self.closed = False

    def offer(self, msg: controller_pb2.DriftAlert) -> bool:
        """Queue an event unless filtered out; False when the queue is full (the watcher is then done)."""
        if self.overflowed or self.closed:
            return True
        if self.drafter_version and msg.drafter_version != self.drafter_version:
            return True
        try:
            self.queue.put_nowait(msg)
        except asyncio.QueueFull:
            self.overflowed = True
            return False
        return True

    def close(self) -> None:
        """End the stream once the queued events are sent."""
        self.closed = True
        try:
            self.queue.put_nowait(None)
        except asyncio.QueueFull:
            pass  # get() sees `closed` once the queue is drained

    async def get(self) -> controller_pb2.DriftAlert | None:
        """The next event; ``None`` when closed; raises :class:`WatcherOverflow` once behind."""
        if self.queue.empty():
            if self.overflowed:
                raise WatcherOverflow(f"fell more than {self.queue.maxsize} events behind")
            if self.closed:
                return None
        return await self.queue.get()


def build_sinks(settings: AlertSettings) -> list[Sink]:
    """The JSON log always; a webhook and a command when configured."""
    sinks: list[Sink] = [LogSink()]
    hook = settings.webhook
    if hook.urls:
        sinks.append(WebhookSink(hook.urls, hook.timeout_s, hook.retries, hook.events, hook.max_pending))
    cmd = settings.command
    if cmd.argv:
        sinks.append(CommandSink(cmd.argv, cmd.timeout_s, cmd.events, cmd.actions, cmd.max_concurrent))
    return sinks


def restore_monitor(store: StateStore, config: MonitorConfig,
                    clock: Callable[[], float] = time.time) -> tuple[AcceptanceDriftMonitor, list[DriftAlert]]:
    """A monitor with the store's baselines, and the store's open alerts (still to adopt).

    Baselines learned on other context buckets cannot be reused: they are
    dropped (logged) and the versions relearn.
    """
    saved = store.load_monitor().result()
    open_alerts = [DriftAlert.from_dict(d) for d in store.alerts(open_only=True).result()]
    next_id = max(saved["next_id"] if saved else 1, store.max_alert_number().result() + 1)
    versions = saved["versions"] if saved else []
    if versions and tuple(saved["config"].get("context_edges", ())) != config.context_edges:
        log.warning("store %s: baselines were learned on context buckets %s, the controller now uses %s: "
                    "every drafter version relearns", store.path, saved["config"].get("context_edges"),
                    list(config.context_edges))
        versions = []
    data = {"format": 1, "config": asdict(config), "next_id": next_id, "versions": versions, "alerts": []}
    return AcceptanceDriftMonitor.from_dict(data, clock=clock), open_alerts


class DriftAlerting:
    """The monitor, its store and its audiences (WatchAlerts streams, sinks) in one place.

    Parameters
    ----------
    monitor : AcceptanceDriftMonitor
    store : StateStore
    sinks : list
        Objects with ``emit(event, alert_dict)``, ``async close(timeout)``, ``stats()``.
    sample_fraction, cpu_fraction, max_buffered
        See :class:`MonitorFeed` and ``DriftSettings``.
    watch_queue_size : int
        Events a watcher may fall behind.
    save_interval_s : float
        Seconds between baseline saves.
    clock : callable
        Wall clock for acknowledgements and save times.
    """

    def __init__(self, monitor: AcceptanceDriftMonitor, store: StateStore, sinks: list[Sink], *,
                 sample_fraction: float = 1.0, cpu_fraction: float = 0.02, max_buffered: int = 10_000,
                 watch_queue_size: int = 1000, save_interval_s: float = 60.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.monitor = monitor
        self.store = store
        self.sinks = sinks
        self.cpu_fraction = cpu_fraction
        self.watch_queue_size = watch_queue_size
        self.save_interval_s = save_interval_s
        self.clock = clock
        self.feed = MonitorFeed(monitor, sample_fraction, max_buffered)
        self.watchers: set[Watcher] = set()
        self.counts: Counter = Counter()
        self._save_due = False
        self._last_save = time.monotonic()
        self._closed = False  # no new watches, no more ticks
        self._stopped = False  # closed: saved, sinks done, store closed
        # Alerts shared with other replicas (see the module docstring); None: this controller alone.
        self.fleet: Any = None
        monitor.listeners.append(self._publish)

    @classmethod
    def from_config(cls, config: ServerConfig, clock: Callable[[], float] = time.time) -> "DriftAlerting":
        """Open the store, restore the monitor and its open alerts, build the sinks."""
        drift = config.drift
        store = StateStore(config.store.path)
        try:
            monitor_config = MonitorConfig(context_edges=tuple(config.context_len_edges), **drift.monitor)
            monitor, open_alerts = restore_monitor(store, monitor_config, clock)
            alerting = cls(monitor, store, build_sinks(config.alerts), sample_fraction=drift.sample_fraction,
                           cpu_fraction=drift.cpu_fraction, max_buffered=drift.max_buffered,
                           watch_queue_size=config.alerts.watch_queue_size,
                           save_interval_s=config.store.save_interval_s, clock=clock)
        except BaseException:
            store.close()
            raise
        alerting.adopt(open_alerts)
        return alerting

    def attach(self, controller: Any) -> None:
        """Feed the controller's applied steps to the monitor."""
        controller.on_step_rows.append(self.feed.on_rows)

    def adopt(self, alerts: list[DriftAlert]) -> None:
        """Give restored open alerts back to the monitor; one whose stratum did not come back resolves."""
        for alert in alerts:
            if not self.monitor.adopt(alert):
                alert.status = Status.RESOLVED
                alert.resolved_at = self.clock()
                alert.resolution = "baseline not restored: the monitor relearns this drafter version"
                self._publish("resolved", alert)
        if alerts:
            log.info("restored %d open drift alert(s) from %s", len(self.monitor.open_alerts()), self.store.path)

    # ---------------------------------------------------------------- events
    def _publish(self, event: str, alert: DriftAlert) -> None:
        """Monitor listener (and acknowledgements): store, watchers, sinks."""
        self.counts[event] += 1
        data = alert.to_dict()
        at = self.clock()
        self.store.record_event(event, data, at)
        if self.fleet is not None:
            self.fleet.record(event, data, at)
        self._offer(alert_to_proto(alert, event))
        for sink in self.sinks:
            try:
                sink.emit(event, data)
            except Exception:  # noqa: BLE001 - one sink's fault must not stop the others
                self.counts["sink_errors"] += 1
                log.exception("alert sink %s failed on %s of %s", type(sink).__name__, event, alert.id)
        if event != "acknowledged":
            self._save_due = True  # an alert names its stratum: its baseline must be in the store too

    def _offer(self, msg: controller_pb2.DriftAlert) -> None:
        for watcher in list(self.watchers):
            if not watcher.offer(msg):
                self.counts["watchers_overflowed"] += 1
                log.warning("a WatchAlerts stream fell %d events behind and is ended", self.watch_queue_size)

    def mirror(self, event: str, alert: DriftAlert, at: float) -> None:
        """An event another replica originated: into the local store (history survives a Redis outage
        and a restart) and to the WatchAlerts streams; the sinks ran where it was originated."""
        self.counts["mirrored_" + event] += 1
        self.store.record_event(event, alert.to_dict(), at)
        self._offer(alert_to_proto(alert, event))

    async def acknowledge(self, alert_id: str, by: str) -> DriftAlert | None:
        """Record that ``by`` has taken the alert; ``None`` if no such alert. A second ack changes nothing."""
        alert = self.monitor.alerts.get(alert_id)
        if alert is None and self.fleet is not None:
            alert = await self.fleet.find(alert_id)  # another replica's, maybe not mirrored here yet
        if alert is None:
            stored = await asyncio.wrap_future(self.store.alert(alert_id))
            if stored is None:
                return None
            alert = DriftAlert.from_dict(stored)
        if alert.acked_at is None:
            alert.acked_at = self.clock()
            alert.acked_by = by
            self._publish("acknowledged", alert)
        return alert

    # --------------------------------------------------------------- watches
    def watch(self, drafter_version: str = "") -> Watcher:
        """Register a watcher before reading what exists, so no event falls between the two."""
        watcher = Watcher(self.watch_queue_size, drafter_version)
        if self._closed:
            watcher.close()
        self.watchers.add(watcher)
        return watcher

    def unwatch(self, watcher: Watcher) -> None:
        self.watchers.discard(watcher)

    async def existing(self, include_history: bool = False, open_only: bool = False,
                       drafter_version: str = "") -> list[DriftAlert]:
        """Alerts known now, oldest first: the monitor's, plus the store's history when asked.

        With a fleet: the fleet's alerts this replica has seen too, and the history is the fleet's laid
        over the local store's (which mirrors what this replica saw: it still answers while the fleet
        store does not, and keeps what a Redis that lost its data forgot)."""
        known: dict[str, DriftAlert] = {}
        if include_history:
            # With a fleet, resolved ones too: the fleet's "resolved" must replace a local "open" it missed.
            stored = open_only and self.fleet is None
            for d in await asyncio.wrap_future(self.store.alerts(stored, drafter_version)):
                known[d["id"]] = DriftAlert.from_dict(d)
            history = await self.fleet.history(False, drafter_version) if self.fleet is not None else None
            for d in history or ():
                known[d["id"]] = DriftAlert.from_dict(d)
        if self.fleet is not None:
            known.update(self.fleet.seen())
        known.update(self.monitor.alerts)  # the live objects are the newest
        alerts = [a for a in known.values()
                  if (not open_only or a.is_open) and (not drafter_version or a.drafter_version == drafter_version)]
        return sorted(alerts, key=lambda a: (a.opened_at, a.id))

    # ---------------------------------------------------------- housekeeping
    def tick(self, tick_s: float) -> None:
        """Housekeeping: feed the monitor for ``cpu_fraction`` of the tick; save baselines when due."""
        if self._closed:
            return
        try:
            self.feed.drain(tick_s * self.cpu_fraction)
            if self._save_due or time.monotonic() - self._last_save >= self.save_interval_s:
                self.save()
        except Exception:  # noqa: BLE001 - the housekeeping loop also pushes plans: it must go on
            self.counts["tick_errors"] += 1
            log.exception("drift alerting tick failed")

    def save(self) -> None:
        """Queue the monitor's baselines for the store."""
        self._save_due = False
        self._last_save = time.monotonic()
        self.store.save_monitor(self.monitor.to_dict(alerts=False), self.clock())

    def stats(self) -> dict[str, Any]:
        return {"events": dict(self.counts), "watchers": len(self.watchers), "feed": self.feed.stats(),
                "open_alerts": len(self.monitor.open_alerts()), "store_write_errors": self.store.write_errors,
                "sinks": {type(s).__name__: s.stats() for s in self.sinks}}

    def end_watches(self) -> None:
        """End every WatchAlerts stream once its queued events are sent; no new watch starts."""
        self._closed = True
        for watcher in list(self.watchers):
            watcher.close()

    async def finish_watches(self, timeout: float = 1.0) -> None:
        """End every WatchAlerts stream and wait (up to ``timeout``) until they have ended,
        so that stopping the server does not cut them off with UNAVAILABLE."""
        self.end_watches()
        deadline = time.monotonic() + timeout
        while self.watchers and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def close(self, drain_s: float = 1.0, sink_timeout_s: float = 5.0) -> None:
        """Feed what is buffered (up to ``drain_s``), save the baselines, let the sinks finish, close the store."""
        if self._stopped:
            return
        self._stopped = True
        self.end_watches()
        self.feed.drain(drain_s)
        self.save()
        for sink in self.sinks:
            await sink.close(sink_timeout_s)
        await asyncio.to_thread(self.store.close)
