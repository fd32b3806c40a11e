"""Acceptance evidence shared by every replica: idempotent deltas into fleet totals.

What is shared
--------------
Per stratum (drafter kind × version × context bucket) the fleet holds the
sufficient statistics of :class:`~controller.models.acceptance.StratumPosterior`:
the decayed success and failure evidence of every (position, rank) cell and
the decayed offer counts, in one Redis hash (``acc:<kind>:<version>:<bucket>``:
``t`` the time they are decayed to, ``d``/``w`` the grid, and the four arrays
as packed little-endian doubles).

The delta protocol
------------------
1. Each replica's model keeps a :class:`~controller.models.acceptance.ShareLedger`
   per stratum. At every tick (``AcceptanceModel.tick``) the evidence its own
   workers added since the last tick joins the ledger's pending delta, and the
   delta decays with the posterior: it is always "what this replica added,
   as it weighs now".
2. About once a second :meth:`AcceptanceSync.prepare` seals the pending
   deltas of every stratum into one batch with the next sequence number of
   this writer (``<replica>/<incarnation token>``; a restarted process is a
   new writer, so its sequence may start again at 1). A sealed batch is
   immutable: until Redis confirms it, every attempt resends that same batch,
   and new evidence waits in the ledgers for the next one.
3. One Lua script (:data:`MERGE_LUA`, atomic in Redis) applies the batch only if
   its sequence is above the last one applied for that writer: a retry after
   a timeout whose first attempt did land is skipped, never counted twice. For
   each stratum it decays the totals from their time ``t`` to the delta's time
   (or, for a delta older than the totals, decays the delta instead: time in
   the totals never runs backwards), adds the delta, caps each cell, and in
   the same call returns the totals of every stratum the replica holds.
4. :meth:`AcceptanceSync.install` sets each local posterior to
   ``cap(fleet totals + pending + local carry)`` plus the evidence its workers
   added since its last tick (``StratumPosterior.install_shared``). The policy
   then plans from the fleet's evidence plus the replica's own unmerged part.

Decay and the cap under merging
-------------------------------
Decay is exponential, so it commutes with addition: decaying the totals to
``t`` and adding a delta decayed to ``t`` gives what one model fed every
replica's steps holds at ``t``, whatever the order and timing of pushes.
The cap does not commute (``cap(F + d1 + d2) != cap(cap(F + d1) + d2)``),
and it is applied where the single model applies it: once per cell on the
totals, after each merge, at ``max_evidence`` — the fleet's, not N times one
replica's. So a stratum busy across the whole fleet holds the same bounded
evidence, and follows a change in the same number of observations, as one
busy replica; deltas are never capped (a replica's share is exactly its
observations), the cap scales the sum. A replica's view is capped again at
install, where pending evidence sits on top of the totals. Cells below the
cap (most of them at a few thousand steps per second) see no cap at all and
merge exactly.

The carry (mostly-old cells following the reference cell, stale cells made
uncertain again: ``controller.models.acceptance``) is not linear either. Every
replica sees the same fleet totals, so each computes nearly the same carry;
pushed, it would count once per replica. It stays local: the ledger keeps the
carry's move as a signed adjustment that decays with everything else and is
laid over the totals at each install. Fleet evidence an install brings in is
fresh to the carry's rules (other replicas' workers just tested those cells),
so a cell the fleet keeps testing is never taken for a stale one.

Faults
------
Redis down or slow: the merge fails (counted: ``merge_failures``), the batch
stays sealed and pending, the model keeps planning from its last totals plus
everything its own workers add; nothing on the ingest path waits. When Redis
answers again, the batch goes first (applied, or skipped if it had landed),
then everything gathered meanwhile as the next batch.

Redis restarted without its data: the fleet's ``epoch`` key (a random token
set when the totals are created) is gone. A replica that had synced re-seeds
the store with what it believes the totals are (its posterior without its own
unpushed evidence and its carry: ``StratumPosterior.shared_baseline``) and the
writer sequences it saw with them, so a batch that had landed and is resent
is still skipped exactly when the seed holds it; every replica then pushes its
unmerged evidence as usual. The first replica to set the new epoch seeds; the
others adopt it. A replica that never synced waits ``seed_grace_s`` before
seeding (a replica just started must not replace the fleet's knowledge with
its empty one). The seeder only knows the strata it holds: every other
replica that had synced, on adopting the new epoch, offers in its next round
what it last read of each stratum it had installed, and the first offer of
a stratum the epoch does not mark yet is added to whatever was merged into
it since (and marks it); so a drafter version only other replicas run keeps
its history too. Evidence another replica merged in the last interval and
the seeder had not read yet is lost with the store (about one interval's
worth; ``appendonly yes`` on the Redis side avoids it).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from controller.fleet.store import LUA_DOUBLES, FleetStore, StoreUnavailable
from controller.models.acceptance import AcceptanceModel, DrafterKey, fit_grid

_GRID_LUA = r"""
local function regrid(t, d1, w1, d2, w2)
  if d1 == d2 and w1 == w2 then return t end
  local out = {}
  for i = 1, d2 * w2 do out[i] = 0 end
  for k = 0, math.min(d1, d2) - 1 do
    for r = 0, math.min(w1, w2) - 1 do out[k * w2 + r + 1] = t[k * w1 + r + 1] end
  end
  return out
