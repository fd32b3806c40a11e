"""One drift monitor per drafter version, fleet-wide: its owner, its evidence, its handover.

The drift monitor's CUSUM bank is per drafter version, stratified over the
version's context buckets (× domains), so the unit of ownership is the
drafter version: one replica at a time runs the monitor of a version, fed the
sampled request-steps of every replica's workers that run it. With one
monitor per replica instead, R replicas watching a version raise false alarms
R times as often as ``drift.monitor.ert`` says, and a drift spread over R
replicas' workers is seen by each in 1/R of the traffic.

* **Owner by lease.** Every replica that had sampled outcomes of a version in
  the last ``idle_s`` wants the version's monitor lease
  (:class:`~controller.fleet.leases.LeaseBook`, namespace ``drift-monitor``);
  the one holding it runs the version in its monitor. The others do not
  track the version at all, so they never open its alerts.
* **Evidence.** Every replica, the owner included, forwards its sampled
  outcomes to the version's stream (:class:`~controller.fleet.drift_stream.EvidenceOutbox`);
  the owner reads the stream from where its monitor stands (a
  :class:`Cursor`: the last entry id fed, entries fed, and per writer the
  last entry number fed) and queues the outcomes for its monitor, which the
  housekeeping tick feeds within the drift CPU budget
  (``MonitorFeed.push_inbound``). Each outcome reaches the monitor once: a
  writer's entry sent twice (a resend after a timeout) carries the same
  number and is skipped.
* **Handover.** Every ``checkpoint_interval_s`` the owner writes a
  :class:`Checkpoint` — the version's baselines (``version_to_dict``), the
  cursor, a generation number — to Redis, only while Redis says it still
  holds the lease (one script: compare, then set). When the owner dies its
  lease expires; another replica that runs the version takes it, rebuilds the
  version from the checkpoint and reads on from the checkpoint's entry id,
  so what the dead owner read after its last checkpoint is read again, once
  (live windows and CUSUM sums are not in a checkpoint: they restart). A
  replica that lost a lease (Redis unreachable past the lease) keeps its
  copy aside and, if it takes the lease back and the fleet's checkpoint is
  not newer, goes on from it — a Redis that restarted empty loses no
  baseline of a version whose owner lives.
* **Redis down.** Outcomes wait in the outbox (bounded, the excess dropped
  and counted); the owner's lease lapses by its safe local deadline and the
  version is watched again once a replica takes it back. Alerts stay as
  before (:class:`~controller.fleet.alerts.FleetAlerts`: one per stratum, a
  lease per stratum), and when a version's monitor moves, its previous owner
  lets go of its strata's leases so the new one can resolve their alerts.

Threads: :meth:`FleetDriftMonitor.run_round` runs on the event loop (a
periodic task of :class:`~controller.fleet.replica.FleetReplica`) and does
every Redis call through the store's threads; rebuilding a version from a
checkpoint (its bootstrap calibrations) runs there too.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

from controller.alerts.alerting import MIN_FRACTION
from controller.drift.alerts import DriftAlert
from controller.drift.persistence import (install_version, remove_version, tracked_version, tracked_versions,
                                          version_from_dict, version_to_dict)
from controller.drift.strata import Version
from controller.fleet.drift_stream import EvidenceGroup, EvidenceOutbox, StreamLimits, decode_groups
from controller.fleet.leases import LeaseBook
from controller.fleet.store import FleetStore, StoreUnavailable

log = logging.getLogger("specctl.fleet")

CHECKPOINT_FORMAT = 1
MAX_RETAINED = 64  # versions kept aside after losing their lease
MAX_WRITERS = 512  # writers remembered per cursor (the most recent)
STALE_S = 3.0  # evidence queued for the owner's monitor beyond this many seconds of its work is shed
MIN_INBOUND = 1000  # ... but never below this many request-steps
GROWTH = 2.0  # the most a fraction grows a window while the monitor keeps up with room to spare
BACKLOG_S = 10.0  # a version's evidence lag counts as inflow to be worked off over this long

# KEYS: 1 the lease, 2 the checkpoint (or the published fraction); ARGV: 1 holder, 2 value, 3 its time to live (ms).
CHECKPOINT_LUA = r"""
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
"""

# KEYS: 1 the stream; ARGV: 1 read after this id, 2 at most this many entries.
# -> {entries ever added, length, first entry id kept, entries}
READ_LUA = r"""
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, 0, '0-0', {}} end
local info = redis.call('XINFO', 'STREAM', KEYS[1])
local added, length, first = 0, 0, '0-0'
for i = 1, #info, 2 do
  if info[i] == 'entries-added' then added = info[i + 1]
  elseif info[i] == 'length' then length = info[i + 1]
  elseif info[i] == 'recorded-first-entry-id' then first = info[i + 1] end
