"""Leases: one replica at a time owns a name (a drift stratum), fleet-wide.

A drift seen by the workers of two replicas must open one alert, not two.
The replica that opens (and later resolves) a stratum's alert is the one
holding the stratum's lease: ``SET key holder NX PX ttl`` takes a free
lease, a compare-and-extend script renews it only for its holder, a
compare-and-delete script releases it. When the holder dies, its lease
expires after ``ttl`` and another replica takes it.

Never blocking: the alerting code calls :meth:`LeaseBook.want` and
:meth:`LeaseBook.holds` on the event loop (a set and a clock reading);
:meth:`LeaseBook.cycle` on a store thread takes, renews and releases.

Safety against a holder that believes it still holds an expired lease:
the local belief ends at ``acquired + ttl × (1 − margin)`` measured from
*before* the request was sent, so it ends before Redis can let the key go,
whatever the round trip took (clock rates differ by far less than the
margin). While Redis is unreachable a holder keeps its lease until that
local deadline and nobody can take it: alerts wait, they are not doubled.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any, Callable, Iterable

from controller.fleet.store import FleetStore, StoreUnavailable

RENEW_LUA = r"""
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
RELEASE_LUA = r"""
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class LeaseBook:
    """This replica's leases.

    Parameters
    ----------
    store : FleetStore
    ttl_s : float
        Lease length in Redis.
    renew_after : float
        Share of ``ttl_s`` after which a held lease is renewed.
    margin : float
        Share of ``ttl_s`` by which the local belief ends before the key can expire.
    namespace : str
        Key family (``lease:<namespace>:<name>``).
    clock : callable
        Monotonic clock.
    """

    def __init__(self, store: FleetStore, *, ttl_s: float = 10.0, renew_after: float = 1 / 3, margin: float = 0.1,
                 namespace: str = "drift", clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < renew_after < 1 - margin:
            raise ValueError(f"renew_after ({renew_after}) must be in (0, 1 - margin = {1 - margin})")
        self.store = store
        self.ttl_ms = int(ttl_s * 1000)
        self.ttl_s = ttl_s
        self.renew_after_s = ttl_s * renew_after
        self.hold_s = ttl_s * (1 - margin)
        self.namespace = namespace
        self.holder = store.incarnation
        self.clock = clock
        self.counts: Counter = Counter()
        self._renew = store.script(RENEW_LUA)
        self._release = store.script(RELEASE_LUA)
        self._lock = threading.Lock()
        self._wanted: set[str] = set()
        self._held: dict[str, tuple[float, float]] = {}  # name -> (acquired or renewed at, local deadline)
        self._others: dict[str, str] = {}  # name -> holder seen at the last failed take

    def key(self, name: str) -> str:
        return self.store.key("lease", self.namespace, name)

    # ------------------------------------------------------- never blocking
    def want(self, name: str) -> None:
        """Ask for ``name``: the next :meth:`cycle` tries to take it, and keeps renewing it while wanted."""
        with self._lock:
            self._wanted.add(name)

    def drop(self, name: str) -> None:
        """No longer wanted: the next :meth:`cycle` releases it if held."""
        with self._lock:
            self._wanted.discard(name)

    def holds(self, name: str) -> bool:
        """True while this replica holds ``name`` (by the safe local deadline)."""
        with self._lock:
            held = self._held.get(name)
            return held is not None and self.clock() < held[1]

    def held_by(self, name: str) -> str | None:
        """Who held ``name`` when this replica last failed to take it (None: unknown, or this replica)."""
        with self._lock:
            return self._others.get(name)

    # ------------------------------------------------------- a store thread
    def cycle(self) -> None:
        """Take wanted leases, renew held ones due, release unwanted ones.
        Raises :class:`StoreUnavailable` (held leases then lapse by their deadline)."""
        with self._lock:
            wanted = set(self._wanted)
            now = self.clock()
            for name, (_, deadline) in list(self._held.items()):
                if now >= deadline:  # lapsed: Redis may have given it to another replica
                    del self._held[name]
                    self.counts["lapsed"] += 1
            held = dict(self._held)
        release = [n for n in held if n not in wanted]
        renew = [n for n in held if n in wanted and now - held[n][0] >= self.renew_after_s]
        take = [n for n in wanted if n not in held]
        if release or renew or take:
            self.store.call("leases", lambda r: self._exchange(r, take, renew, release))

    def _exchange(self, client, take: Iterable[str], renew: Iterable[str], release: Iterable[str]) -> None:
        for name in release:
            self._release(keys=[self.key(name)], args=[self.holder], client=client)
            with self._lock:
                self._held.pop(name, None)
                self.counts["released"] += 1
        for name in renew:
            sent = self.clock()
            ok = self._renew(keys=[self.key(name)], args=[self.holder, self.ttl_ms], client=client)
            with self._lock:
                if ok:
                    self._held[name] = (sent, sent + self.hold_s)
                    self.counts["renewed"] += 1
                else:  # expired and taken (a long pause here): not ours any more
                    self._held.pop(name, None)
                    self.counts["lost"] += 1
        for name in take:
            self._take(name, client)

    def take_now(self, name: str) -> bool:
        """One attempt to take ``name`` now (a store thread, or a test); True if this replica holds it.
        Raises :class:`StoreUnavailable`."""
        return self.store.call("leases", lambda client: self._take(name, client))

    def _take(self, name: str, client) -> bool:
        sent = self.clock()
        got = client.set(self.key(name), self.holder, nx=True, px=self.ttl_ms)
        holder = None
        if not got:
            raw = client.get(self.key(name))
            holder = raw.decode() if raw is not None else None
            got = holder == self.holder  # ours already (a renewal that lost its answer)
        with self._lock:
            if got:
                self._held[name] = (sent, sent + self.hold_s)
                self._others.pop(name, None)
                self.counts["taken"] += 1
            else:
                self._others[name] = holder or ""
                self.counts["refused"] += 1
        return bool(got)

    async def run_once(self) -> None:
        """:meth:`cycle` from the event loop (never blocking it)."""
        try:
            await self.store.offload(self.cycle)
        except StoreUnavailable:
            self.counts["cycle_failures"] += 1

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"held": sorted(self._held), "wanted": len(self._wanted), "counts": dict(self.counts)}
