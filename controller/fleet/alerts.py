"""Drift alerts of several replicas: one alert per stratum fleet-wide, every replica sees all of them.

Each replica's drift monitor runs the drafter versions whose monitor lease
it holds, fed by every replica (:mod:`controller.fleet.drift_owner`; with
``state.drift_monitor: replica``, its own workers' request-steps of every
version, ``controller.alerts.alerting``). :class:`FleetAlerts` is that monitor's
``arbiter`` and the alerting's ``fleet``:

* **One alert per stratum.** A finding (a stratum's CUSUM or chi-square
  test fired) is offered to :meth:`FleetAlerts.claim`. If the fleet already
  has an open alert on that stratum (drafter kind/version/stratum label), the
  finding attaches to it quietly. Otherwise the replica asks for the
  stratum's lease (:class:`~controller.fleet.leases.LeaseBook`): holding it,
  it opens the alert under a fleet-wide id (:class:`~controller.fleet.alert_log.AlertIds`);
  not yet holding it, the finding waits (``pending_s``) while the lease loop
  tries to take it, and is then opened, or attached to the alert the
  holder opened meanwhile, or dropped. While Redis is down no lease can be
  taken: alerts wait, they are not doubled.
* **Resolution by the owner.** An alert is resolved by the replica holding
  its lease (:meth:`FleetAlerts.may_resolve`); another replica whose monitor
  finds the stratum quiet again asks for the lease instead and keeps the
  alert, so when the owner dies its lease passes to a replica that tracks
  the alert and can resolve it.
* **Visible everywhere.** Events this replica originates go to the fleet's
  log (:class:`~controller.fleet.alert_log.AlertLog`); the others' come in
  through the feed (:class:`~controller.fleet.alert_log.AlertFeed`) and are
  mirrored into the local store and the WatchAlerts streams
  (``DriftAlerting.mirror``); acknowledgements of alerts owned elsewhere
  reach the owner's live alert that way; history is read from the fleet.

Threads: the feed calls back on its own thread; everything else here runs
on the controller's event loop, and Redis round trips go through the
store's threads (:meth:`FleetAlerts.flush`, :meth:`FleetAlerts.refresh` and the
lease cycle are called from the replica's loops, offloaded).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from typing import Any, Callable

from controller.drift.alerts import DriftAlert
from controller.fleet.alert_log import AlertEvent, AlertFeed, AlertIds, AlertLog
from controller.fleet.leases import LeaseBook
from controller.fleet.store import FleetStore, StoreUnavailable

log = logging.getLogger("specctl.fleet")

SEEN_MAX = 2000  # fleet alerts remembered here (open ones and the latest resolved)


def lease_name(alert: DriftAlert) -> str:
    """The lease (and the fleet's one-alert slot) of an alert's stratum.

    >>> from controller.drift.alerts import Action, Severity
    >>> a = DriftAlert("drift-000007", "eagle", "v3", "ctx[1024,2048)", 1024, 2048, "", "cusum", 9.0, None, None,
    ...                1.2, [], [], [], [], -0.1, 0.0, 1.0, Severity.WARNING, Action.RETRAIN_HEADS)
    >>> lease_name(a)
    'eagle/v3/ctx[1024,2048)'
    """
    return f"{alert.drafter_kind}/{alert.drafter_version}/{alert.stratum}"


class FleetAlerts:
    """The fleet side of one replica's drift alerts.

    Parameters
    ----------
    store : FleetStore
    alerting : controller.alerts.alerting.DriftAlerting
        This replica's alerting; :meth:`attach` makes this object its monitor's
        ``arbiter`` and its ``fleet``.
    lease_ttl_s : float
        Lease length per stratum (``state.lease_ttl_s``).
    pending_s : float
        How long a finding waits for its stratum's lease before it is dropped
        (the monitor fires again if the drift persists).
    wake : callable
        Asks the replica to run the lease cycle and the log flush soon (a new
        lease is wanted, an event is queued); called on the loop.
    monotonic : callable
    """

    def __init__(self, store: FleetStore, alerting: Any, *, lease_ttl_s: float = 10.0, pending_s: float | None = None,
                 wake: Callable[[], None] = lambda: None, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.alerting = alerting
        self.monitor = alerting.monitor
        self.leases = LeaseBook(store, ttl_s=lease_ttl_s)
        self.ids = AlertIds(store)
        self.log = AlertLog(store)
        self.feed: AlertFeed | None = None
        self.pending_s = pending_s if pending_s is not None else 3 * lease_ttl_s
        self.wake = wake
        self.monotonic = monotonic
        self.counts: Counter = Counter()
        self.open_by_name: dict[str, DriftAlert] = {}  # the fleet's open alert per stratum, as seen here
        self._seen: OrderedDict[str, DriftAlert] = OrderedDict()  # fleet alerts by id, newest last
        self._pending: dict[str, tuple[DriftAlert, float]] = {}  # lease name -> (finding, give up at)
        self._ids_floor: int | None = None  # local store's largest id, to lift the fleet counter past
        self._loop: asyncio.AbstractEventLoop | None = None
        self.closed = False  # set at shutdown: events still in flight are not mirrored into a closing store

    def attach(self) -> None:
        """Become the monitor's arbiter and the alerting's fleet; remember the local ids to stay above."""
        self.monitor.arbiter = self
        self.alerting.fleet = self
        floor = 0
        for alert_id in self.monitor.alerts:
            number = alert_id.rpartition("-")[2]
            if number.isdigit():
                floor = max(floor, int(number))
        self._ids_floor = floor or None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Follow the fleet's alert stream (its own thread), handing events to ``loop``."""
        self._loop = loop
        self.feed = AlertFeed(self.store, self._from_feed_thread, skip_origin=self.store.incarnation).start()

    def stop(self) -> None:
        """Stop following (a blocking join of the feed's thread: call it off the loop)."""
        if self.feed is not None:
            self.feed.stop()

    # ----------------------------------------------------------- the arbiter
    def claim(self, alert: DriftAlert) -> DriftAlert | None:
        """A finding of this replica's monitor (see ``AcceptanceDriftMonitor.arbiter``)."""
        name = lease_name(alert)
        existing = self.open_by_name.get(name)
        if existing is not None and existing.is_open and existing.id != alert.id:
            self.counts["attached"] += 1
            return existing
        self.leases.want(name)
        if self.leases.holds(name):
            self._fleet_id(alert)
            self._remember(alert)
            self.counts["opened"] += 1
            return alert
        if name not in self._pending:
            self.counts["deferred"] += 1
        self._pending[name] = (alert, self.monotonic() + self.pending_s)
        self.wake()
        return None

    def may_resolve(self, alert: DriftAlert) -> bool:
        """True if this replica owns the alert's stratum (it then resolves it); else it asks for the lease
        (to take over from an owner that is gone) and keeps the alert."""
        name = lease_name(alert)
        if self.leases.holds(name):
            if self.open_by_name.get(name) is alert or getattr(self.open_by_name.get(name), "id", None) == alert.id:
                del self.open_by_name[name]
            self.leases.drop(name)  # released at the next lease cycle
            return True
        self.leases.want(name)
        self.counts["resolve_waits"] += 1
        return False

    def _fleet_id(self, alert: DriftAlert) -> None:
        """Give ``alert`` a fleet-unique id (from the fleet's counter; without one yet: this replica's name)."""
        number = self.ids.take()
        if number is not None:
            alert.id = f"drift-{number:06d}"
        else:
            self.counts["local_ids"] += 1
            alert.id = f"drift-{self.store.replica_id}-{alert.id.rpartition('-')[2]}"

    def _remember(self, alert: DriftAlert) -> None:
        number = alert.id.rpartition("-")[2]
        if number.isdigit():
            self.ids.note(int(number))
        if alert.is_open:
            self.open_by_name[lease_name(alert)] = alert
        self._seen[alert.id] = alert
        self._seen.move_to_end(alert.id)
        while len(self._seen) > SEEN_MAX:
            self._seen.popitem(last=False)

    def after_lease_cycle(self) -> None:
        """Settle deferred findings (on the loop, after each lease cycle): open the ones whose lease is now
        held, attach the ones another replica opened, drop the ones that waited too long."""
        now = self.monotonic()
        for name, (alert, give_up_at) in list(self._pending.items()):
            existing = self.open_by_name.get(name)
            if existing is not None and existing.is_open:
                self._drop_pending(name)
                self.monitor.adopt(existing)
                self.counts["attached"] += 1
            elif self.leases.holds(name):
                del self._pending[name]
                self._fleet_id(alert)
                if self.monitor.open_claimed(alert):
                    self._remember(alert)
                    self.counts["opened"] += 1
                else:  # its stratum moved on meanwhile (resolved, retired)
                    self.monitor.withdraw(alert)
                    self.leases.drop(name)
            elif now >= give_up_at:
                self._drop_pending(name)
                self.counts["deferred_dropped"] += 1

    def _drop_pending(self, name: str) -> None:
        """Forget a deferred finding: its stratum, kept out of the monitor's tests while it waited, rejoins them
        (a caller attaching another alert to it does so after this)."""
        alert, _ = self._pending.pop(name)
        self.leases.drop(name)
        self.monitor.withdraw(alert)

    # ------------------------------------------- a version's monitor moving
    def open_alerts_of(self, kind: str, version: str) -> list[DriftAlert]:
        """The fleet's open alerts on a drafter version, as seen here (the monitor that takes the version
        over attaches them to its strata)."""
        return [a for a in self.open_by_name.values()
                if a.is_open and a.drafter_kind == kind and a.drafter_version == version]

    def release_version(self, kind: str, version: str) -> None:
        """This replica no longer runs the version's monitor (:mod:`controller.fleet.drift_owner`): let go of
        its strata's leases and findings, so the replica that runs it now can open and resolve its alerts."""
        prefix = f"{kind}/{version}/"
        for name in [n for n in self.open_by_name if n.startswith(prefix)]:
            self.leases.drop(name)
        for name in [n for n in self._pending if n.startswith(prefix)]:
            self._drop_pending(name)
        self.wake()

    # ---------------------------------------------------------- store side
    def record(self, event: str, data: dict[str, Any], at: float) -> None:
        """An event this replica originated (``DriftAlerting._publish``): to the fleet's log."""
        self.log.record(event, data, at)
        if event != "acknowledged":
            alert = self._seen.get(data["id"])
            if alert is not None and not alert.is_open:
                current = self.open_by_name.get(lease_name(alert))
                if current is not None and current.id == alert.id:
                    del self.open_by_name[lease_name(alert)]
        self.wake()

    def flush(self) -> None:
        """Send queued events and keep a block of ids in reserve (a store thread; raises
        :class:`StoreUnavailable`, and what was not sent stays queued)."""
        if self._ids_floor is not None:
            self.ids.at_least(self._ids_floor)
            self._ids_floor = None
        self.ids.refill()
        self.log.flush()

    def cycle_leases(self) -> None:
        """The lease cycle (a store thread; raises :class:`StoreUnavailable`)."""
        self.leases.cycle()

    def read_open(self) -> list[dict[str, Any]]:
        """The fleet's alerts, with acknowledgements (a store thread)."""
        return self.log.history()

    def reconcile(self, history: list[dict[str, Any]]) -> None:
        """Take the fleet's alerts as read (on the loop, at start and now and then): learn its open ones,
        attach them where this replica's monitor can, and let go of alerts it resolved."""
        for data in history:
            try:
                alert = DriftAlert.from_dict(data)
            except (KeyError, ValueError, TypeError):
                self.counts["unreadable"] += 1
                continue
            mine = self.monitor.alerts.get(alert.id)
            if alert.is_open:
                if mine is None:
                    self._remember(alert)
                    self.monitor.adopt(alert)
                else:
                    self._merge_ack(mine, alert)
                    self._remember(mine)
                continue
            name = lease_name(alert)
            current = self.open_by_name.get(name)
            if current is not None and current.id == alert.id:
                del self.open_by_name[name]
            if mine is not None and mine.is_open:
                self.monitor.detach(alert.id, alert)
                self.alerting.mirror("resolved", mine, alert.resolved_at or time.time())
            self._remember(mine or alert)
        # An open alert here the fleet does not hold (from before the fleet, or a store that lost its
        # data) needs an owner to resolve it: ask for its lease.
        known = {d.get("id") for d in history}
        for alert in self.monitor.open_alerts():
            if alert.id not in known:
                self.leases.want(lease_name(alert))
                self._remember(alert)

    def seen(self) -> dict[str, DriftAlert]:
        """Fleet alerts seen here (open ones and the latest resolved), by id."""
        return dict(self._seen)

    async def history(self, open_only: bool = False, drafter_version: str = "") -> list[dict[str, Any]] | None:
        """The fleet's alert history, or None when the store does not answer (the caller uses its own)."""
        try:
            return await self.store.offload(lambda: self.log.history(open_only, drafter_version))
        except StoreUnavailable:
            self.counts["history_unavailable"] += 1
            return None

    async def find(self, alert_id: str) -> DriftAlert | None:
        """An alert of the fleet's by id (seen here, or read from the fleet)."""
        alert = self._seen.get(alert_id)
        if alert is not None:
            return alert
        history = await self.history()
        for data in history or ():
            if data.get("id") == alert_id:
                alert = DriftAlert.from_dict(data)
                self._remember(alert)
                return alert
        return None

    # --------------------------------------------------------------- feed
    def _from_feed_thread(self, event: AlertEvent) -> None:
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self.on_event, event)
            except RuntimeError:  # the loop closed meanwhile (shutdown): nothing left to mirror into
                pass

    def on_event(self, event: AlertEvent) -> None:
        """An event another replica originated (on the loop)."""
        if self.closed:
            return
        try:
            alert = DriftAlert.from_dict(event.alert)
        except (KeyError, ValueError, TypeError):
            self.counts["unreadable"] += 1
            return
        name = lease_name(alert)
        self.counts["feed_" + event.event] += 1
        if event.event == "opened":
            self._remember(alert)
            if name in self._pending:  # our finding on the same stratum: the holder's alert stands for it
                self._drop_pending(name)
            self.monitor.adopt(alert)
        elif event.event == "resolved":
            current = self.open_by_name.get(name)
            if current is not None and current.id == alert.id:
                del self.open_by_name[name]
            tracked = self.monitor.alerts.get(alert.id)
            self.monitor.detach(alert.id, alert)
            self.leases.drop(name)
            known = self._seen.get(alert.id)
            if known is not None and known is not tracked:
                known.status, known.resolved_at, known.resolution = alert.status, alert.resolved_at, alert.resolution
            self._remember(tracked or known or alert)
            alert = tracked or known or alert
        elif event.event == "acknowledged":
            for live in (self.monitor.alerts.get(alert.id), self._seen.get(alert.id)):
                if live is not None:
                    self._merge_ack(live, alert)
            alert = self.monitor.alerts.get(alert.id) or self._seen.get(alert.id) or alert
        self.alerting.mirror(event.event, alert, event.at)

    @staticmethod
    def _merge_ack(live: DriftAlert, other: DriftAlert) -> None:
        """The first acknowledgement wins, as on one controller."""
        if live.acked_at is None and other.acked_at is not None:
            live.acked_at, live.acked_by = other.acked_at, other.acked_by

    # ------------------------------------------------------------- status
    def stats(self) -> dict[str, Any]:
        return {"counts": dict(self.counts), "pending": len(self._pending), "open": len(self.open_by_name),
                "leases": self.leases.stats(), "queued": self.log.queued(),
                "feed": dict(self.feed.counts) if self.feed is not None else {},
                "feed_connected": bool(self.feed and self.feed.connected)}

