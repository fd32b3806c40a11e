"""Fitted step-cost parameters shared per accelerator × count × target model.

A worker's :class:`~controller.models.cost.StepCostModel` starts from a
roofline prior built from its Hello's hardware numbers, which can be far
from the truth (docs/policies.md: 18 % median error on the measured H200).
Once some replica has fitted a worker of the same kind (accelerator name,
accelerators per worker, target model), a replica meeting a new worker of
that kind can start from that fit instead.

Publishing and looking up never wait on Redis: :meth:`CostPriorBook.publish`
and :meth:`CostPriorBook.lookup` touch only a local table; :meth:`CostPriorBook.flush`
(a store thread, every few seconds) writes what was published and fetches
what was looked up and missed. A miss returns ``None`` (the caller uses the
hardware prior) and the next Hello of that kind finds the fleet's fit.

Conflicts: several replicas fit workers of one kind. The stored entry is
replaced only by a fit from at least as many steps or by one newer than
``stale_s`` — a fit on a few dozen steps never replaces one on thousands,
and an outdated fit does not stay forever. Entries expire after ``ttl_s``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections import Counter
from typing import Any

from controller.fleet.store import FleetStore, StoreUnavailable
from controller.models.cost import CostParams

log = logging.getLogger("specctl.fleet")

PUBLISH_LUA = r"""
-- KEYS[1] the kind's key; ARGV: 1 params JSON, 2 steps, 3 at (s), 4 origin, 5 stale s, 6 ttl ms
local cur = redis.call('HMGET', KEYS[1], 'steps', 'at')
local steps, at = tonumber(ARGV[2]), tonumber(ARGV[3])
local old_steps, old_at = tonumber(cur[1]), tonumber(cur[2])
if old_steps and steps < old_steps and at - old_at < tonumber(ARGV[5]) then return 0 end
redis.call('HSET', KEYS[1], 'params', ARGV[1], 'steps', ARGV[2], 'at', ARGV[3], 'origin', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[6])
return 1
"""

Kind = tuple[str, int, str]  # (accelerator, accelerators per worker, target model)


def params_to_json(params: CostParams) -> str:
    """Every field of ``params`` as JSON (tuples become lists).

    >>> params_from_json(params_to_json(CostParams(mem_ms=7.5, compute_knots=(1.0, 2.0)))).compute_knots
    (1.0, 2.0)
    """
    return json.dumps({f.name: getattr(params, f.name) for f in dataclasses.fields(CostParams)})


def params_from_json(text: str) -> CostParams:
    """The inverse of :func:`params_to_json`. Fields this code does not know
    (a newer replica wrote them) are left out, fields it lacks keep their
    defaults: replicas of two versions still share what they both know."""
    data = json.loads(text)
    known = {f.name: f for f in dataclasses.fields(CostParams)}
    values = {}
    for name, value in data.items():
        field = known.get(name)
        if field is None:
            continue
        values[name] = tuple(float(v) for v in value) if isinstance(value, list) else float(value)
    return CostParams(**values)


class CostPriorBook:
    """The fleet's cost fits per worker kind, cached locally.

    Parameters
    ----------
    store : FleetStore
    min_steps : int
        Fits from fewer steps are not published.
    stale_s : float
        A stored fit older than this is replaced by any newer one.
    ttl_s : float
        A kind nobody publishes for expires after this.
    refresh_s : float
        Cached entries are fetched again after this.
    clock : callable
        Wall clock (the ``at`` of a fit is compared across replicas).
    """

    def __init__(self, store: FleetStore, *, min_steps: int = 200, stale_s: float = 3600.0,
                 ttl_s: float = 7 * 86400.0, refresh_s: float = 60.0, clock=time.time) -> None:
        self.store = store
        self.min_steps = min_steps
        self.stale_s = stale_s
        self.ttl_ms = int(ttl_s * 1000)
        self.refresh_s = refresh_s
        self.clock = clock
        self.counts: Counter = Counter()
        self._script = store.script(PUBLISH_LUA)
        self._lock = threading.Lock()
        self._cache: dict[Kind, tuple[CostParams | None, float]] = {}  # kind -> (fit or None, fetched at)
        self._wanted: set[Kind] = set()
        self._outbox: dict[Kind, tuple[CostParams, int, float]] = {}

    def kind_key(self, kind: Kind) -> str:
        accelerator, count, model = kind
        return self.store.key("cost", accelerator, str(count), model)

    # ------------------------------------------------------- never blocking
    def publish(self, accelerator: str, count: int, model: str, params: CostParams, steps: int) -> bool:
        """Offer a worker's fit (``StepCostModel.params`` after ``refit``, from
        ``steps`` steps: ``StepCostModel.samples``); True if queued (enough
        steps, a named accelerator and model)."""
        if steps < self.min_steps or not accelerator or not model:
            return False
        kind = (accelerator, max(int(count), 1), model)
        with self._lock:
            queued = self._outbox.get(kind)
            if queued is None or steps >= queued[1]:
                self._outbox[kind] = (params, int(steps), self.clock())
            # This replica's own fit is the best it knows until the store says otherwise.
            self._cache[kind] = (params, self.clock())
        return True

    def lookup(self, accelerator: str, count: int, model: str) -> CostParams | None:
        """The fleet's fit for this kind if known here; a miss asks :meth:`flush` to fetch it."""
        kind = (accelerator, max(int(count), 1), model)
        with self._lock:
            entry = self._cache.get(kind)
            if entry is None or self.clock() - entry[1] > self.refresh_s:
                self._wanted.add(kind)
            if entry is None or entry[0] is None:
                self.counts["misses"] += 1
                return None
            self.counts["hits"] += 1
            return entry[0]

    # ------------------------------------------------------- a store thread
    def flush(self) -> None:
        """Write queued fits and fetch wanted kinds (a store thread). Raises
        :class:`StoreUnavailable`; what was not written stays queued."""
        with self._lock:
            outbox, self._outbox = self._outbox, {}
            wanted, self._wanted = self._wanted, set()
        try:
            self.store.call("cost_priors", lambda r: self._exchange(r, outbox, wanted))
        except StoreUnavailable:
            with self._lock:
                for kind, item in outbox.items():  # keep the newest per kind for the next round
                    if kind not in self._outbox or item[1] > self._outbox[kind][1]:
                        self._outbox[kind] = item
                self._wanted |= wanted
            raise

    def _exchange(self, client, outbox: dict, wanted: set) -> None:
        for kind, (params, steps, at) in outbox.items():
            stored = self._script(keys=[self.kind_key(kind)], args=[
                params_to_json(params), steps, repr(at), self.store.replica_id, repr(self.stale_s), self.ttl_ms],
                client=client)
            with self._lock:
                self.counts["published" if stored else "kept_stored"] += 1
            wanted.add(kind)  # read back what the fleet holds now (ours or a better one)
        if not wanted:
            return
        order = sorted(wanted)
        pipe = client.pipeline(transaction=False)
        for kind in order:
            pipe.hget(self.kind_key(kind), "params")
        fetched = pipe.execute()
        now = self.clock()
        with self._lock:
            for kind, raw in zip(order, fetched):
                params = None
                if raw is not None:
                    try:
                        params = params_from_json(raw.decode())
                    except (ValueError, TypeError) as err:
                        self.counts["unreadable"] += 1
                        log.warning("fleet cost prior %s unreadable: %s", kind, err)
                keep = self._cache.get(kind)
                if params is None and keep is not None and keep[0] is not None:
                    params = keep[0]  # nothing stored (expired, store restarted): keep what we had
                self._cache[kind] = (params, now)
                self.counts["fetched"] += 1

    def fetch_now(self, accelerator: str, count: int, model: str) -> CostParams | None:
        """Fetch one kind and return it (a store thread or a test; raises :class:`StoreUnavailable`)."""
        kind = (accelerator, max(int(count), 1), model)
        self.store.call("cost_priors", lambda r: self._exchange(r, {}, {kind}))
        with self._lock:
            return self._cache[kind][0]

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"counts": dict(self.counts), "cached": len(self._cache), "queued": len(self._outbox)}