end
"""

MERGE_LUA = LUA_DOUBLES + _GRID_LUA + r"""
-- KEYS[1] epoch, KEYS[2] writer sequences (hash writer -> "seq|ms"), KEYS[3..] strata:
-- the first ARGV[6] carry a delta; every one is read back.
-- ARGV: 1 expected epoch, 2 writer, 3 seq, 4 half-life s, 5 cap, 6 deltas, 7 now ms, 8 stratum ttl ms,
--       9 writer ttl ms, 10 stratum seeds, then per delta: at, depth, width, succ, fail, asked, offered
--       (packed doubles), then per stratum seed: its KEYS index, at, depth, width, succ, fail, asked, offered.
local epoch = redis.call('GET', KEYS[1])
if not epoch then return {'empty', ''} end
if epoch ~= ARGV[1] then return {'epoch', epoch} end
local writer, seq = ARGV[2], tonumber(ARGV[3])
local hl, cap, n = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local now_ms, ttl, writer_ttl = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local seeds = tonumber(ARGV[10])

-- Evidence (at, d x w, four packed arrays) added into a stratum's totals: decayed to one time, capped.
local function add_into(key, at, d, w, ps, pf, pa, po)
  local cur = redis.call('HMGET', key, 't', 'd', 'w', 's', 'f', 'a', 'o')
  local t0 = tonumber(cur[1])
  local d0, w0 = tonumber(cur[2]) or d, tonumber(cur[3]) or w
  local D, W = math.max(d, d0), math.max(w, w0)
  local ff, fd, t = 1.0, 1.0, at
  if t0 then
    if at >= t0 then ff = 0.5 ^ ((at - t0) / hl) else fd = 0.5 ^ ((t0 - at) / hl); t = t0 end
  end
  local cells = D * W
  local S = regrid(unpack_doubles(cur[4], d0 * w0), d0, w0, D, W)
  local F = regrid(unpack_doubles(cur[5], d0 * w0), d0, w0, D, W)
  local A = regrid(unpack_doubles(cur[6], d0 * w0), d0, w0, D, W)
  local O = regrid(unpack_doubles(cur[7], d0 * w0), d0, w0, D, W)
  local dS = regrid(unpack_doubles(ps, d * w), d, w, D, W)
  local dF = regrid(unpack_doubles(pf, d * w), d, w, D, W)
  local dA = regrid(unpack_doubles(pa, d * w), d, w, D, W)
  local dO = regrid(unpack_doubles(po, d * w), d, w, D, W)
  for c = 1, cells do
    local s, f = S[c] * ff + dS[c] * fd, F[c] * ff + dF[c] * fd
    local tot = s + f
    if tot > cap then s, f = s * cap / tot, f * cap / tot end
    S[c], F[c] = s, f
    local a, o = A[c] * ff + dA[c] * fd, O[c] * ff + dO[c] * fd
    if a > cap then a, o = cap, o * cap / a end
    A[c], O[c] = a, o
  end
  redis.call('HSET', key, 't', string.format('%.17g', t), 'd', D, 'w', W, 's', pack_doubles(S, cells),
             'f', pack_doubles(F, cells), 'a', pack_doubles(A, cells), 'o', pack_doubles(O, cells))
  redis.call('PEXPIRE', key, ttl)
