"""Which replicas are alive and which one serves each worker, readable from every replica.

* ``replicas`` — sorted set replica -> expiry (ms, Redis's clock): a
  heartbeat pushes it ``ttl`` ahead; a replica past it is not alive.
  Redis's own clock decides, so replicas with skewed clocks agree on who is.
* ``replica-info`` — hash replica -> JSON (address, start time, workers).
* ``workers`` — hash worker id -> ``"<replica>|<since ms>"``: the replica whose
  Hello is newest wins (a worker that moved to another replica is not taken
  back by its old replica's late write), and only the replica named may
  remove it.

:meth:`Directory.assign` and :meth:`Directory.release` (on Hello and on the
stream's end) and :meth:`Directory.view` (GetStatus) never wait: they touch a
local table. :meth:`Directory.cycle`, on a store thread every couple of
seconds, sends the heartbeat and the changes, re-sends every assignment when
the heartbeat finds this replica missing (Redis lost its data, or this
replica was cut off past its ttl) and every ``resync_every`` cycles, and
refreshes the view when one was asked for.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import redis

from controller.fleet.store import FleetStore

HEARTBEAT_LUA = r"""
-- KEYS[1] replicas (zset), KEYS[2] replica info (hash); ARGV: 1 replica, 2 info JSON, 3 ttl ms
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local added = redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - 3600000)
for _, r in ipairs(dead) do
  redis.call('ZREM', KEYS[1], r)
  redis.call('HDEL', KEYS[2], r)
end
return added
"""

ASSIGN_LUA = r"""
-- KEYS[1] workers (hash); ARGV: 1 replica, then (worker, since ms, 'a' assign | 'r' release) triples
local me = ARGV[1]
local changed = 0
for i = 2, #ARGV, 3 do
  local worker, since, op = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2]
  local cur = redis.call('HGET', KEYS[1], worker)
  local owner, cur_since = nil, nil
  if cur then owner, cur_since = string.match(cur, '^(.*)|(%d+)$') end
  if op == 'a' then
    if not cur or since >= tonumber(cur_since) then
      redis.call('HSET', KEYS[1], worker, me .. '|' .. string.format('%d', since))
      changed = changed + 1
    end
  elseif cur and owner == me then
    redis.call('HDEL', KEYS[1], worker)
    changed = changed + 1
  end
end
return changed
"""

READ_LUA = r"""
-- KEYS[1] replicas, KEYS[2] replica info, KEYS[3] workers
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return {now, redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf'), redis.call('HGETALL', KEYS[2]),
        redis.call('HGETALL', KEYS[3])}
