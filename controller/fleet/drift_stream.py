"""Drift evidence on its way to the replica that watches its drafter version: codec and outbox.

With several replicas, one replica runs the drift monitor of a drafter version
(:mod:`controller.fleet.drift_owner`); every replica's sampled request-step
outcomes of that version reach it through a Redis stream per version,
``drift:evidence:<kind>:<version>``. What the monitor needs of a request-step
is small: its context length, accepted length, depth, the accepted rank and the
number of candidates per level of a tree, and the domain tag; with the worker
id, the step's timestamp and the drafter's limits once per step.

* :func:`encode_groups` / :func:`decode_groups` — the compact binary form of
  one stream entry: tables of the entry's workers, domains and drafter limits,
  then per step a group of fixed-size outcome records (a few bytes each),
  zlib-compressed as a whole. A worker that moved to another drafter version
  leaves a marker group in the old version's stream (``moved_to``), so the
  version's monitor can retire it as one controller does.
* :class:`EvidenceOutbox` — this replica's writer. The drift feed hands it
  every sampled step on the event loop (an append under a lock); a store
  thread seals what accumulated into one entry per version, numbered per
  version and writer (``seq``), and sends all entries in one pipeline
  (``XADD ... MAXLEN ~ maxlen``). An entry that failed to send is sent again
  with the same number, so the reader skips the copy if the first attempt had
  landed. While Redis is down entries wait, up to ``max_buffered`` outcomes;
  beyond that the oldest are dropped and counted, and ingest never waits.

Examples
--------
>>> limits = StreamLimits("eagle", "v1", 6, 1, 8192)
>>> groups = [EvidenceGroup("w0", 12.5, limits, (Outcome(300, 2, 4, (), (), ""), Outcome(5000, 0, 4, (), (), "code"))),
...           EvidenceGroup("w1", 12.75, limits, (Outcome(700, 3, 3, (1, 2, 1), (2, 2, 2), ""),)),
...           EvidenceGroup("w0", 13.0, limits, (), moved_to="eagle/v2")]
>>> data = encode_groups(groups)
>>> decode_groups(data) == groups
True
"""

from __future__ import annotations

import struct
import threading
import time
import zlib
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

from controller.fleet.store import FleetStore

FORMAT = 1
_HEAD = struct.Struct("<BHHH")  # format, workers, domains, limits
_STR = struct.Struct("<H")  # string length
_LIMITS = struct.Struct("<BBI")  # max_depth, max_width, trained_context_len
_GROUP = struct.Struct("<HdHH")  # worker index, timestamp, limits index (MARKER: moved), outcomes
_OUTCOME = struct.Struct("<IBBHB")  # context_len, accepted, depth, domain index, levels reported
MARKER = 0xFFFF
U8 = 255


class Outcome(NamedTuple):
    """One request's part of one step, as the drift monitor reads it (``observe_request``'s order)."""

    context_len: int
    accepted: int
    depth: int
    accepted_rank: tuple[int, ...]
    level_candidates: tuple[int, ...]
    domain: str


@dataclass(frozen=True, slots=True)
class StreamLimits:
    """The drafter limits the monitor reads (``DrafterLimits``' fields of the same names)."""

    kind: str
    version: str
    max_depth: int
    max_width: int
    trained_context_len: int

    @classmethod
    def of(cls, limits: Any) -> "StreamLimits":
        return cls(str(limits.kind), str(limits.version), int(limits.max_depth), int(limits.max_width),
                   int(getattr(limits, "trained_context_len", 0) or 0))

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.version)

    @property
    def label(self) -> str:
        return f"{self.kind}/{self.version}"


@dataclass(frozen=True, slots=True)
class EvidenceGroup:
    """One worker's sampled request-steps of one engine step, or (``moved_to`` set, no outcomes) the
    marker of a worker that left this drafter version for ``moved_to`` (``kind/version``)."""

    worker_id: str
    timestamp: float
    limits: StreamLimits
    outcomes: tuple[Outcome, ...]
    moved_to: str = ""


def _put_str(out: bytearray, text: str, what: str) -> None:
    raw = text.encode()
    if len(raw) > 0xFFFF:
        raise ValueError(f"{what} {text[:40]!r}...: {len(raw)} bytes, at most 65535")
    out += _STR.pack(len(raw))
    out += raw


