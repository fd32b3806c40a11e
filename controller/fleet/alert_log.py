"""Drift alerts every replica sees: one event stream, the latest state per alert, fleet-unique ids.

Keys (under the fleet prefix):

* ``alerts:events`` — a Redis stream, one entry per event (``opened``,
  ``resolved``, ``acknowledged``, ...) with the alert as it was then, the
  replica it came from and an event id for de-duplication; trimmed to about
  ``maxlen`` entries;
* ``alerts:state`` — hash alert id -> the alert's latest dict (JSON), written
  by the replica that owns the alert's stratum (its lease holder:
  :mod:`controller.fleet.leases`), so its events arrive in order;
* ``alerts:acks`` — hash alert id -> ``{"acked_at", "acked_by"}``, written with
  HSETNX by whichever replica takes the ``AckAlert`` call: the first
  acknowledgement wins, as on one controller, and an ack never races the
  owner's state writes (it lives apart, and :meth:`AlertLog.history` joins them);
* ``alerts:next`` — the id counter, handed out in blocks (:class:`AlertIds`)
  so that opening an alert never waits for Redis.

Writing (:meth:`AlertLog.record`) queues; :meth:`AlertLog.flush` on a store
thread sends the queue in one pipeline. :class:`AlertFeed` follows the
stream on a thread of its own (a blocking XREAD on its own connection) and
hands every event from another replica to a callback: the integration
mirrors it into the local alert store and the WatchAlerts streams.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable

import redis

from controller.fleet.store import FleetStore

log = logging.getLogger("specctl.fleet")


@dataclass(frozen=True)
class AlertEvent:
    """One entry of the fleet's alert stream."""

    stream_id: str
    event: str
    alert: dict[str, Any]
    at: float
    origin: str  # the replica (incarnation) that recorded it
    eid: str  # unique per recorded event: a resent entry has the same one


def _dumps(data: Any) -> str:
    """JSON of an alert dict (numpy scalars included, as the SQLite store writes them)."""
    return json.dumps(data, default=lambda o: o.item() if hasattr(o, "item") else str(o))