end

-- A stratum the epoch's seeder did not hold: the first replica to offer what it last read of it adds
-- that to whatever was merged into it since (the mark makes it once per epoch).
local reseeded = 0
local base = 10 + n * 7
for i = 1, seeds do
  local b = base + (i - 1) * 8
  local key = KEYS[tonumber(ARGV[b + 1])]
  if redis.call('HGET', key, 'e') ~= epoch then
    add_into(key, tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4]),
             ARGV[b + 5], ARGV[b + 6], ARGV[b + 7], ARGV[b + 8])
    redis.call('HSET', key, 'e', epoch)
    reseeded = reseeded + 1
  end
end

local last_seq = 0
local last = redis.call('HGET', KEYS[2], writer)
if last then last_seq = tonumber(string.match(last, '^(%d+)')) end
local applied = 0
if n > 0 and seq > last_seq then
  applied = 1
  for i = 1, n do
    local b = 10 + (i - 1) * 7
    add_into(KEYS[2 + i], tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3]),
             ARGV[b + 4], ARGV[b + 5], ARGV[b + 6], ARGV[b + 7])
  end
  redis.call('HSET', KEYS[2], writer, string.format('%d|%d', seq, now_ms))
  -- Writers are per process incarnation: forget the long-gone ones.
  if redis.call('HLEN', KEYS[2]) > 64 then
    local all = redis.call('HGETALL', KEYS[2])
    for j = 1, #all, 2 do
      local ms = tonumber(string.match(all[j + 1], '|(%d+)$'))
      if ms and ms < now_ms - writer_ttl then redis.call('HDEL', KEYS[2], all[j]) end
    end
  end
end
local out = {'ok', epoch, applied, redis.call('HGETALL', KEYS[2]), reseeded}
for i = 3, #KEYS do out[#out + 1] = redis.call('HMGET', KEYS[i], 't', 'd', 'w', 's', 'f', 'a', 'o') end
return out
"""

SEED_LUA = r"""
-- KEYS[1] epoch, KEYS[2] writer sequences, KEYS[3..] strata.
-- ARGV: 1 new epoch token, 2 stratum ttl ms, 3 writer entries m, then m (writer, value) pairs,
--       then per stratum: t, depth, width, succ, fail, asked, offered.
if not redis.call('SET', KEYS[1], ARGV[1], 'NX') then return {'taken', redis.call('GET', KEYS[1]) or ''} end
redis.call('DEL', KEYS[2])
local m = tonumber(ARGV[3])
for i = 1, m do redis.call('HSET', KEYS[2], ARGV[2 + 2 * i], ARGV[3 + 2 * i]) end
local b0 = 3 + 2 * m
for i = 3, #KEYS do
  local b = b0 + (i - 3) * 7
  redis.call('DEL', KEYS[i])
  redis.call('HSET', KEYS[i], 't', ARGV[b + 1], 'd', ARGV[b + 2], 'w', ARGV[b + 3], 's', ARGV[b + 4],
             'f', ARGV[b + 5], 'a', ARGV[b + 6], 'o', ARGV[b + 7], 'e', ARGV[1])
  redis.call('PEXPIRE', KEYS[i], tonumber(ARGV[2]))
end
return {'seeded', ARGV[1]}
"""

StratumId = tuple[DrafterKey, int]  # (drafter key, context bucket)


@dataclass(frozen=True)
class _Delta:
    """One stratum's share of a batch: flat arrays decayed to ``at``."""

    stratum: StratumId
    at: float
    depth: int
    width: int
    succ: np.ndarray
    fail: np.ndarray
    asked: np.ndarray
    offered: np.ndarray


@dataclass(frozen=True)
class _Batch:
    """A sealed, immutable push: resent as is until Redis confirms it."""

    seq: int
    deltas: tuple[_Delta, ...]
    sealed_at: float  # monotonic