def _u8(value: int, what: str) -> int:
    if not 0 <= value <= U8:
        raise ValueError(f"{what} {value} must be in 0..255")
    return value


def encode_groups(groups: Sequence[EvidenceGroup]) -> bytes:
    """One stream entry's payload: the groups of one drafter version (all ``limits`` of one kind/version).

    Raises
    ------
    ValueError
        A field outside what the wire form holds, named with its value (the
        controller's validation keeps real reports inside it).
    """
    if not groups:
        raise ValueError("groups: at least one group per entry")
    key = groups[0].limits.key
    workers: dict[str, int] = {}
    domains: dict[str, int] = {"": 0}
    limits: dict[tuple[int, int, int], int] = {}
    body = bytearray()
    for g in groups:
        if g.limits.key != key:
            raise ValueError(f"limits {g.limits.label!r}: an entry holds one drafter version ({key[0]}/{key[1]})")
        w = workers.setdefault(g.worker_id, len(workers))
        if g.moved_to:
            if g.outcomes:
                raise ValueError(f"moved_to {g.moved_to!r}: a marker carries no outcomes")
            body += _GROUP.pack(w, g.timestamp, MARKER, 0)
            _put_str(body, g.moved_to, "moved_to")
            continue
        lim = (g.limits.max_depth, g.limits.max_width, g.limits.trained_context_len)
        li = limits.setdefault(lim, len(limits))
        if len(g.outcomes) > 0xFFFF:
            raise ValueError(f"outcomes: {len(g.outcomes)} in one step, at most 65535")
        body += _GROUP.pack(w, g.timestamp, li, len(g.outcomes))
        for o in g.outcomes:
            ctx, accepted, depth, ranks, cands, domain = o
            ranks, cands = ranks or (), cands or ()
            if len(ranks) != len(cands):
                raise ValueError(f"level_candidates: {len(cands)} entries, accepted_rank has {len(ranks)}")
            if not 0 <= ctx <= 0xFFFFFFFF:
                raise ValueError(f"context_len {ctx} must be in 0..4294967295")
            d = domains.setdefault(domain, len(domains))
            body += _OUTCOME.pack(ctx, _u8(accepted, "accepted"), _u8(depth, "depth"), d,
                                  _u8(len(ranks), "levels reported"))
            body += bytes(_u8(r, "accepted_rank") for r in ranks)
            body += bytes(_u8(c, "level_candidates") for c in cands)
    for what, table in (("workers", workers), ("domains", domains), ("limits", limits)):
        if len(table) > 0xFFFE:
            raise ValueError(f"{what}: {len(table)} distinct in one entry, at most 65534")
    head = bytearray(_HEAD.pack(FORMAT, len(workers), len(domains), len(limits)))
    _put_str(head, key[0], "kind")
    _put_str(head, key[1], "version")
    for name in workers:
        _put_str(head, name, "worker_id")
    for name in domains:
        _put_str(head, name, "domain")
    for lim in limits:
        head += _LIMITS.pack(_u8(lim[0], "max_depth"), _u8(lim[1], "max_width"), lim[2])
    return zlib.compress(bytes(head + body), 1)