end
return {added, length, first, redis.call('XRANGE', KEYS[1], '(' .. ARGV[1], '+', 'COUNT', ARGV[2])}
"""


def stream_id(text: str) -> tuple[int, int]:
    """A stream entry id as a comparable pair.

    >>> stream_id("1700000000000-3") < stream_id("1700000000001-0"), stream_id("0-0")
    (True, (0, 0))
    """
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


@dataclass
class Cursor:
    """Where a version's monitor stands in the version's evidence stream.

    Attributes
    ----------
    last_id : str
        The last entry fed to the monitor (or skipped); reading goes on after it.
    entries : int
        Entries passed so far (fed, skipped, or trimmed away before they were
        read): against the stream's ``entries-added`` it gives the lag.
    writers : dict of str to int
        Per writer (replica incarnation), the highest entry number fed: a copy
        of an entry (a resend) is skipped, a jump is counted as entries lost.
    """

    last_id: str = "0-0"
    entries: int = 0
    writers: dict[str, int] = field(default_factory=dict)

    def copy(self) -> "Cursor":
        return Cursor(self.last_id, self.entries, dict(self.writers))

    def to_dict(self) -> dict[str, Any]:
        writers = dict(list(self.writers.items())[-MAX_WRITERS:])
        return {"last_id": self.last_id, "entries": self.entries, "writers": writers}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Cursor":
        last_id = str(data.get("last_id", "0-0"))
        try:
            stream_id(last_id)
        except ValueError:
            raise ValueError(f"cursor.last_id {last_id!r} is not a stream id") from None
        return cls(last_id, int(data.get("entries", 0)), {str(k): int(v) for k, v in data.get("writers", {}).items()})


@dataclass
class Checkpoint:
    """A version's monitor as its owner last saved it in Redis.

    Examples
    --------
    >>> cp = Checkpoint(3, "r1/ab12", 1700000000.0, Cursor("5-0", 5, {"r2/cd34": 4}), None, [0, 1024])
    >>> Checkpoint.from_json(cp.to_json()) == cp
    True
    >>> Checkpoint.from_json('{"format": 9}')
    Traceback (most recent call last):
    ...
    ValueError: checkpoint format must be 1, got 9
    """

    gen: int  # raised by every write: a copy kept aside is stale when the fleet's is higher
    owner: str  # the lease holder that wrote it
    at: float  # wall clock of the write
    cursor: Cursor
    version: dict[str, Any] | None  # version_to_dict output; None: nothing learnt yet (or retired)
    context_edges: list[int]

    def to_json(self) -> str:
        return json.dumps({"format": CHECKPOINT_FORMAT, "gen": self.gen, "owner": self.owner, "at": self.at,
                           "cursor": self.cursor.to_dict(), "version": self.version,
                           "context_edges": list(self.context_edges)}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "Checkpoint":
        data = json.loads(text)
        if data.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"checkpoint format must be {CHECKPOINT_FORMAT}, got {data.get('format')!r}")
        return cls(int(data["gen"]), str(data["owner"]), float(data["at"]), Cursor.from_dict(data["cursor"]),
                   data.get("version"), [int(e) for e in data.get("context_edges", [])])


class Phase(str, Enum):
    IDLE = "idle"  # another replica (or none) runs the monitor
    LOADING = "loading"  # lease taken, the checkpoint being read
    OWNED = "owned"  # this replica runs it


@dataclass
class _Retained:
    """A version this replica ran, kept aside after it lost the lease (or restored from the local store)."""

    gen: int
    cursor: Cursor
    version: Version | None


@dataclass
class VersionWatch:
    """One drafter version as this replica sees it."""

    key: tuple[str, str]
    phase: Phase = Phase.IDLE
    cursor: Cursor | None = None  # fed through (owned)
    read_id: str = "0-0"  # read through (owned; the entries between are queued for the monitor)
    read_writers: dict[str, int] = field(default_factory=dict)
    in_flight: int = 0  # entries read, not yet fed
    epoch: int = 0  # raised at each takeover and stream reset: older queued entries do not move the cursor
    gen: int = 0
    last_checkpoint: float = float("-inf")
    checkpoint_at: float | None = None  # wall clock of the last checkpoint written
    last_inbound: float = float("-inf")
    lag: int | None = None
    counts: Counter = field(default_factory=Counter)
    # Admission (owned): the fleet-wide sample fraction published, and what arrived since the last window.
    fraction: float | None = None
    # The fractions in force over the last windows: the inflow measured now was admitted under one of them
    # (replicas read a published fraction up to a window later), so a cut is sized from the largest.
    recent_fractions: deque = field(default_factory=lambda: deque(maxlen=3))
    added: int | None = None  # the stream's entries-added when last read
    added_mark: int | None = None  # ... at the start of the window
    window_entries: int = 0  # entries read in the window
    window_outcomes: int = 0  # their outcomes
    outcomes_per_entry: float | None = None

    @property
    def label(self) -> str:
        return f"{self.key[0]}/{self.key[1]}"


class FleetDriftMonitor:
    """This replica's part of the fleet's drift monitors.

    Parameters
    ----------
    store : FleetStore
    alerting : controller.alerts.alerting.DriftAlerting
        Its monitor runs the versions this replica owns; its feed forwards
        every sampled step to the outbox and is fed the owned versions' evidence.
    fleet_alerts : controller.fleet.alerts.FleetAlerts or None
        Open alerts to attach to a version taken over, stratum leases to let go of.
    lease_ttl_s : float
        The monitor lease per version (``state.lease_ttl_s``).
    checkpoint_interval_s : float
        How often the owner saves each version it runs.
    maxlen, max_buffered : int
        See :class:`~controller.fleet.drift_stream.EvidenceOutbox`.
    idle_s : float or None
        A version with no outcomes here (forwarded, or read as owner) for this
        long is let go (default ``max(60, 6 × lease_ttl_s)``).
    read_count : int
        Entries read per version per round.
    max_in_flight : int
        Entries read ahead of the monitor per version (the rest waits in Redis, as lag).
    checkpoint_ttl_s : float
        A checkpoint nobody rewrites expires after this.
    admit_every_s : float
        How often the owner works out and publishes each owned version's fleet-wide sample fraction, and
        every replica reads the published ones.
    fraction_ttl_s : float or None
        A published fraction nobody rewrites lapses after this (default ``max(5, 3 × lease_ttl_s)``):
        replicas then sample at their own ``drift.sample_fraction`` again.
    min_fraction : float
        The published fraction's floor.
    margin : float
        The share of the owner's monitor budget the inflow is sized to fill.
    monotonic, wall : callable

    Notes
    -----
    **Admission.** The owner's monitor is fed within its own ``drift.cpu_fraction``; the replicas'
    forwarding does not see that budget, so the owner measures it: per window, the monitor budget handed
    to its feed over the monitor's cost per request-step (request-steps/s it can feed) against the
    outcomes arriving on its versions' streams (entries added × outcomes per entry, plus the lag to work
    off over ``BACKLOG_S``). The fraction that makes that inflow fill ``margin`` of the budget, moved at
    most ×1.5 up or ÷2 down a window, floored at ``min_fraction`` and never above the owner's
    ``drift.sample_fraction``, is written to ``drift:fraction:<kind>:<version>`` (fenced by the lease,
    with a TTL). Every replica reads the fractions of the versions it forwards and samples each at
    ``min(own fraction, published)`` by the same request-id hash, so all keep the same whole requests.
    """

    def __init__(self, store: FleetStore, alerting: Any, fleet_alerts: Any = None, *, lease_ttl_s: float = 10.0,
                 checkpoint_interval_s: float = 5.0, maxlen: int = 10_000, max_buffered: int = 50_000,
                 idle_s: float | None = None, read_count: int = 256, max_in_flight: int = 512,
                 checkpoint_ttl_s: float = 7 * 86400.0, admit_every_s: float = 1.0,
                 fraction_ttl_s: float | None = None, min_fraction: float = MIN_FRACTION, margin: float = 0.8,
                 monotonic: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        if not 0.0 < min_fraction <= 1.0:
            raise ValueError(f"min_fraction must be in (0, 1], got {min_fraction!r}")
        if not 0.0 < margin <= 1.0:
            raise ValueError(f"margin must be in (0, 1], got {margin!r}")
        self.store = store
        self.alerting = alerting
        self.monitor = alerting.monitor
        self.feed = alerting.feed
        self.fleet_alerts = fleet_alerts
        self.outbox = EvidenceOutbox(store, maxlen=maxlen, max_buffered=max_buffered, stream_ttl_s=checkpoint_ttl_s,
                                     clock=monotonic)
        self.leases = LeaseBook(store, ttl_s=lease_ttl_s, namespace="drift-monitor", clock=monotonic)
        self.checkpoint_interval_s = checkpoint_interval_s
        self.idle_s = idle_s if idle_s is not None else max(60.0, 6.0 * lease_ttl_s)
        self.read_count = read_count
        self.max_in_flight = max_in_flight
        self.checkpoint_ttl_ms = int(checkpoint_ttl_s * 1000)
        self.monotonic = monotonic
        self.wall = wall
        self.watches: dict[tuple[str, str], VersionWatch] = {}
        self.counts: Counter = Counter()
        self._retained: OrderedDict[tuple[str, str], _Retained] = OrderedDict()
        self._write_checkpoint = store.script(CHECKPOINT_LUA)
        self._read_script = store.script(READ_LUA)
        self._last_lease_cycle = float("-inf")
        self.admit_every_s = admit_every_s
        self.fraction_ttl_s = fraction_ttl_s if fraction_ttl_s is not None else max(5.0, 3.0 * lease_ttl_s)
        self.min_fraction = min_fraction
        self.margin = margin
        self.fleet_fractions: dict[tuple[str, str], tuple[float, float]] = {}  # version -> (fraction, lapses at)
        self._last_admission = float("-inf")
        self._budget_mark = self.feed.budget_total_s
        self._observed_mark = self.feed.observed
        self._drains_mark = (self.feed.drains, self.feed.drains_cut)
        self._spent_mark = self._spending()
        self._capacity = CapacityEstimate()

    # ------------------------------------------------------------------ keys
    def lease_name(self, key: tuple[str, str]) -> str:
        return f"{key[0]}/{key[1]}"

    def checkpoint_key(self, key: tuple[str, str]) -> str:
        return self.store.key("drift", "checkpoint", key[0], key[1])

    def fraction_key(self, key: tuple[str, str]) -> str:
        return self.store.key("drift", "fraction", key[0], key[1])

    # ------------------------------------------------------------- lifecycle
    def attach(self) -> None:
        """Forward the feed's steps to the fleet; versions restored from the local store are kept aside
        (used when this replica takes one over and the fleet has no checkpoint of it)."""
        self.feed.forward = self.outbox.add
        for key in tracked_versions(self.monitor):
            v = remove_version(self.monitor, key)
            self._retained[key] = _Retained(-1, Cursor(), v)
            self.counts["restored_aside"] += 1

    async def run_round(self) -> None:
        """One round (on the loop): send the outbox, settle ownership, read the owned streams, checkpoint."""
        try:
            await self.store.offload(self.outbox.flush)
        except StoreUnavailable:
            self.counts["flush_failures"] += 1
        for watch in list(self.watches.values()):
            if watch.phase is Phase.OWNED and not self.leases.holds(self.lease_name(watch.key)):
                self._let_go(watch, "lost")
        now = self.monotonic()
        new = bool(self.outbox.versions_seen(self.idle_s) - self.watches.keys())  # a version to ask for at once
        if new or now - self._last_lease_cycle >= self.leases.renew_after_s * 0.9:
            self._last_lease_cycle = now
            await self._ownership(now)
        await self._read()
        await self._checkpoints(force=False)
        if self.monotonic() - self._last_admission >= self.admit_every_s:
            await self._admission()

    async def close(self, timeout_s: float = 2.0) -> None:
        """At shutdown (after the feed's last drain): send what is queued, checkpoint and release every
        version this replica runs, so another replica takes over at once rather than after the lease."""
        try:
            await self.store.offload(self.outbox.flush, timeout_s)
        except StoreUnavailable as err:
            log.warning("drift evidence not sent at shutdown: %s", err)
        await self._checkpoints(force=True, timeout_s=timeout_s)
        for watch in self.watches.values():
            self.leases.drop(self.lease_name(watch.key))
        try:
            await self.store.offload(self.leases.cycle, timeout_s)
        except StoreUnavailable:
            pass

    # ------------------------------------------------------------- ownership
    async def _ownership(self, now: float) -> None:
        seen = self.outbox.versions_seen(self.idle_s)
        for key in seen:
            if key not in self.watches:
                self.watches[key] = VersionWatch(key)
        for watch in list(self.watches.values()):
            name = self.lease_name(watch.key)
            active = watch.key in seen or (watch.phase is Phase.OWNED and now - watch.last_inbound < self.idle_s)
            if active:
                self.leases.want(name)
            elif watch.phase is Phase.OWNED:
                await self._checkpoint(watch)
                self._let_go(watch, "released")
                self.leases.drop(name)
            else:
                self.leases.drop(name)
                if not self.leases.holds(name):
                    del self.watches[watch.key]
        try:
            await self.store.offload(self.leases.cycle)
        except StoreUnavailable:
            self.counts["lease_cycle_failures"] += 1
        for watch in list(self.watches.values()):
            name = self.lease_name(watch.key)
            if watch.phase is Phase.IDLE and self.leases.holds(name):
                await self._take_over(watch)

    async def _take_over(self, watch: VersionWatch) -> None:
        key = watch.key
        watch.phase = Phase.LOADING
        retained = self._retained.get(key)
        floor = retained.gen if retained is not None else None
        alerts = {a.id: a for a in self._fleet_open_alerts(key)}
        config, ert = self.monitor.config, self.monitor.ert_cusum
        try:
            stored, version = await self.store.offload(lambda: self._load(key, floor, config, ert, alerts), 30.0)
        except StoreUnavailable:
            self.counts["takeover_failures"] += 1
            watch.phase = Phase.IDLE
            return
        if not self.leases.holds(self.lease_name(key)):  # lapsed while loading
            watch.phase = Phase.IDLE
            return
        if stored is not None and (retained is None or stored.gen > retained.gen):
            cursor, gen, source = stored.cursor, stored.gen, f"checkpoint gen {stored.gen} of {stored.owner}"
            origin = "checkpoint"
            if version is not None:
                install_version(self.monitor, version)
            else:
                remove_version(self.monitor, key)
        elif retained is not None:
            cursor, gen, version = retained.cursor, max(retained.gen, 0), retained.version
            source = "its own copy" if retained.gen >= 0 else "the local store"
            origin = "own_copy" if retained.gen >= 0 else "local_store"
            if version is not None:
                install_version(self.monitor, version)
        else:
            cursor, gen, source, origin = Cursor(), 0, "the stream's start", "stream_start"
        self._retained.pop(key, None)
        for alert in self._fleet_open_alerts(key):
            self.monitor.adopt(alert)
        watch.cursor = cursor.copy()
        watch.read_id = cursor.last_id
        watch.read_writers = dict(cursor.writers)
        watch.in_flight = 0
        watch.epoch += 1
        watch.gen = gen
        watch.phase = Phase.OWNED
        watch.last_inbound = self.monotonic()
        watch.last_checkpoint = float("-inf")  # a checkpoint at once: the fleet's generation moves past any copy
        published = self.fleet_fractions.get(key)
        watch.fraction = published[0] if published is not None else None  # go on from the fleet's fraction
        watch.added = watch.added_mark = None
        watch.window_entries = watch.window_outcomes = 0
        watch.counts["takeovers"] += 1
        self.counts["takeovers"] += 1
        self.counts["takeovers_from_" + origin] += 1
        log.info("drift monitor of %s now runs here (from %s, after entry %s)", watch.label, source, cursor.last_id)

    def _load(self, key: tuple[str, str], floor: int | None, config: Any, ert: float,
              alerts: dict[str, DriftAlert]) -> tuple[Checkpoint | None, Version | None]:
        """Read the fleet's checkpoint and rebuild its version unless the copy kept here is as new
        (a store thread: the rebuild calibrates)."""
        raw = self.store.call("drift_checkpoint", lambda r: r.get(self.checkpoint_key(key)))
        if raw is None:
            return None, None
        try:
            stored = Checkpoint.from_json(raw)
        except (ValueError, KeyError, TypeError) as err:
            self.counts["checkpoints_unreadable"] += 1
            log.warning("drift checkpoint of %s/%s unreadable (%s): ignored", key[0], key[1], err)
            return None, None
        if floor is not None and stored.gen <= floor:
            return stored, None
        if stored.version is None:
            return stored, None
        if tuple(stored.context_edges) != tuple(config.context_edges):
            log.warning("drift checkpoint of %s/%s was learnt on context buckets %s, this replica uses %s: "
                        "the version relearns", key[0], key[1], stored.context_edges, list(config.context_edges))
            stored.version = None
            return stored, None
        return stored, version_from_dict(stored.version, config, ert, alerts)

    def _let_go(self, watch: VersionWatch, why: str) -> None:
        """Stop running a version here (lease lost or released): keep a copy aside, forget its queued
        evidence, let go of its strata's alert leases."""
        key = watch.key
        version = remove_version(self.monitor, key)
        self.feed.purge_inbound(lambda limits: (str(limits.kind), str(limits.version)) == key)
        if watch.cursor is not None:
            self._retained[key] = _Retained(watch.gen, watch.cursor, version)
            self._retained.move_to_end(key)
            while len(self._retained) > MAX_RETAINED:
                self._retained.popitem(last=False)
        if self.fleet_alerts is not None:
            self.fleet_alerts.release_version(*key)
        watch.phase = Phase.IDLE
        watch.cursor = None
        watch.in_flight = 0
        watch.lag = None
        watch.fraction = None
        watch.added = watch.added_mark = None
        watch.epoch += 1
        watch.counts[why] += 1
        self.counts[why] += 1
        log.info("drift monitor of %s no longer runs here (%s)", watch.label, why)

    def _fleet_open_alerts(self, key: tuple[str, str]) -> list[DriftAlert]:
        if self.fleet_alerts is None:
            return []
        return self.fleet_alerts.open_alerts_of(*key)

    # --------------------------------------------------------------- reading
    async def _read(self) -> None:
        owned = [w for w in self.watches.values() if w.phase is Phase.OWNED and w.in_flight < self.max_in_flight]
        if not owned:
            return
        asks = [(w.key, w.read_id, w.epoch) for w in owned]
        try:
            answers = await self.store.offload(lambda: self._fetch(asks))
        except StoreUnavailable:
            self.counts["read_failures"] += 1
            return
        for (key, read_id, epoch), answer in zip(asks, answers):
            watch = self.watches.get(key)
            if watch is None or watch.phase is not Phase.OWNED or watch.epoch != epoch or watch.read_id != read_id:
                continue  # let go of, or taken over again, meanwhile
            self._take_in(watch, *answer)

    def _fetch(self, asks: list[tuple[tuple[str, str], str, int]]) -> list[tuple[int, int, str, list]]:
        """Each owned stream's counters and next entries, decoded (a store thread)."""
        def read(client):
            # One EVALSHA per version (a pipeline would add a SCRIPT EXISTS each time); a replica owns few.
            return [self._read_script(keys=[self.outbox.stream_key(key)], args=[read_id, self.read_count],
                                      client=client) for key, read_id, _ in asks]

        out = []
        for added, length, first, entries in self.store.call("drift_read", read):
            decoded = []
            for raw_id, flat in entries:
                fields = dict(zip(flat[::2], flat[1::2]))
                try:
                    writer, seq = fields[b"w"].decode(), int(fields[b"s"])
                except (KeyError, ValueError):
                    writer, seq = "", 0
                try:
                    groups: list[EvidenceGroup] | None = decode_groups(fields[b"d"])
                except (KeyError, ValueError) as err:
                    log.warning("drift evidence entry %s unreadable: %s", raw_id, err)
                    groups = None
                decoded.append((raw_id.decode(), writer, seq, groups))
            out.append((int(added), int(length), first.decode() if isinstance(first, bytes) else str(first), decoded))
        return out

    def _take_in(self, watch: VersionWatch, added: int, length: int, first: str, entries: list) -> None:
        """Queue what was read for the monitor, in order; work out the lag (on the loop)."""
        cursor = watch.cursor
        passed = cursor.entries + watch.in_flight
        if added < passed:
            # The stream counts fewer entries than this replica passed: Redis lost it (restarted empty, or from
            # an older copy). Read it again from its start: per-writer numbers keep what was fed from counting twice.
            watch.counts["stream_resets"] += 1
            self.counts["stream_resets"] += 1
            watch.epoch += 1
            watch.read_id = cursor.last_id = "0-0"
            cursor.entries = passed = 0
            watch.in_flight = 0
            log.warning("drift evidence stream of %s was reset in Redis: reading it again from its start",
                        watch.label)
            return
        if length and stream_id(watch.read_id) < stream_id(first):
            trimmed = added - length - passed  # entries trimmed away before they were read
            if trimmed > 0:
                watch.counts["entries_trimmed"] += trimmed
                cursor.entries += trimmed
        epoch = watch.epoch
        for entry_id, writer, seq, groups in entries:
            watch.read_id = entry_id
            watch.in_flight += 1
            last = watch.read_writers.get(writer, 0)
            fresh = bool(writer) and seq > last and groups is not None
            if not writer or groups is None:
                watch.counts["entries_unreadable"] += 1
            elif seq <= last:
                watch.counts["entries_duplicate"] += 1
            else:
                if last and seq > last + 1:
                    watch.counts["entries_lost"] += seq - last - 1
                watch.read_writers[writer] = seq
            done = self._consumer(watch, epoch, entry_id, writer, seq if fresh else 0)
            if not fresh or not groups:
                self.feed.push_inbound(_limits_of(watch.key), "", 0.0, (), done)
                continue
            for i, g in enumerate(groups):
                after = done if i == len(groups) - 1 else None
                if g.moved_to:
                    after = self._mover(g, after)
                self.feed.push_inbound(g.limits, g.worker_id, g.timestamp, g.outcomes, after)
                watch.counts["outcomes_queued"] += len(g.outcomes)
                watch.window_outcomes += len(g.outcomes)
            watch.window_entries += 1
        watch.added = added
        if entries:
            watch.last_inbound = self.monotonic()
        watch.lag = max(0, added - cursor.entries)

    def _consumer(self, watch: VersionWatch, epoch: int, entry_id: str, writer: str, seq: int) -> Callable[[], None]:
        def done() -> None:
            cursor = watch.cursor
            if cursor is None:
                return
            if seq:
                cursor.writers[writer] = max(cursor.writers.get(writer, 0), seq)
            if watch.epoch == epoch:
                cursor.last_id = entry_id
                cursor.entries += 1
                watch.in_flight -= 1
        return done

    def _mover(self, group: EvidenceGroup, then: Callable[[], None] | None) -> Callable[[], None]:
        def moved() -> None:
            self.monitor.worker_left(group.worker_id, group.limits.kind, group.limits.version, group.moved_to,
                                     group.timestamp or None)
            if then is not None:
                then()
        return moved

    # ------------------------------------------------------------- admission
    async def _admission(self) -> None:
        """Publish the owned versions' fleet-wide fractions and read every forwarded version's (on the loop;
        Redis through the store's threads); hand the feed what applies."""
        now = self.monotonic()
        elapsed, self._last_admission = now - self._last_admission, now
        budget_total = self.feed.budget_total_s
        budget_s, self._budget_mark = budget_total - self._budget_mark, budget_total
        observed = self.feed.observed
        fed, self._observed_mark = observed - self._observed_mark, observed
        drains, cut = self.feed.drains - self._drains_mark[0], self.feed.drains_cut - self._drains_mark[1]
        self._drains_mark = (self.feed.drains, self.feed.drains_cut)
        saturated = drains > 0 and 2 * cut >= drains  # the monitor's budget, not the evidence, ran out
        spending = self._spending()
        self._capacity.add(elapsed, budget_s, *(now - then for now, then in zip(spending, self._spent_mark)))
        self._spent_mark = spending
        publish = self._fractions(elapsed, budget_s, fed, saturated) if elapsed != float("inf") else {}
        keys = sorted(self.outbox.versions_seen(self.idle_s) | self.watches.keys())
        try:
            read = await self.store.offload(lambda: self._exchange(publish, keys))
        except StoreUnavailable:
            self.counts["fraction_failures"] += 1
            read = None
        now = self.monotonic()
        if read is not None:
            for key, fraction in zip(keys, read):
                if fraction is None:
                    self.fleet_fractions.pop(key, None)
                else:
                    self.fleet_fractions[key] = (fraction, now + self.fraction_ttl_s)
        # Redis unreachable: what was read holds until it would have lapsed in Redis, then the own fraction.
        self.fleet_fractions = {k: v for k, v in self.fleet_fractions.items() if v[1] > now}
        self.feed.set_version_fractions({k: v[0] for k, v in self.fleet_fractions.items()})

    def _spending(self) -> tuple[float, float, int, float, int]:
        """The feed's running totals :meth:`CapacityEstimate.add` takes the differences of."""
        f = self.feed
        return (f.spent_total_s, f.observe_total_s, f.observed, f.forward_total_s, f.forwarded)

    def _fractions(self, elapsed_s: float, budget_s: float, fed: int,
                   saturated: bool) -> dict[tuple[str, str], float]:
        """Each owned version's next fraction: its inflow (outcomes/s, at the fraction now in force, plus its
        lag to work off) scaled so that all owned versions' inflow fills ``margin`` of the monitor's budget.

        Its capacity is the budget left after the monitor's overheads (forwarding this replica's own
        steps, calibrations, the entries' callbacks) over its cost per request-step, both measured by the
        feed and smoothed over several windows (:class:`CapacityEstimate`); saturated (ticks that worked ran
        out with evidence left), the fraction only falls. Reading capacity as what the monitor fed in one
        window instead took the fraction to the floor in the fleet benchmark: a calibration's tens of ms
        are paid back by ticks that do nothing, each such window read as "no capacity", the fraction halved
        window after window (1.0 to 1/4096 in 25 s) and a drop opened its alert 35 s late instead of 2 s.
        Until the first steps are measured, capacity is what the monitor was fed in the window when it ran
        out of budget (the fraction halves at most a window), and keeping up, the fraction grows by at most
        ×1.1 a window; once measured it moves to fit, at most ×2 up or ÷2 down a window."""
        ceiling = self.feed.max_fraction
        cost = self.feed.cost_s
        demand: dict[tuple[str, str], float] = {}
        owned = [w for w in self.watches.values() if w.phase is Phase.OWNED and w.cursor is not None]
        for w in owned:
            if w.window_entries:
                per_entry = w.window_outcomes / w.window_entries
                w.outcomes_per_entry = per_entry if w.outcomes_per_entry is None else (
                    0.5 * w.outcomes_per_entry + 0.5 * per_entry)
            w.window_entries = w.window_outcomes = 0
            arrived = None if w.added is None or w.added_mark is None else max(0, w.added - w.added_mark)
            w.added_mark = w.added
            if arrived is None or w.outcomes_per_entry is None:
                continue  # a first window: nothing measured yet
            demand[w.key] = w.outcomes_per_entry * (arrived / elapsed_s + (w.lag or 0) / BACKLOG_S)
        if elapsed_s <= 0.0:
            return {w.key: w.fraction for w in owned if w.fraction is not None}  # keep it alive, unchanged
        total = sum(demand.values())
        fit = self._capacity.scale(total, self.margin) if total > 0.0 else None
        afforded = self._capacity.steps_per_s(self.margin)
        if afforded is not None:  # evidence more than a few seconds of work behind is stale: shed it
            self.feed.inbound_limit = int(min(self.feed.max_buffered, max(MIN_INBOUND, STALE_S * afforded)))
        if fit is not None:
            # The budget left after the fixed overheads over what the inflow costs at the fraction now in
            # force (observing every outcome, forwarding this replica's own): measured over several windows,
            # so a calibration (tens of ms paid back by idle ticks) or a collection is spread out.
            capacity = total * fit / self.margin
            scale = min(GROWTH, fit) if not saturated else min(1.0, fit)
        elif saturated:
            # No cost per step measured yet (forwarding alone may eat the budget, so nothing is observed):
            # what the monitor was fed within its budget.
            capacity = fed / elapsed_s
            scale = self.margin * capacity / total if total > 0.0 else 1.0
        else:
            capacity = budget_s / cost / elapsed_s if cost and budget_s > 0.0 else float("inf")
            scale = min(1.1, max(1.0, self.margin * capacity / total if total > 0.0 else 1.1))
        out = {}
        for w in owned:
            current = w.fraction if w.fraction is not None else ceiling
            if w.key in demand:
                # Sized from the fraction that admitted the inflow measured, not compounded on the last cut:
                # a cut shows in the inflow only a window or two later, and cutting again on the old inflow
                # took the fraction far below what the budget affords (a windup).
                basis = max([current, *w.recent_fractions]) if scale < 1.0 else current
                target = min(ceiling, GROWTH * current, max(basis * scale, current / 2.0, self.min_fraction))
                if target != current:
                    log.debug("drift monitor of %s: inflow %.0f/s for %.0f/s of budget, fleet fraction %.4f -> %.4f",
                              w.label, demand[w.key], capacity, current, target)
                    w.counts["fraction_changes"] += 1
                current = target
            w.fraction = max(self.min_fraction, min(ceiling, current))
            w.recent_fractions.append(w.fraction)
            out[w.key] = w.fraction
        return out

    def _exchange(self, publish: dict[tuple[str, str], float], keys: list[tuple[str, str]]) -> list[float | None]:
        """Write the owned versions' fractions (only while the lease is ours in Redis), read every listed
        version's (a store thread)."""
        ttl_ms = int(self.fraction_ttl_s * 1000)
        for key, fraction in publish.items():
            lease_key, fraction_key = self.leases.key(self.lease_name(key)), self.fraction_key(key)
            ok = self.store.call("drift_fraction", lambda r, lk=lease_key, fk=fraction_key, f=fraction:
                                 self._write_checkpoint(keys=[lk, fk], args=[self.leases.holder, repr(f), ttl_ms],
                                                        client=r))
            self.counts["fractions_published" if ok else "fractions_refused"] += 1
        if not keys:
            return []
        raw = self.store.call("drift_fraction", lambda r: r.mget([self.fraction_key(k) for k in keys]))
        out: list[float | None] = []
        for value in raw:
            try:
                fraction = float(value) if value is not None else None
            except ValueError:
                fraction = None
            if fraction is not None and not 0.0 < fraction <= 1.0:
                fraction = None
            if fraction is None and value is not None:
                self.counts["fractions_unreadable"] += 1
            out.append(fraction)
        return out

    # ----------------------------------------------------------- checkpoints
    async def _checkpoints(self, force: bool, timeout_s: float | None = None) -> None:
        now = self.monotonic()
        for watch in list(self.watches.values()):
            if watch.phase is Phase.OWNED and (force or now - watch.last_checkpoint >= self.checkpoint_interval_s):
                await self._checkpoint(watch, timeout_s)

    async def _checkpoint(self, watch: VersionWatch, timeout_s: float | None = None) -> bool:
        """Save the version's monitor with the entry it has been fed through (fenced by the lease)."""
        if watch.cursor is None:
            return False
        version = tracked_version(self.monitor, watch.key)
        checkpoint = Checkpoint(watch.gen + 1, self.leases.holder, self.wall(), watch.cursor.copy(),
                                version_to_dict(version) if version is not None else None,
                                list(self.monitor.config.context_edges))
        text = checkpoint.to_json()
        watch.last_checkpoint = self.monotonic()
        lease_key = self.leases.key(self.lease_name(watch.key))
        try:
            ok = await self.store.offload(lambda: self.store.call("drift_checkpoint", lambda r: self._write_checkpoint(
                keys=[lease_key, self.checkpoint_key(watch.key)], args=[self.leases.holder, text,
                                                                        self.checkpoint_ttl_ms], client=r)),
                timeout_s)
        except StoreUnavailable:
            watch.counts["checkpoint_failures"] += 1
            return False
        if not ok:  # the lease is not ours in Redis any more: the next round lets go
            watch.counts["checkpoints_refused"] += 1
            return False
        watch.gen = checkpoint.gen
        watch.checkpoint_at = checkpoint.at
        watch.counts["checkpoints"] += 1
        self.counts["checkpoints_bytes"] += len(text)
        return True

    # ---------------------------------------------------------------- status
    def owner_of(self, watch: VersionWatch) -> str:
        """The replica that runs ``watch``'s version: this one, the holder seen when this replica last
        asked for its lease, or "" (unknown)."""
        if watch.phase is Phase.OWNED:
            return self.store.replica_id
        holder = self.leases.held_by(self.lease_name(watch.key)) or ""
        return holder.rsplit("/", 1)[0]

    def status(self) -> list[dict[str, Any]]:
        """Per drafter version known here: who runs its monitor, the evidence lag (owner), what waits here."""
        queued = self.outbox.buffered_by_version()
        out = []
        for key, watch in sorted(self.watches.items()):
            owned = watch.phase is Phase.OWNED
            out.append({
                "drafter_kind": key[0], "drafter_version": key[1], "owner": self.owner_of(watch),
                "owned_here": owned, "phase": watch.phase.value,
                "evidence_lag": watch.lag if owned and watch.lag is not None else 0,
                "evidence_queued": queued.get(key, 0),
                "checkpoint_age_s": (self.wall() - watch.checkpoint_at) if owned and watch.checkpoint_at else -1.0,
                "entries_lost": watch.counts.get("entries_lost", 0) + watch.counts.get("entries_trimmed", 0),
                "sample_fraction": self.sample_fraction(key),
                "counts": dict(watch.counts),
            })
        return out

    def sample_fraction(self, key: tuple[str, str]) -> float:
        """The share of requests this replica forwards of ``key``'s: its own fraction, or the fleet's if lower."""
        published = self.fleet_fractions.get(key)
        own = self.feed.max_fraction
        return min(own, published[0]) if published is not None else own

    def stats(self) -> dict[str, Any]:
        return {"counts": dict(self.counts), "outbox": self.outbox.stats(), "leases": self.leases.stats(),
                "versions": self.status()}


@dataclass(frozen=True)
class UnitCosts:
    """The owner monitor's measured CPU cost per request-step (smoothed, :meth:`CapacityEstimate.unit_costs`)."""

    per_step: float  # seconds observing one request-step
    per_forward: float  # seconds forwarding one of this replica's own kept request-steps (0.0: none yet)


@dataclass
class CapacityEstimate:
    """What the owner's monitor costs, from its feed's measured CPU, smoothed in time.

    Per admission window: the budget handed out; what the drains spent; the part observing request-steps
    (calibrations left out) and the steps observed; the part forwarding this replica's own kept steps and
    how many. Observing costs every admitted outcome, forwarding this replica's share, and the rest
    (calibrations, callbacks, shedding) is a fixed overhead: the fraction scales the first two only. Each
    term is an exponentially weighted rate with time constant ``horizon_s``, so one window spent paying
    back a calibration does not read as "no capacity". The price of a request-step is the one
    ``MonitorFeed.cost_s`` is too (the feed's observing seconds over the steps observed, calibrations left
    out), smoothed here over time rather than over the feed's resizing windows.

    >>> c = CapacityEstimate(horizon_s=10.0)
    >>> c.scale(1000.0, 0.8) is None
    True
    >>> for _ in range(30):  # 20 ms of budget a second: 1,000 steps at 10 µs, 1,000 forwarded at 2 µs
    ...     c.add(1.0, 0.020, 0.012, 0.010, 1000, 0.002, 1000)
    >>> round(c.scale(1000.0, 0.8), 2)  # 16 ms a second to spend, 12 ms spent: room for a third more
    1.33
    >>> u = c.unit_costs()
    >>> round(u.per_step * 1e6, 1), round(u.per_forward * 1e6, 1)  # µs observing, forwarding a step
    (10.0, 2.0)
    >>> round(c.steps_per_s(0.8))  # (16 ms - 2 ms forwarding) / 10 µs
    1400
    >>> round(c.scale(c.steps_per_s(0.8), 0.8), 9)  # that inflow fills the margin exactly: the two agree
    1.0
    >>> c.add(1.0, 0.020, 0.082, 0.010, 1000, 0.002, 1000)  # a 70 ms calibration ...
    >>> c.add(1.0, 0.020, 0.0, 0.0, 0, 0.0, 0)  # ... paid back by the next windows' ticks
    >>> 0.5 < c.scale(1000.0, 0.8) < 1.0  # a dip (spread over the horizon), not a collapse
    True
    """

    horizon_s: float = 10.0
    weight: float = 0.0
    budget: float = 0.0  # CPU seconds of budget a second
    fixed: float = 0.0  # CPU seconds a second spent besides observing and forwarding
    observe_s: float = 0.0  # CPU seconds observing ...
    observed: float = 0.0  # ... the request-steps observed in them
    forward_s: float = 0.0  # CPU seconds forwarding ...
    forwarded: float = 0.0  # ... the request-steps forwarded in them
    forward_rate: float = 0.0  # request-steps a second forwarded

    def add(self, elapsed_s: float, budget_s: float, spent_s: float, observe_s: float, observed: int,
            forward_s: float, forwarded: int) -> None:
        if not 0.0 < elapsed_s < float("inf"):
            return
        keep = math.exp(-elapsed_s / self.horizon_s)
        self.weight = keep * self.weight + (1 - keep)
        self.budget = keep * self.budget + (1 - keep) * budget_s / elapsed_s
        self.fixed = keep * self.fixed + (1 - keep) * max(0.0, spent_s - observe_s - forward_s) / elapsed_s
        self.forward_rate = keep * self.forward_rate + (1 - keep) * forwarded / elapsed_s
        self.observe_s, self.observed = keep * self.observe_s + observe_s, keep * self.observed + observed
        self.forward_s, self.forwarded = keep * self.forward_s + forward_s, keep * self.forwarded + forwarded

    def unit_costs(self) -> UnitCosts | None:
        """CPU seconds per request-step observed and per request-step forwarded, or None while too few steps
        have been observed to trust a cost per step.

        Both :meth:`steps_per_s` (what the owner sheds beyond) and :meth:`scale` (what the published fraction
        moves by) price the budget with these two costs: computed in one place, they cannot disagree on when
        a cost exists (50 steps observed, some CPU measured, some weight gathered) or on a replica that has
        forwarded nothing yet (forwarding then costs nothing, not a division by zero)."""
        if self.observed < 50 or self.observe_s <= 0.0 or self.weight <= 0.0:
            return None
        return UnitCosts(per_step=self.observe_s / self.observed,
                         per_forward=self.forward_s / self.forwarded if self.forwarded > 0 else 0.0)

    def steps_per_s(self, margin: float) -> float | None:
        """Request-steps a second ``margin`` of the budget affords after the fixed overheads and this
        replica's forwarding; None until a cost per step is measured."""
        unit = self.unit_costs()
        if unit is None:
            return None
        left = (margin * self.budget - self.fixed - self.forward_rate * unit.per_forward) / self.weight
        return max(0.0, left) / unit.per_step

    def scale(self, inflow: float, margin: float) -> float | None:
        """The factor on the fraction now in force that makes an inflow of ``inflow`` request-steps a second
        to observe (and this replica's forwarding, at its rate now) fill ``margin`` of the budget left after
        the fixed overheads; None until enough steps are observed for a cost per step."""
        unit = self.unit_costs()
        if unit is None:
            return None
        # The rates are weighted means over the windows seen so far: divide by the weight gathered.
        left = margin * self.budget / self.weight - self.fixed / self.weight
        load = inflow * unit.per_step + self.forward_rate / self.weight * unit.per_forward
        return max(0.0, left) / load if load > 0.0 else None


def _limits_of(key: tuple[str, str]) -> StreamLimits:
    """Limits naming a version, for a queued entry with nothing to feed (its purge matches them)."""
    return StreamLimits(key[0], key[1], 1, 1, 0)