@dataclass(frozen=True)
class SyncJob:
    """What one merge round sends (built on the loop by :meth:`AcceptanceSync.prepare`)."""

    batch: _Batch | None
    reads: tuple[StratumId, ...]  # the batch's strata first, then every other stratum held
    seed: tuple[tuple[StratumId, float, int, int, tuple[np.ndarray, ...]], ...] | None
    seed_writers: tuple[tuple[str, str], ...]
    # After adopting an epoch another replica seeded: what this one last read of its installed strata.
    stratum_seeds: tuple[tuple[StratumId, float, int, int, tuple[np.ndarray, ...]], ...] = ()


@dataclass(frozen=True)
class SyncReply:
    """What Redis answered (read on the store's thread by :meth:`AcceptanceSync.exchange`)."""

    # "ok" | "empty" (the store has no epoch: it lost its data or was never seeded) | "epoch" (another
    # replica seeded a new epoch: nothing merged, this replica offers its strata in the next round)
    status: str
    job: SyncJob
    applied: bool = False  # the batch was applied now (False: none, or a resend already applied)
    epoch_changed: bool = False
    seeded: bool = False
    writers: tuple[tuple[str, str], ...] = ()
    totals: tuple[tuple[StratumId, float, int, int, tuple[np.ndarray, ...]] | None, ...] = ()
    reseeded: int = 0  # stratum seeds that landed