"""


@dataclass(frozen=True)
class FleetView:
    """The directory as read at ``read_at`` (monotonic, this replica)."""

    read_at: float
    live: frozenset[str]  # replicas alive by Redis's clock
    info: dict[str, dict[str, Any]] = field(default_factory=dict)  # replica -> its heartbeat info
    workers: dict[str, tuple[str, float]] = field(default_factory=dict)  # worker -> (replica, since s)

    def serving(self, worker_id: str) -> str | None:
        """The live replica serving ``worker_id``, or None (unknown, or its replica is gone)."""
        entry = self.workers.get(worker_id)
        return entry[0] if entry is not None and entry[0] in self.live else None


class Directory:
    """This replica's entry in the fleet directory.

    Parameters
    ----------
    store : FleetStore
    address : str
        Where workers reach this replica (``host:port``), shown to operators.
    ttl_s : float
        A replica without a heartbeat for this long is no longer alive.
    resync_every : int
        Cycles between full re-sends of this replica's assignments.
    clock : callable
        Wall clock (the ``since`` of an assignment is compared across replicas).
    """

    def __init__(self, store: FleetStore, address: str = "", *, ttl_s: float = 10.0, resync_every: int = 30,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.replica = store.replica_id
        self.address = address
        self.ttl_ms = int(ttl_s * 1000)
        self.resync_every = resync_every
        self.clock = clock
        self.monotonic = monotonic
        self.started_at = clock()
        self.keys = [store.key("replicas"), store.key("replica-info"), store.key("workers")]
        self.counts: Counter = Counter()
        self._heartbeat = store.script(HEARTBEAT_LUA)
        self._assign = store.script(ASSIGN_LUA)
        self._read = store.script(READ_LUA)
        self._lock = threading.Lock()
        self._serving: dict[str, int] = {}  # worker -> since ms (this replica's Hello)
        self._changes: dict[str, tuple[int, str]] = {}  # worker -> (since ms, 'a' | 'r') not yet sent
        self._cycles = 0
        self._view: FleetView | None = None
        self._view_wanted = True

    # ------------------------------------------------------- never blocking
    def assign(self, worker_id: str) -> None:
        """This replica serves ``worker_id`` from now (call on each accepted Hello)."""
        since = int(self.clock() * 1000)
        with self._lock:
            self._serving[worker_id] = since
            self._changes[worker_id] = (since, "a")

    def release(self, worker_id: str) -> None:
        """This replica no longer serves ``worker_id`` (its stream ended or expired)."""
        with self._lock:
            since = self._serving.pop(worker_id, None)
            if since is not None:
                self._changes[worker_id] = (since, "r")

    def view(self, max_age_s: float = 5.0) -> FleetView | None:
        """The last directory read (None before the first); asks the next cycle for a fresh one if older than
        ``max_age_s``."""
        with self._lock:
            view = self._view
            if view is None or self.monotonic() - view.read_at > max_age_s:
                self._view_wanted = True
            return view

    # ------------------------------------------------------- a store thread
    def cycle(self) -> None:
        """Heartbeat, assignment changes, and a view refresh when wanted (raises :class:`StoreUnavailable`;
        unsent changes are kept)."""
        with self._lock:
            self._cycles += 1
            changes, self._changes = self._changes, {}
            full = self._cycles % self.resync_every == 0
            serving = dict(self._serving)
            want_view = self._view_wanted
        info = json.dumps({"address": self.address, "started_at": self.started_at, "workers": len(serving),
                           "incarnation": self.store.incarnation})
        try:
            self.store.call("directory", lambda r: self._exchange(r, info, changes, serving, full, want_view))
        except Exception:
            with self._lock:  # newer changes made meanwhile win over the ones we failed to send
                for worker, change in changes.items():
                    self._changes.setdefault(worker, change)
            raise

    def _exchange(self, client: redis.Redis, info: str, changes: dict, serving: dict, full: bool,
                  want_view: bool) -> None:
        missing = bool(self._heartbeat(keys=self.keys[:2], args=[self.replica, info, self.ttl_ms], client=client))
        if missing:
            self.counts["rejoined"] += 1
        if missing or full:  # Redis lost us (or a periodic check): every assignment again
            changes = {**{w: (s, "a") for w, s in serving.items()}, **{w: c for w, c in changes.items()
                                                                       if c[1] == "r"}}
        if changes:
            args: list[Any] = [self.replica]
            for worker, (since, op) in changes.items():
                args += [worker, since, op]
            self._assign(keys=self.keys[2:], args=args, client=client)
            self.counts["changes_sent"] += len(changes)
        self.counts["heartbeats"] += 1
        if want_view:
            self._store_view(self._read(keys=self.keys, client=client))

    def _store_view(self, answer: list) -> None:
        _, live, info_flat, workers_flat = answer
        info = {}
        for i in range(0, len(info_flat), 2):
            try:
                info[info_flat[i].decode()] = json.loads(info_flat[i + 1])
            except ValueError:
                self.counts["unreadable"] += 1
        workers = {}
        for i in range(0, len(workers_flat), 2):
            replica, _, since = workers_flat[i + 1].decode().rpartition("|")
            workers[workers_flat[i].decode()] = (replica, int(since) / 1000.0)
        view = FleetView(self.monotonic(), frozenset(r.decode() for r in live), info, workers)
        with self._lock:
            self._view = view
            self._view_wanted = False

    def read_now(self) -> FleetView:
        """Read the directory now (a store thread or a test; raises :class:`StoreUnavailable`)."""
        self.store.call("directory", lambda r: self._store_view(self._read(keys=self.keys, client=r)))
        with self._lock:
            return self._view

    def leave(self) -> None:
        """On shutdown (a store thread): drop out of the live set and release every worker still held."""
        with self._lock:
            serving, self._serving = dict(self._serving), {}

        def send(client: redis.Redis) -> None:
            client.zrem(self.keys[0], self.replica)
            if serving:
                args: list[Any] = [self.replica]
                for worker, since in serving.items():
                    args += [worker, since, "r"]
                self._assign(keys=self.keys[2:], args=args, client=client)

        self.store.call("directory", send)