class AlertLog:
    """This replica's writer and reader of the fleet's alert log.

    Parameters
    ----------
    store : FleetStore
    maxlen : int
        Approximate length the event stream is trimmed to.
    max_queued : int
        Events kept for sending while Redis is down; beyond it the oldest
        are dropped (counted: the local store still has them).
    """

    def __init__(self, store: FleetStore, *, maxlen: int = 100_000, max_queued: int = 10_000) -> None:
        self.store = store
        self.maxlen = maxlen
        self.origin = store.incarnation
        self.events_key = store.key("alerts", "events")
        self.state_key = store.key("alerts", "state")
        self.acks_key = store.key("alerts", "acks")
        self.counts: Counter = Counter()
        self._lock = threading.Lock()
        self._queue: deque[tuple[str, str, dict[str, Any], float]] = deque()
        self._max_queued = max_queued
        self._next_eid = 0

    # ------------------------------------------------------- never blocking
    def record(self, event: str, alert: dict[str, Any], at: float) -> None:
        """Queue an event of an alert this replica owns (or an ack it took) for the next :meth:`flush`."""
        with self._lock:
            self._next_eid += 1
            self._queue.append((f"{self.origin}:{self._next_eid}", event, dict(alert), at))
            while len(self._queue) > self._max_queued:
                self._queue.popleft()
                self.counts["dropped"] += 1

    def queued(self) -> int:
        with self._lock:
            return len(self._queue)

    # ------------------------------------------------------- a store thread
    def flush(self) -> int:
        """Send the queued events (a store thread); the number sent. Raises
        :class:`~controller.fleet.store.StoreUnavailable`, and the events stay queued for the next try
        (the stream may then hold one twice: same ``eid``, which :class:`AlertFeed` skips)."""
        with self._lock:
            batch = list(self._queue)
        if not batch:
            return 0
        self.store.call("alert_log", lambda r: self._send(r, batch))
        sent = {item[0] for item in batch}
        with self._lock:
            # Only what was sent: record() may have appended (or trimmed) meanwhile.
            while self._queue and self._queue[0][0] in sent:
                self._queue.popleft()
            self.counts["sent"] += len(batch)
        return len(batch)

    def _send(self, client: redis.Redis, batch: list) -> None:
        pipe = client.pipeline(transaction=True)
        for eid, event, alert, at in batch:
            pipe.xadd(self.events_key, {"event": event, "at": repr(float(at)), "origin": self.origin, "eid": eid,
                                        "alert": _dumps(alert)}, maxlen=self.maxlen, approximate=True)
            alert_id = str(alert.get("id", ""))
            if not alert_id:
                continue
            if event == "acknowledged":
                pipe.hsetnx(self.acks_key, alert_id, json.dumps({"acked_at": alert.get("acked_at"),
                                                                  "acked_by": alert.get("acked_by", "")}))
            else:
                pipe.hset(self.state_key, alert_id, _dumps(alert))
        pipe.execute()

    def history(self, open_only: bool = False, drafter_version: str = "") -> list[dict[str, Any]]:
        """Every alert's latest state with its acknowledgement, oldest first (a store thread)."""
        def read(client: redis.Redis):
            pipe = client.pipeline(transaction=True)
            pipe.hgetall(self.state_key)
            pipe.hgetall(self.acks_key)
            return pipe.execute()

        states, acks = self.store.call("alert_history", read)
        out = []
        for raw_id, raw in states.items():
            alert = json.loads(raw)
            ack = acks.get(raw_id)
            if ack is not None:
                alert.update({k: v for k, v in json.loads(ack).items() if v is not None})
            if open_only and alert.get("status") != "open":
                continue
            if drafter_version and alert.get("drafter_version") != drafter_version:
                continue
            out.append(alert)
        return sorted(out, key=lambda a: (a.get("opened_at") or 0.0, str(a.get("id", ""))))

    def last_id(self) -> str:
        """The stream's newest entry id ("0-0" when empty): where a new follower starts (a store thread)."""
        def read(client: redis.Redis) -> str:
            newest = client.xrevrange(self.events_key, count=1)
            return newest[0][0].decode() if newest else "0-0"

        return self.store.call("alert_log", read)


REFILL_LUA = r"""
-- KEYS[1] the counter; ARGV: 1 block, 2 floor (highest number the caller reserved or saw)
local block, floor = tonumber(ARGV[1]), tonumber(ARGV[2])
local top = redis.call('INCRBY', KEYS[1], block)
if top - block < floor then
  top = floor + block
  redis.call('SET', KEYS[1], string.format('%d', top))
end
return top
"""


class AlertIds:
    """Fleet-unique alert numbers, reserved in blocks so that taking one never waits.

    A Redis that restarted without its data starts the counter again: a
    block is then reserved above the highest number this replica reserved
    or saw (:meth:`note`: its own alerts and the ones the feed brought), so
    an id is not handed out twice unless one was opened in the last moments
    before the loss and never reached this replica.

    Parameters
    ----------
    store : FleetStore
    block : int
        Numbers reserved per round trip.
    low : int
        :meth:`refill` reserves another block when fewer are left.
    """

    def __init__(self, store: FleetStore, block: int = 64, low: int = 16) -> None:
        self.store = store
        self.key = store.key("alerts", "next")
        self.block = block
        self.low = low
        self._lock = threading.Lock()
        self._free: deque[int] = deque()
        self._floor = 0  # the highest number this replica reserved or saw: a Redis that lost its count restarts above
        self._refill = store.script(REFILL_LUA)

    def note(self, number: int) -> None:
        """An alert number seen (this replica's or another's): blocks reserved later are above it even if
        Redis lost the counter."""
        with self._lock:
            self._floor = max(self._floor, int(number))

    def take(self) -> int | None:
        """A number no other replica gets, or None when none is reserved (Redis unreachable since start)."""
        with self._lock:
            return self._free.popleft() if self._free else None

    def refill(self) -> None:
        """Reserve a block when running low (a store thread; raises :class:`~controller.fleet.store.StoreUnavailable`)."""
        with self._lock:
            if len(self._free) >= self.low:
                return
        with self._lock:
            floor = self._floor
        top = int(self.store.call("alert_ids", lambda r: self._refill(keys=[self.key], args=[self.block, floor],
                                                                      client=r)))
        with self._lock:
            self._free.extend(range(top - self.block + 1, top + 1))
            self._floor = max(self._floor, top)

    def at_least(self, number: int) -> None:
        """Make the counter pass ``number`` (ids restored from a local store must not be handed out again)."""
        lua = "local v = tonumber(redis.call('GET', KEYS[1]) or '0') if v < tonumber(ARGV[1]) then " \
              "redis.call('SET', KEYS[1], ARGV[1]) end return 1"
        self.store.call("alert_ids", lambda r: r.eval(lua, 1, self.key, int(number)))