class AcceptanceSync:
    """Shares one :class:`AcceptanceModel` with every replica of the fleet.

    Parameters
    ----------
    model : AcceptanceModel
        The controller's model (``share_with_fleet`` is called on it).
    store : FleetStore
    stratum_ttl_s : float
        A stratum nobody pushes to expires from Redis after this.
    seed_grace_s : float
        How long a replica that never synced waits before seeding an empty
        store itself (module docstring, Faults).
    namespace : str
        Key family in the fleet store (``acc``: the strict rule's model;
        the controller shares its typical-rule model as ``acct``).
    clock : callable
        Monotonic clock (grace, ages); the model's own times are the
        controller's clock, passed in by ``AcceptanceModel.tick``.

    Notes
    -----
    Threads: :meth:`prepare` and :meth:`install` touch the model and run on
    the thread that owns it (the controller's event loop); :meth:`exchange`
    runs on a store thread and touches only the job and the epoch.
    :meth:`sync_once` does the three in order without blocking the loop.
    """

    def __init__(self, model: AcceptanceModel, store: FleetStore, *, stratum_ttl_s: float = 7 * 86400.0,
                 seed_grace_s: float = 3.0, namespace: str = "acc",
                 clock: Callable[[], float] = time.monotonic) -> None:
        model.share_with_fleet()
        self.model = model
        self.store = store
        # Key family: the strict rule's model and the typical rule's are shared apart ("acc", "acct"),
        # each with its own epoch and writer sequences.
        self.namespace = namespace
        self._epoch_key = store.key(f"{namespace}-epoch")
        self._writers_key = store.key(f"{namespace}-writers")
        self.writer = store.incarnation
        self.stratum_ttl_ms = int(stratum_ttl_s * 1000)
        self.writer_ttl_ms = 86_400_000  # a writer's sequence is kept a day after its last push
        self.seed_grace_s = seed_grace_s
        self.clock = clock
        self.counts: Counter = Counter()
        self._merge = store.script(MERGE_LUA)
        self._seed = store.script(SEED_LUA)
        self._seq = 0
        self._inflight: _Batch | None = None
        self._writers: tuple[tuple[str, str], ...] = ()  # writer sequences seen with the last totals
        self._synced = False  # installed fleet totals at least once
        self._installed: set[StratumId] = set()  # strata with fleet totals installed at least once
        self._reseed = False  # a new epoch another replica seeded: offer our strata in the next round
        self._empty_since: float | None = None
        self._want_seed = False
        self._epoch: str | None = None  # store-thread state (exchange); one exchange at a time
        self._exchange_lock = threading.Lock()
        self._keys: dict[StratumId, str] = {}
        self._to_install: dict[StratumId, tuple] = {}  # fleet totals read, not yet installed (drain)
        self._known: set[DrafterKey] = set()  # versions with fleet totals installed
        self.last_merge_at = float("nan")  # monotonic, last successful merge
        self.last_merge_s = float("nan")  # its round trip, store thread

    # ---------------------------------------------------------------- keys
    def stratum_key(self, stratum: StratumId) -> str:
        key = self._keys.get(stratum)
        if key is None:  # quoting costs more than the rest of a stratum's round: done once
            (kind, version), bucket = stratum
            key = self._keys[stratum] = self.store.key(self.namespace, kind, version, str(bucket))
            if len(self._keys) > 4096:
                self._keys.clear()
        return key

    # --------------------------------------------------- on the model's thread
    def prepare(self) -> SyncJob:
        """Seal the pending deltas into a batch (unless one is still unconfirmed) and say what to read."""
        if self._inflight is None:
            deltas = []
            for key, buckets in self.model.items():
                for bucket, post in enumerate(buckets):
                    ledger = post.ledger
                    if ledger is None or not ledger.has_pending():
                        continue
                    s, f, a, o = ledger.take_pending()
                    deltas.append(_Delta((key, bucket), post.updated_at, post.max_depth, post.max_width, s, f, a, o))
            if deltas:
                self._seq += 1
                self._inflight = _Batch(self._seq, tuple(deltas), self.clock())
                self.counts["batches_sealed"] += 1
        else:
            self.counts["batches_resent"] += 1
        batch = self._inflight
        reads = [d.stratum for d in batch.deltas] if batch else []
        seen = set(reads)
        for key, buckets in self.model.items():
            for bucket in range(len(buckets)):
                if (key, bucket) not in seen:
                    reads.append((key, bucket))
        seed = self._seed_view() if self._want_seed else None
        stratum_seeds: tuple = ()
        if self._reseed and seed is None:
            stratum_seeds = tuple(entry for entry in self._seed_view() if entry[0] in self._installed)
        return SyncJob(batch, tuple(reads), seed, self._writers if seed is not None else (), stratum_seeds)

    def _seed_view(self) -> tuple:
        """Every stratum as this replica believes the fleet holds it (its sealed batch taken out too)."""
        inflight = {d.stratum: d for d in self._inflight.deltas} if self._inflight else {}
        hl = self.model.half_life_s
        out = []
        for key, buckets in self.model.items():
            for bucket, post in enumerate(buckets):
                if post.ledger is None or post.updated_at is None:
                    continue
                arrays = list(post.shared_baseline())
                delta = inflight.get((key, bucket))
                if delta is not None:
                    g = 0.5 ** ((post.updated_at - delta.at) / hl)
                    for i, x in enumerate((delta.succ, delta.fail, delta.asked, delta.offered)):
                        grid = fit_grid(x.reshape(delta.depth, delta.width), post.max_depth, post.max_width)
                        arrays[i] = np.maximum(arrays[i] - grid * g, 0.0)
                out.append(((key, bucket), post.updated_at, post.max_depth, post.max_width, tuple(arrays)))
        return tuple(out)

    def install(self, reply: SyncReply, budget_s: float | None = None) -> bool:
        """Apply a merge's answer to the model; True if it brought fleet totals.

        Parameters
        ----------
        reply : SyncReply
        budget_s : float or None
            Loop time to spend installing strata now (about 35 µs each); the
            rest wait for :meth:`drain` (each stratum's install is
            self-contained, so they may land over several ticks). None: all now.
        """
        self.counts["epochs_adopted"] += reply.epoch_changed
        self.counts["seeds"] += reply.seeded
        if reply.status == "empty":
            self.counts["store_empty"] += 1
            now = self.clock()
            if self._empty_since is None:
                self._empty_since = now
            # A replica that holds fleet knowledge re-seeds at once; a new one gives them time.
            self._want_seed = self._synced or now - self._empty_since >= self.seed_grace_s
            return False
        self._empty_since = None
        self._want_seed = False
        if reply.status == "epoch":  # nothing merged: the next round offers what we knew, then merges
            self._reseed = True
            return False
        if reply.job.stratum_seeds:
            self._reseed = False
            self.counts["strata_reseeded"] += reply.reseeded
        batch = reply.job.batch
        if batch is not None and batch is self._inflight:
            self._inflight = None
            self.counts["batches_applied" if reply.applied else "batches_already_applied"] += 1
        self._writers = reply.writers
        for entry in reply.totals:
            if entry is not None:
                self._to_install[entry[0]] = entry  # a newer answer replaces one not yet installed
        self._synced = True
        self.counts["merges"] += 1
        self.last_merge_at = self.clock()
        self.drain(budget_s)
        return True

    def drain(self, budget_s: float | None = None) -> int:
        """Install fleet totals still waiting, for up to ``budget_s`` of this thread's time
        (None: all); the number installed."""
        hl, cap = self.model.half_life_s, self.model.max_evidence
        start = time.perf_counter()
        done = 0
        while self._to_install:
            if budget_s is not None and done and time.perf_counter() - start >= budget_s:
                break
            stratum, entry = next(iter(self._to_install.items()))
            del self._to_install[stratum]
            (key, bucket), at, depth, width, arrays = entry
            buckets = self.model.peek(key)
            if buckets is None or bucket >= len(buckets) or buckets[bucket].ledger is None:
                continue  # evicted meanwhile
            grids = [x.reshape(depth, width) for x in arrays]
            buckets[bucket].install_shared(*grids, at=at, half_life_s=hl, max_evidence=cap)
            self.counts["strata_installed"] += 1
            self._installed.add(stratum)
            self._known.add(key)
            done += 1
        return done

    def knows(self, key: DrafterKey) -> bool:
        """True once fleet totals of some stratum of drafter version ``key`` were installed here: a worker
        of a version this replica just met (a failover) should get its first plan after that, not from the
        prior."""
        return key in self._known

    def failed(self, err: StoreUnavailable) -> None:
        """Count a merge that did not complete; the batch stays sealed for the next round."""
        self.counts["merge_failures"] += 1

    # ----------------------------------------------------- on a store thread
    def exchange(self, job: SyncJob, client) -> SyncReply:
        """The round trip: seed if asked, then merge (adopting a new epoch once if Redis has one)."""
        with self._exchange_lock:
            start = time.perf_counter()
            epoch_changed = seeded = False
            if job.seed is not None:
                token = self.store.incarnation + "/" + format(time.time_ns(), "x")
                keys, args = [self._epoch_key, self._writers_key], [token, self.stratum_ttl_ms]
                args.append(len(job.seed_writers))
                for writer, value in job.seed_writers:
                    args += [writer, value]
                for stratum, at, depth, width, arrays in job.seed:
                    keys.append(self.stratum_key(stratum))
                    args += [repr(float(at)), depth, width, *(np.ascontiguousarray(x, "<f8").tobytes() for x in arrays)]
                answer = self._seed(keys=keys, args=args, client=client)
                seeded = answer[0] == b"seeded"
                self._epoch = _text(answer[1]) or None
                epoch_changed = True
            for _ in range(3):
                answer = self._merge(keys=self._merge_keys(job), args=self._merge_args(job), client=client)
                status = _text(answer[0])
                if status == "epoch":
                    self._epoch = _text(answer[1])
                    epoch_changed = True
                    if self._synced and not seeded:
                        # Another replica re-seeded a store that lost its data. Installing its totals now
                        # would replace what we knew of strata it does not hold: offer those first.
                        return SyncReply("epoch", job, epoch_changed=True)
                    continue
                if status == "empty":
                    self._epoch = None
                    return SyncReply("empty", job, epoch_changed=epoch_changed, seeded=seeded)
                self.last_merge_s = time.perf_counter() - start
                return self._parse(job, answer, epoch_changed, seeded)
            raise StoreUnavailable("acceptance_merge", "the fleet epoch changed three times in one round")

    def _merge_keys(self, job: SyncJob) -> list[str]:
        return [self._epoch_key, self._writers_key, *map(self.stratum_key, job.reads)]

    def _merge_args(self, job: SyncJob) -> list[Any]:
        batch = job.batch
        deltas = batch.deltas if batch is not None else ()
        args: list[Any] = [self._epoch or "", self.writer, batch.seq if batch else 0, repr(self.model.half_life_s),
                           repr(self.model.max_evidence), len(deltas), int(time.time() * 1000), self.stratum_ttl_ms,
                           self.writer_ttl_ms, len(job.stratum_seeds)]
        for d in deltas:
            args += [repr(float(d.at)), d.depth, d.width, d.succ.astype("<f8").tobytes(),
                     d.fail.astype("<f8").tobytes(), d.asked.astype("<f8").tobytes(),
                     d.offered.astype("<f8").tobytes()]
        index = {stratum: i + 3 for i, stratum in enumerate(job.reads)}  # KEYS is 1-based: strata from 3
        for stratum, at, depth, width, arrays in job.stratum_seeds:
            args += [index[stratum], repr(float(at)), depth, width,
                     *(np.ascontiguousarray(x, "<f8").tobytes() for x in arrays)]
        return args

    def _parse(self, job: SyncJob, answer: list, epoch_changed: bool, seeded: bool) -> SyncReply:
        flat = answer[3]
        writers = tuple((_text(flat[i]), _text(flat[i + 1])) for i in range(0, len(flat), 2))
        totals = []
        for stratum, fields in zip(job.reads, answer[5:]):
            t, d, w, *packed = fields
            if t is None or d is None or any(p is None for p in packed):
                totals.append(None)
                continue
            depth, width = int(d), int(w)
            arrays = tuple(np.frombuffer(p, dtype="<f8").astype(float) for p in packed)
            if any(len(x) != depth * width for x in arrays):
                raise StoreUnavailable("acceptance_merge", f"stratum {stratum}: stored arrays do not match "
                                                           f"{depth}x{width}")
            totals.append((stratum, float(t), depth, width, arrays))
        return SyncReply("ok", job, applied=bool(answer[2]), epoch_changed=epoch_changed, seeded=seeded,
                         reseeded=int(answer[4]),
                         writers=writers, totals=tuple(totals))

    # ------------------------------------------------------------- driving
    def merge_now(self) -> bool:
        """One round on this thread (tests, benchmarks, a synchronous caller that owns the model)."""
        job = self.prepare()
        try:
            reply = self.store.call("acceptance_merge", lambda client: self.exchange(job, client))
        except StoreUnavailable as err:
            self.failed(err)
            return False
        return self.install(reply)

    async def sync_once(self, timeout_s: float | None = None, install_budget_s: float | None = None) -> bool:
        """One round from the event loop: prepare here, the round trip on a store thread, install here
        (at most ``install_budget_s`` of it now; the housekeeping tick then calls :meth:`drain`)."""
        job = self.prepare()
        try:
            reply = await self.store.run("acceptance_merge", lambda client: self.exchange(job, client), timeout_s)
        except StoreUnavailable as err:
            self.failed(err)
            return False
        return self.install(reply, install_budget_s)

    # --------------------------------------------------------------- status
    def status(self) -> dict[str, Any]:
        """What GetStatus and /metrics say about sharing (model's thread)."""
        pending = 0.0
        for _, buckets in self.model.items():
            for post in buckets:
                if post.ledger is not None:
                    pending += float(post.ledger.pending_succ.sum() + post.ledger.pending_fail.sum())
        batch = self._inflight
        unconfirmed = float(sum(d.succ.sum() + d.fail.sum() for d in batch.deltas)) if batch else 0.0
        return {
            "writer": self.writer, "epoch": self._epoch, "synced": self._synced, "counts": dict(self.counts),
            "unmerged_evidence": pending + unconfirmed,
            "unconfirmed_batch": batch.seq if batch else None,
            "strata_to_install": len(self._to_install),
            "unconfirmed_for_s": self.clock() - batch.sealed_at if batch else 0.0,
            "since_merge_s": self.clock() - self.last_merge_at if self.last_merge_at == self.last_merge_at else None,
            "last_merge_ms": self.last_merge_s * 1000.0,
        }


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)