def decode_groups(data: bytes) -> list[EvidenceGroup]:
    """The groups of one entry (:func:`encode_groups`' inverse). Raises ValueError on a malformed entry."""
    try:
        raw = zlib.decompress(data)
        fmt, n_workers, n_domains, n_limits = _HEAD.unpack_from(raw, 0)
        if fmt != FORMAT:
            raise ValueError(f"format {fmt}, this replica reads {FORMAT}")
        pos = _HEAD.size

        def string() -> str:
            nonlocal pos
            (n,) = _STR.unpack_from(raw, pos)
            pos += _STR.size
            text = raw[pos:pos + n].decode()
            pos += n
            return text

        kind, version = string(), string()
        workers = [string() for _ in range(n_workers)]
        domains = [string() for _ in range(n_domains)]
        limits = []
        for _ in range(n_limits):
            depth, width, trained = _LIMITS.unpack_from(raw, pos)
            pos += _LIMITS.size
            limits.append(StreamLimits(kind, version, depth, width, trained))
        marker_limits = limits[0] if limits else StreamLimits(kind, version, 1, 1, 0)
        groups = []
        end = len(raw)
        while pos < end:
            w, ts, li, n = _GROUP.unpack_from(raw, pos)
            pos += _GROUP.size
            if li == MARKER:
                groups.append(EvidenceGroup(workers[w], ts, marker_limits, (), string()))
                continue
            outcomes = []
            for _ in range(n):
                ctx, accepted, depth, d, levels = _OUTCOME.unpack_from(raw, pos)
                pos += _OUTCOME.size
                ranks = tuple(raw[pos:pos + levels])
                cands = tuple(raw[pos + levels:pos + 2 * levels])
                pos += 2 * levels
                outcomes.append(Outcome(ctx, accepted, depth, ranks, cands, domains[d]))
            groups.append(EvidenceGroup(workers[w], ts, limits[li], tuple(outcomes)))
        if pos != end:
            raise ValueError(f"{end - pos} bytes past the last group")
        return groups
    except (struct.error, IndexError, UnicodeDecodeError, zlib.error) as err:
        raise ValueError(f"malformed evidence entry: {type(err).__name__}: {err}") from err


@dataclass(eq=False)
class SealedEntry:
    """One stream entry ready to send (again, with the same ``seq``, until it lands)."""

    key: tuple[str, str]
    seq: int
    outcomes: int
    payload: bytes


@dataclass
class _Pending:
    groups: list[EvidenceGroup] = field(default_factory=list)
    outcomes: int = 0