class AlertFeed:
    """Follows the alert stream on its own thread and connection.

    Parameters
    ----------
    store : FleetStore
        Gives the URL, the key and the timeouts (the feed makes its own
        client: a blocking XREAD must not hold a pooled connection).
    on_event : callable
        Called on the feed's thread with each :class:`AlertEvent` not from
        ``skip_origin``; hand it to the event loop with ``call_soon_threadsafe``.
    skip_origin : str
        The replica's own origin (its events are already local).
    block_ms : int
        Longest wait of one XREAD.
    """

    def __init__(self, store: FleetStore, on_event: Callable[[AlertEvent], None], *, skip_origin: str = "",
                 block_ms: int = 500, start_id: str | None = None) -> None:
        self.store = store
        self.key = store.key("alerts", "events")
        self.on_event = on_event
        self.skip_origin = skip_origin
        self.block_ms = block_ms
        self.last_id = start_id  # None: the stream's end when first connected
        self.counts: Counter = Counter()
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="specctl-alert-feed")
        self._client = redis.Redis.from_url(store.url, socket_timeout=block_ms / 1000 + store.op_timeout_s,
                                            socket_connect_timeout=store.connect_timeout_s)
        self.connected = False

    def start(self) -> "AlertFeed":
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        self._client.close()

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            try:
                if self.last_id is None:
                    newest = self._client.xrevrange(self.key, count=1)
                    self.last_id = newest[0][0].decode() if newest else "0-0"
                answer = self._client.xread({self.key: self.last_id}, count=256, block=self.block_ms)
                if not self.connected:
                    self.counts["connects"] += 1
                self.connected = True
                backoff = 0.1
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as err:
                if self.connected:
                    log.warning("alert feed lost the fleet store: %s", err)
                self.connected = False
                self.counts["errors"] += 1
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            for _, entries in answer or ():
                for raw_id, fields in entries:
                    self.last_id = raw_id.decode()
                    self._deliver(self.last_id, fields)

    def _deliver(self, stream_id: str, fields: dict[bytes, bytes]) -> None:
        try:
            event = AlertEvent(stream_id, fields[b"event"].decode(), json.loads(fields[b"alert"]),
                               float(fields[b"at"]), fields[b"origin"].decode(), fields[b"eid"].decode())
        except (KeyError, ValueError) as err:
            self.counts["unreadable"] += 1
            log.warning("alert feed: entry %s unreadable: %s", stream_id, err)
            return
        if event.eid in self._seen:
            self.counts["duplicates"] += 1
            return
        self._seen[event.eid] = None
        if len(self._seen) > 10_000:
            self._seen.popitem(last=False)
        if event.origin == self.skip_origin:
            self.counts["own"] += 1
            return
        self.counts["delivered"] += 1
        try:
            self.on_event(event)
        except Exception:  # noqa: BLE001 - the feed must outlive a faulty consumer
            self.counts["consumer_errors"] += 1
            log.exception("alert feed consumer failed on %s", stream_id)