class EvidenceOutbox:
    """This replica's sampled outcomes, queued per drafter version and sent to the versions' streams.

    Parameters
    ----------
    store : FleetStore
    maxlen : int
        Entries each version's stream is trimmed to, about (``XADD MAXLEN ~``):
        what a new owner can still read back after a handover.
    max_buffered : int
        Outcomes waiting here (Redis down or slow); beyond it the oldest are
        dropped and counted.
    stream_ttl_s : float
        A stream nobody writes to expires after this (refreshed about once a minute).
    clock : callable
        Monotonic clock (when each version was last seen here).
    """

    def __init__(self, store: FleetStore, *, maxlen: int = 10_000, max_buffered: int = 50_000,
                 stream_ttl_s: float = 7 * 86400.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.writer = store.incarnation
        self.maxlen = maxlen
        self.max_buffered = max_buffered
        self.stream_ttl_ms = int(stream_ttl_s * 1000)
        self.clock = clock
        self.counts: Counter = Counter()  # outcomes: added, sent, dropped; entries: entries_sent, markers
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._pending: dict[tuple[str, str], _Pending] = {}
        self._sealed: deque[SealedEntry] = deque()
        self._buffered = 0  # outcomes pending or sealed
        self._seq: Counter = Counter()
        self._seen: dict[tuple[str, str], float] = {}  # version -> when this replica last had outcomes of it
        self._worker_version: OrderedDict[str, StreamLimits] = OrderedDict()
        self._expired_at: dict[tuple[str, str], float] = {}

    def stream_key(self, key: tuple[str, str]) -> str:
        return self.store.key("drift", "evidence", key[0], key[1])

    # ------------------------------------------------------------ the event loop
    def add(self, limits: Any, worker_id: str, timestamp: float, kept: Sequence[Sequence[Any]]) -> None:
        """One step's sampled outcomes (``MonitorFeed``'s rows: context, accepted, depth, ranks, candidates,
        domain) of a worker running ``limits``; never blocks on Redis."""
        lim = StreamLimits.of(limits)
        group = EvidenceGroup(worker_id, float(timestamp or 0.0), lim, tuple(Outcome(*o) for o in kept))
        now = self.clock()
        with self._lock:
            before = self._worker_version.get(worker_id)
            if before is None or before.key != lim.key:
                self._worker_version[worker_id] = lim
                self._worker_version.move_to_end(worker_id)
                while len(self._worker_version) > 100_000:
                    self._worker_version.popitem(last=False)
                if before is not None:  # the old version's monitor retires it when nobody runs it any more
                    self._queue(before.key, EvidenceGroup(worker_id, group.timestamp, before, (), lim.label))
                    self.counts["markers"] += 1
            self._queue(lim.key, group)
            self._seen[lim.key] = now
            self.counts["added"] += len(group.outcomes)
            self._buffered += len(group.outcomes)
            self._trim()

    def _queue(self, key: tuple[str, str], group: EvidenceGroup) -> None:
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = _Pending()
        pending.groups.append(group)
        pending.outcomes += len(group.outcomes)

    def _trim(self) -> None:
        """Drop the oldest outcomes beyond ``max_buffered`` (sealed entries first: they are the oldest)."""
        while self._buffered > self.max_buffered and self._sealed:
            entry = self._sealed.popleft()
            self._buffered -= entry.outcomes
            self.counts["dropped"] += entry.outcomes
        if self._buffered <= self.max_buffered:
            return
        for pending in self._pending.values():
            while pending.groups and self._buffered > self.max_buffered:
                dropped = pending.groups.pop(0)
                pending.outcomes -= len(dropped.outcomes)
                self._buffered -= len(dropped.outcomes)
                self.counts["dropped"] += len(dropped.outcomes)

    def versions_seen(self, within_s: float) -> set[tuple[str, str]]:
        """Drafter versions this replica had outcomes of in the last ``within_s`` seconds."""
        cutoff = self.clock() - within_s
        with self._lock:
            return {k for k, t in self._seen.items() if t >= cutoff}

    def buffered(self) -> int:
        """Outcomes waiting here to be sent."""
        with self._lock:
            return self._buffered

    def buffered_by_version(self) -> dict[tuple[str, str], int]:
        with self._lock:
            out: Counter = Counter({k: p.outcomes for k, p in self._pending.items() if p.outcomes})
            for entry in self._sealed:
                out[entry.key] += entry.outcomes
            return dict(out)

    # ------------------------------------------------------------ a store thread
    def flush(self) -> int:
        """Seal what accumulated (one entry per version) and send every waiting entry in one pipeline;
        returns the entries sent. Raises :class:`~controller.fleet.store.StoreUnavailable` (the entries
        stay, and are sent again with the same numbers). One flush at a time: a second caller returns 0."""
        if not self._flush_lock.acquire(blocking=False):
            return 0
        try:
            self._seal()
            with self._lock:
                batch = list(self._sealed)
            if not batch:
                return 0
            now = self.clock()
            expire = {e.key for e in batch if now - self._expired_at.get(e.key, float("-inf")) >= 60.0}
            self.store.call("drift_evidence", lambda r: self._send(r, batch, expire))
            for key in expire:
                self._expired_at[key] = now
            sent = set(map(id, batch))
            with self._lock:
                # Only what was sent: add() may have trimmed or sealed meanwhile.
                while self._sealed and id(self._sealed[0]) in sent:
                    entry = self._sealed.popleft()
                    self._buffered -= entry.outcomes
                    self.counts["sent"] += entry.outcomes
                    self.counts["entries_sent"] += 1
                    self.counts["bytes_sent"] += len(entry.payload)
            return len(batch)
        finally:
            self._flush_lock.release()

    def _seal(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        sealed = []
        for key, p in pending.items():
            if not p.groups:
                continue
            payload = encode_groups(p.groups)
            sealed.append((key, p.outcomes, payload))
        with self._lock:
            for key, outcomes, payload in sealed:
                self._seq[key] += 1
                self._sealed.append(SealedEntry(key, self._seq[key], outcomes, payload))

    def _send(self, client, batch: list[SealedEntry], expire: set[tuple[str, str]]) -> None:
        pipe = client.pipeline(transaction=False)
        for entry in batch:
            pipe.xadd(self.stream_key(entry.key), {"w": self.writer, "s": entry.seq, "n": entry.outcomes,
                                                   "d": entry.payload}, maxlen=self.maxlen, approximate=True)
        for key in expire:
            pipe.pexpire(self.stream_key(key), self.stream_ttl_ms)
        pipe.execute()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"counts": dict(self.counts), "buffered": self._buffered, "sealed": len(self._sealed)}
