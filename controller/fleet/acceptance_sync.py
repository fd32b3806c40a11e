"""Acceptance evidence shared by every replica: the fleet's posterior, rolled once per fleet tick.

What a replica should plan from (on paper)
------------------------------------------
One controller fed every step of the fleet ticks its model every ``τ`` (1 s,
``controller.core``): ``P_k = roll(P_{k-1}, N_k)``, where ``N_k`` is all the
evidence of tick ``k`` and ``roll`` is one tick's carry, decay and cap
(:func:`~controller.models.acceptance.roll_cells`). When the cap binds (a
busy stratum: ``c`` = ``max_evidence`` per cell, ``n`` observations per tick
across the fleet), a tick keeps ``c / (c + n)`` of the old evidence, so the
posterior is mostly the last tick's, each replica's workers weighed by
their share of ``n``.

The fleet store holds per stratum exactly that ``P_k``: the *settled*
posterior ``S_k``, the same ``roll`` applied once per fleet tick to the sum
of every replica's deltas stamped in that tick (tick ``floor(at / τ)``;
deltas are never capped), with its carry state (reference at the last carry,
each cell's anchor) stored beside it. So R replicas each receiving N steps a
second roll exactly what one controller receiving R × N a second rolls, tick
by tick, whatever the order and timing of their pushes. Deltas of a tick not
rolled yet wait as the *open* tick; the first delta of a later tick rolls it,
and so does a read once its tick has ended (a stratum nobody pushes to).

A replica plans from ``S_k`` alone while the fleet answers — the same
numbers on every replica — not from ``S_k`` plus its own evidence not yet
settled. That sum weighs its own workers above their share, because the
other replicas' evidence of the same moments is not there yet: its mean is
``(c·m_S + n_r·m_r) / (c + n_r)`` where one model has ``(c·m_S + Σ n·m) /
(c + Σ n)``. In the fleet benchmark (``c`` 2,000; replica A 3,400 a second at
α 0.5, B 3,000 at 0.8; one model 0.64) it gave 0.55 and 0.75 (measured 0.53
and 0.75 before this design, which also capped after every single merge, so
the totals each replica read back were the ones its own delta had just
dominated). The price of planning from ``S_k`` is age, not bias: it is one
model's posterior as of the last complete fleet tick, at most one tick plus
one merge interval old. Under light inflow (``n ≪ c``) the two views are
the same to within noise, so nothing is lost there.

The delta protocol
------------------
1. Each replica's model keeps a :class:`~controller.models.acceptance.ShareLedger`
   per stratum. At every tick (``AcceptanceModel.tick``) the evidence its own
   workers added since the last tick joins the ledger's pending delta, and the
   delta decays with the posterior: it is always "what this replica added,
   as it weighs now", stamped with the model's tick time.
2. About once a second :meth:`AcceptanceSync.prepare` seals the pending
   deltas of every stratum into one batch with the next sequence number of
   this writer (``<replica>/<incarnation token>``; a restarted process is a
   new writer, so its sequence may start again at 1). A sealed batch is
   immutable: until Redis confirms it, every attempt resends that same batch,
   and new evidence waits in the ledgers for the next one.
3. One Lua script (:data:`MERGE_LUA`, atomic in Redis) applies the batch only if
   its sequence is above the last one applied for that writer: a retry after
   a timeout whose first attempt did land is skipped, never counted twice.
   Each delta goes into its stratum's open tick (rolling the open tick first
   if the delta belongs to a later one). A *late* delta, stamped in a tick
   already rolled, joins the settled posterior through the cap factors ``λ``
   that tick's roll left: ``cap(S + λ·d)`` is what the roll would have given
   with ``d`` in it (``S = λ·X``, and ``cap(λ·(X + d)) = cap(X + d)``), all
   but the carry's thresholded decisions. In the same call the script rolls
   every open tick that ended a whole tick ago by the reader's clock (a
   stratum nobody pushes to any more) and returns every stratum the replica
   holds.
4. :meth:`AcceptanceSync.install` gives each local posterior the settled
   posterior as the view it plans from, and sets its own arrays to settled +
   open + its pending delta + what its workers added since its last tick
   (``StratumPosterior.install_fleet``): the local model it falls back on.

The carry
---------
Mostly-old cells following the reference cell and untested cells made
uncertain again (``controller.models.acceptance``) run in the fleet's roll,
a port of ``roll_cells``: once per fleet tick, from the whole fleet's
evidence, as one model runs them. Nothing of the carry is local any more.
Before, each replica kept its carry's moves as a signed evidence adjustment
laid over every later install. After Redis came back empty, the re-seeded
totals of a bucket one replica knew only from the fleet were lower in both
successes and failures than what it held, so its reference cell's mean moved
with no fresh evidence; the stale rule then shrank the reference cell itself
to 50 observations, and the adjustment (about −1,500 observations) was taken
off every later install for minutes: position 1 sat at 0.34 against 0.41.
(The stale rule now also never touches the reference cell, which in one
model only moves with its own data.)

Faults
------
Redis down or slow: the merge fails (counted: ``merge_failures``), the batch
stays sealed and pending, nothing on the ingest path waits. Once a
posterior's view is ``view_ttl_s`` old it plans from its local model: the
fleet's last state plus everything its own workers add. When Redis answers
again, the batch goes first (applied, or skipped if it had landed), then
everything gathered meanwhile as the next batch, and the views come back.

Redis restarted without its data: the fleet's ``epoch`` key (a random token
set when the totals are created) is gone. A replica that had synced re-seeds
the store with each stratum exactly as it last read it (settled, open, cap
factors, carry state) and the writer sequences it read with them, so a
batch that had landed and is resent is still skipped exactly when the seed
holds it; every replica then pushes its unmerged evidence as usual. The
first replica to set the new epoch seeds; the others adopt it. A replica
that never synced seeds its own evidence without its unpushed part
(``StratumPosterior.shared_baseline``), and only after ``seed_grace_s`` (a
replica just started must not replace the fleet's knowledge with its empty
one). The seeder only knows the strata it holds: every other replica that
had synced, on adopting the new epoch, offers in its next round what it last
read of each stratum it had installed, and the first offer of a stratum the
epoch does not mark yet is added to whatever was merged into it since (and
marks it); so a drafter version only other replicas run keeps its history
too. Evidence another replica merged in the last interval and the seeder
had not read yet is lost with the store (about one interval's worth;
``appendonly yes`` on the Redis side avoids it).
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

import controller.models.acceptance as acceptance
from controller.fleet.store import LUA_DOUBLES, FleetStore, StoreUnavailable
from controller.models.acceptance import AcceptanceModel, DrafterKey, FleetSnapshot, fit_grid

TICK_S = 1.0  # the fleet's tick: a controller ticks its acceptance model once a second (controller.core)

# Every field of a stratum's hash, in the order the scripts read and write them: t settled time, k its
# tick, d/w the grid, s/f/a/o settled arrays, l/m the last roll's cap factors (succ+fail, asked), n each
# cell's carry anchor (-1: never had data), c the reference at the last carry, u/j the open tick's time
# and number, us/uf/ua/uo its arrays. Times and ticks absent: nothing settled / nothing open.
SNAPSHOT_FIELDS = ("t", "k", "d", "w", "s", "f", "a", "o", "l", "m", "n", "c", "u", "j", "us", "uf", "ua", "uo")

_STATE_LUA = r"""
local FIELDS = {'t', 'k', 'd', 'w', 's', 'f', 'a', 'o', 'l', 'm', 'n', 'c', 'u', 'j', 'us', 'uf', 'ua', 'uo'}
local ARRAYS = {s = 5, f = 6, a = 7, o = 8, l = 9, m = 10, n = 11, us = 15, uf = 16, ua = 17, uo = 18}
local FILL = {s = 0, f = 0, a = 0, o = 0, l = 1, m = 1, n = -1, us = 0, uf = 0, ua = 0, uo = 0}

local function regrid(t, d1, w1, d2, w2, fill)
  if d1 == d2 and w1 == w2 then return t end
  local out = {}
  for i = 1, d2 * w2 do out[i] = fill end
  for k = 0, math.min(d1, d2) - 1 do
    for r = 0, math.min(w1, w2) - 1 do out[k * w2 + r + 1] = t[k * w1 + r + 1] end
  end
  return out
end

-- A stratum from its fields (raw: as HMGET returns them, or as a seed passes them).
local function from_raw(raw)
  return {raw = raw, t = tonumber(raw[1]), k = tonumber(raw[2]), d = tonumber(raw[3]), w = tonumber(raw[4]),
          c = tonumber(raw[12]), u = tonumber(raw[13]), j = tonumber(raw[14])}
end

-- Its arrays, unpacked onto a D x W grid.
local function unpack_state(st, D, W)
  local d0, w0 = st.d or D, st.w or W
  for name, i in pairs(ARRAYS) do
    local x = st.raw[i]
    if x and x ~= '' then
      st[name] = regrid(unpack_doubles(x, d0 * w0), d0, w0, D, W, FILL[name])
    else
      local out = {}
      for c = 1, D * W do out[c] = FILL[name] end
      st[name] = out
    end
  end
  st.d, st.w = D, W
end

local function num(x) return string.format('%.17g', x) end

local function save(key, st, ttl)
  local cells = st.d * st.w
  local args = {'d', st.d, 'w', st.w}
  for name, _ in pairs(ARRAYS) do
    args[#args + 1] = name
    args[#args + 1] = pack_doubles(st[name], cells)
  end
  local gone = {}
  if st.t then
    args[#args + 1] = 't'; args[#args + 1] = num(st.t); args[#args + 1] = 'k'; args[#args + 1] = st.k
  else gone[#gone + 1] = 't'; gone[#gone + 1] = 'k' end
  if st.c then args[#args + 1] = 'c'; args[#args + 1] = num(st.c) else gone[#gone + 1] = 'c' end
  if st.u then
    args[#args + 1] = 'u'; args[#args + 1] = num(st.u); args[#args + 1] = 'j'; args[#args + 1] = st.j
  else gone[#gone + 1] = 'u'; gone[#gone + 1] = 'j' end
  redis.call('HSET', key, unpack(args))
  if #gone > 0 then redis.call('HDEL', key, unpack(gone)) end
  redis.call('PEXPIRE', key, ttl)
end
"""

MERGE_LUA = LUA_DOUBLES + _STATE_LUA + r"""
-- KEYS[1] epoch, KEYS[2] writer sequences (hash writer -> "seq|ms"), KEYS[3..] strata:
-- the first ARGV[6] carry a delta; every one is read back.
-- ARGV: 1 expected epoch, 2 writer, 3 seq, 4 half-life s, 5 cap, 6 deltas, 7 now ms (wall), 8 stratum ttl ms,
--       9 writer ttl ms, 10 stratum offers, 11 tick s, 12 the reader's clock (the model's times),
--       13-15 prior rank-1 mean, deeper-rank mean, strength, 16-19 CARRY_CHANGE, CARRY_FRESH, STALE_CHANGE,
--       STALE_EVIDENCE, then per delta: at, depth, width, succ, fail, asked, offered (packed doubles),
--       then per stratum offer: its KEYS index and its 18 fields (FIELDS order; '' for an absent one).
local epoch = redis.call('GET', KEYS[1])
if not epoch then return {'empty', ''} end
if epoch ~= ARGV[1] then return {'epoch', epoch} end
local writer, seq = ARGV[2], tonumber(ARGV[3])
local hl, cap, n = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local now_ms, ttl, writer_ttl = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local offers, tick, read_at = tonumber(ARGV[10]), tonumber(ARGV[11]), tonumber(ARGV[12])
local rank1, deeper, strength = tonumber(ARGV[13]), tonumber(ARGV[14]), tonumber(ARGV[15])
local carry_change, carry_fresh = tonumber(ARGV[16]), tonumber(ARGV[17])
local stale_change, stale_evidence = tonumber(ARGV[18]), tonumber(ARGV[19])

-- One fleet tick: the open tick's deltas rolled into the settled posterior. A port of
-- controller.models.acceptance.roll_cells, line by line (old: settled; new: open / decay).
local function roll(st)
  local cells, W = st.d * st.w, st.w
  local g = 1.0
  if st.t then g = 0.5 ^ ((st.u - st.t) / hl) end
  local pa, pb, ns, nf, fresh = {}, {}, {}, {}, {}
  for c = 1, cells do
    local mean = deeper
    if (c - 1) % W == 0 then mean = rank1 end
    pa[c], pb[c] = mean * strength, (1.0 - mean) * strength
    ns[c], nf[c] = st.us[c] / g, st.uf[c] / g
  end
  local os, of = st.s, st.f
  local s0, f0 = os[1] + ns[1], of[1] + nf[1]
  local ref = (pa[1] + s0) / (pa[1] + pb[1] + s0 + f0)
  for c = 1, cells do
    fresh[c] = ns[c] + nf[c]
    if fresh[c] > 0 then st.n[c] = ref end
  end
  local carried = st.c or ref
  local ratio = ref / carried
  if math.abs(ratio - 1.0) > carry_change then
    for c = 1, cells do
      local on = os[c] + of[c]
      if c > 1 and on > 0 and fresh[c] < carry_fresh * on then
        local nn = pa[c] + pb[c] + on
        local target = math.min(math.max((pa[c] + os[c]) / nn * ratio, 0.005), 0.995)
        local moved = math.min(math.max(target * nn - pa[c], 0.0), on)
        os[c], of[c] = moved, on - moved
      end
      local anchor = st.n[c]
      if c > 1 and fresh[c] == 0 and on > stale_evidence and anchor > 0
         and math.abs(ref / anchor - 1.0) > stale_change then
        local shrink = stale_evidence / math.max(on, 1e-12)
        os[c], of[c] = os[c] * shrink, of[c] * shrink
      end
    end
    carried = ref
  end
  for c = 1, cells do
    local s, f = (os[c] + ns[c]) * g, (of[c] + nf[c]) * g
    local a, o = st.a[c] * g + st.ua[c], st.o[c] * g + st.uo[c]
    local la, l = 1.0, 1.0
    if a > cap then la = cap / math.max(a, 1e-12) end
    if s + f > cap then l = cap / math.max(s + f, 1e-12) end
    st.s[c], st.f[c], st.a[c], st.o[c], st.l[c], st.m[c] = s * l, f * l, a * la, o * la, l, la
    st.us[c], st.uf[c], st.ua[c], st.uo[c] = 0, 0, 0, 0
  end
  st.t, st.k, st.c, st.u, st.j = st.u, st.j, carried, nil, nil
end

-- A delta of a tick already rolled: into the settled posterior through that roll's cap factors.
local function add_late(st, at, ds, df, da, dof)
  local g = 0.5 ^ ((st.t - at) / hl)
  for c = 1, st.d * st.w do
    local s, f = st.s[c] + st.l[c] * ds[c] * g, st.f[c] + st.l[c] * df[c] * g
    if s + f > cap then
      local r = cap / (s + f)
      s, f, st.l[c] = s * r, f * r, st.l[c] * r
    end
    local a, o = st.a[c] + st.m[c] * da[c] * g, st.o[c] + st.m[c] * dof[c] * g
    if a > cap then
      local r = cap / a
      a, o, st.m[c] = a * r, o * r, st.m[c] * r
    end
    st.s[c], st.f[c], st.a[c], st.o[c] = s, f, a, o
  end
end

-- A delta (at, four arrays already on the stratum's grid) into a stratum: open tick or late.
local function push(st, at, ds, df, da, dof)
  local i = math.floor(at / tick)
  if st.u and i > st.j then roll(st) end
  if st.k and i <= st.k then
    add_late(st, at, ds, df, da, dof)
    return
  end
  local ff, fd = 1.0, 1.0
  if not st.u then
    st.u, st.j, ff = at, i, 0.0
  elseif at >= st.u then
    ff = 0.5 ^ ((at - st.u) / hl)
    st.u = at
  else
    fd = 0.5 ^ ((st.u - at) / hl)
  end
  for c = 1, st.d * st.w do
    st.us[c], st.uf[c] = st.us[c] * ff + ds[c] * fd, st.uf[c] * ff + df[c] * fd
    st.ua[c], st.uo[c] = st.ua[c] * ff + da[c] * fd, st.uo[c] * ff + dof[c] * fd
  end
end

local function load(key)
  return from_raw(redis.call('HMGET', key, unpack(FIELDS)))
end

-- A stratum the epoch's seeder did not hold: the first replica to offer what it last read of it adds
-- that to whatever was merged into it since (the mark makes it once per epoch).
local reseeded = 0
local base = 19 + n * 7
for i = 1, offers do
  local b = base + (i - 1) * 19
  local key = KEYS[tonumber(ARGV[b + 1])]
  if redis.call('HGET', key, 'e') ~= epoch then
    local raw = {}
    for f = 1, 18 do raw[f] = ARGV[b + 1 + f] end
    local off, cur = from_raw(raw), load(key)
    local D, W = math.max(off.d, cur.d or off.d), math.max(off.w, cur.w or off.w)
    unpack_state(off, D, W)
    unpack_state(cur, D, W)
    if off.t then
      if not cur.t then
        -- Nothing rolled since the restart: the offer's settled part (and carry state) is the settled part.
        local open = cur.u and {cur.u, cur.us, cur.uf, cur.ua, cur.uo}
        for _, name in ipairs({'s', 'f', 'a', 'o', 'l', 'm', 'n'}) do cur[name] = off[name] end
        cur.t, cur.k, cur.c, cur.u, cur.j = off.t, off.k, off.c, nil, nil
        for c = 1, D * W do cur.us[c], cur.uf[c], cur.ua[c], cur.uo[c] = 0, 0, 0, 0 end
        if open then push(cur, open[1], open[2], open[3], open[4], open[5]) end
      else
        local l, m = cur.l, cur.m
        cur.l, cur.m = {}, {}
        for c = 1, D * W do cur.l[c], cur.m[c] = 1.0, 1.0 end
        add_late(cur, off.t, off.s, off.f, off.a, off.o)
        for c = 1, D * W do cur.l[c], cur.m[c] = cur.l[c] * l[c], cur.m[c] * m[c] end
        if not cur.c then cur.c, cur.n = off.c, off.n end
      end
    end
    if off.u then push(cur, off.u, off.us, off.uf, off.ua, off.uo) end
    save(key, cur, ttl)
    redis.call('HSET', key, 'e', epoch)
    reseeded = reseeded + 1
  end
end

local last_seq = 0
local last = redis.call('HGET', KEYS[2], writer)
if last then last_seq = tonumber(string.match(last, '^(%d+)')) end
local applied = 0
local pushed = {}
if n > 0 and seq > last_seq then
  applied = 1
  for i = 1, n do
    local b = 19 + (i - 1) * 7
    local key = KEYS[2 + i]
    local st = load(key)
    local d, w = tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3])
    local D, W = math.max(d, st.d or d), math.max(w, st.w or w)
    unpack_state(st, D, W)
    local delta = {}
    for x = 1, 4 do delta[x] = regrid(unpack_doubles(ARGV[b + 3 + x], d * w), d, w, D, W, 0) end
    push(st, tonumber(ARGV[b + 1]), delta[1], delta[2], delta[3], delta[4])
    save(key, st, ttl)
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
local now_tick = math.floor(read_at / tick)
for i = 3, #KEYS do
  local st = load(KEYS[i])
  -- A tick that ended a whole tick ago by the reader's clock is rolled (a stratum nobody pushes to any
  -- more); one that just ended waits for the replicas still to push it (the first push of a later tick
  -- rolls it anyway).
  if st.u and now_tick > st.j + 1 then
    unpack_state(st, st.d, st.w)
    roll(st)
    save(KEYS[i], st, ttl)
    st = load(KEYS[i])
  end
  out[#out + 1] = st.raw
end
return out
"""

SEED_LUA = r"""
-- KEYS[1] epoch, KEYS[2] writer sequences, KEYS[3..] strata.
-- ARGV: 1 new epoch token, 2 stratum ttl ms, 3 writer entries m, then m (writer, value) pairs,
--       then per stratum its 18 fields (t k d w s f a o l m n c u j us uf ua uo; '' for an absent one).
local FIELDS = {'t', 'k', 'd', 'w', 's', 'f', 'a', 'o', 'l', 'm', 'n', 'c', 'u', 'j', 'us', 'uf', 'ua', 'uo'}
if not redis.call('SET', KEYS[1], ARGV[1], 'NX') then return {'taken', redis.call('GET', KEYS[1]) or ''} end
redis.call('DEL', KEYS[2])
local m = tonumber(ARGV[3])
for i = 1, m do redis.call('HSET', KEYS[2], ARGV[2 + 2 * i], ARGV[3 + 2 * i]) end
local b0 = 3 + 2 * m
for i = 3, #KEYS do
  local b = b0 + (i - 3) * 18
  redis.call('DEL', KEYS[i])
  local args = {'e', ARGV[1]}
  for f = 1, 18 do
    if ARGV[b + f] ~= '' then args[#args + 1] = FIELDS[f]; args[#args + 1] = ARGV[b + f] end
  end
  redis.call('HSET', KEYS[i], unpack(args))
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


StratumState = tuple[StratumId, FleetSnapshot]


@dataclass(frozen=True)
class SyncJob:
    """What one merge round sends (built on the loop by :meth:`AcceptanceSync.prepare`)."""

    batch: _Batch | None
    reads: tuple[StratumId, ...]  # the batch's strata first, then every other stratum held
    seed: tuple[StratumState, ...] | None
    seed_writers: tuple[tuple[str, str], ...]
    # After adopting an epoch another replica seeded: what this one last read of its installed strata.
    stratum_seeds: tuple[StratumState, ...] = ()
    read_at: float = 0.0  # the reader's clock (the model's times): open ticks that ended by then are rolled


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
    totals: tuple[StratumState | None, ...] = ()
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
        Monotonic clock (grace, ages).
    model_clock : callable or None
        The controller's clock, in which the model's times are (``time.time``
        for ``specctl serve``): a read rolls the open ticks that have ended
        by it. None: the model's latest tick.
    view_ttl_s : float
        A posterior whose fleet view is this old in the model's time (no
        merge completed since) plans from its local model instead.
    tick_s : float
        The fleet's tick: the controller's model tick.

    Notes
    -----
    Threads: :meth:`prepare` and :meth:`install` touch the model and run on
    the thread that owns it (the controller's event loop); :meth:`exchange`
    runs on a store thread and touches only the job and the epoch.
    :meth:`sync_once` does the three in order without blocking the loop.
    """

    def __init__(self, model: AcceptanceModel, store: FleetStore, *, stratum_ttl_s: float = 7 * 86400.0,
                 seed_grace_s: float = 3.0, namespace: str = "acc",
                 clock: Callable[[], float] = time.monotonic, model_clock: Callable[[], float] | None = None,
                 view_ttl_s: float = 3.0, tick_s: float = TICK_S) -> None:
        if view_ttl_s <= 0:
            raise ValueError(f"view_ttl_s must be > 0, got {view_ttl_s}")
        if tick_s <= 0:
            raise ValueError(f"tick_s must be > 0, got {tick_s}")
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
        self.model_clock = model_clock
        self.view_ttl_s = view_ttl_s
        self.tick_s = tick_s
        self.counts: Counter = Counter()
        self._merge = store.script(MERGE_LUA)
        self._seed = store.script(SEED_LUA)
        self._seq = 0
        self._inflight: _Batch | None = None
        self._writers: tuple[tuple[str, str], ...] = ()  # writer sequences seen with the last totals
        self._synced = False  # installed fleet totals at least once
        self._installed: set[StratumId] = set()  # strata with fleet totals installed at least once
        self._last_read: dict[StratumId, FleetSnapshot] = {}  # each stratum as the fleet last held it
        self._reseed = False  # a new epoch another replica seeded: offer our strata in the next round
        self._empty_since: float | None = None
        self._want_seed = False
        self._epoch: str | None = None  # store-thread state (exchange); one exchange at a time
        self._exchange_lock = threading.Lock()
        self._keys: dict[StratumId, str] = {}
        self._to_install: dict[StratumId, StratumState] = {}  # fleet state read, not yet installed (drain)
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
    def _model_now(self) -> float:
        if self.model_clock is not None:
            return float(self.model_clock())
        times = [post.updated_at for _, buckets in self.model.items() for post in buckets
                 if post.updated_at is not None]
        return max(times, default=0.0)

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
        held: set[StratumId] = set()
        for key, buckets in self.model.items():
            for bucket in range(len(buckets)):
                held.add((key, bucket))
                if (key, bucket) not in seen:
                    reads.append((key, bucket))
        for stratum in [s for s in self._last_read if s not in held]:  # evicted drafter versions
            del self._last_read[stratum]
        seed = self._seed_view() if self._want_seed else None
        stratum_seeds: tuple = ()
        if self._reseed and seed is None:
            stratum_seeds = tuple((s, snap) for s, snap in self._last_read.items() if s in self._installed)
        return SyncJob(batch, tuple(reads), seed, self._writers if seed is not None else (), stratum_seeds,
                       self._model_now())

    def _seed_view(self) -> tuple[StratumState, ...]:
        """Every stratum as this replica believes the fleet holds it: as it last read it, or, for a stratum it
        never read, its own evidence without its unpushed part (its sealed batch taken out too)."""
        inflight = {d.stratum: d for d in self._inflight.deltas} if self._inflight else {}
        hl = self.model.half_life_s
        out = []
        for key, buckets in self.model.items():
            for bucket, post in enumerate(buckets):
                stratum = (key, bucket)
                if post.ledger is None or post.updated_at is None:
                    continue
                read = self._last_read.get(stratum)
                if read is not None:
                    out.append((stratum, read))
                    continue
                arrays = list(post.shared_baseline())
                delta = inflight.get(stratum)
                if delta is not None:
                    g = 0.5 ** ((post.updated_at - delta.at) / hl)
                    for i, x in enumerate((delta.succ, delta.fail, delta.asked, delta.offered)):
                        grid = fit_grid(x.reshape(delta.depth, delta.width), post.max_depth, post.max_width)
                        arrays[i] = np.maximum(arrays[i] - grid * g, 0.0)
                cells = post.max_depth * post.max_width
                ones, zeros = np.ones(cells), np.zeros(cells)
                if not any(x.any() for x in arrays):  # nothing but unpushed evidence: the fleet starts empty
                    out.append((stratum, FleetSnapshot(
                        post.max_depth, post.max_width, None, None, zeros, zeros, zeros, zeros, ones, ones,
                        np.full(cells, np.nan), float("nan"), None, None, zeros, zeros, zeros, zeros)))
                    continue
                # Settled through the tick before its last one: its unpushed delta, stamped in that last
                # tick, then opens the next tick and is rolled with the others' (not taken for a late one).
                out.append((stratum, FleetSnapshot(
                    post.max_depth, post.max_width, post.updated_at, math.floor(post.updated_at / self.tick_s) - 1,
                    *arrays, ones, ones, np.array(post._anchor, dtype=float), float(post._carried),
                    None, None, zeros, zeros, zeros, zeros)))
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
                self._last_read[entry[0]] = entry[1]
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
            (key, bucket), snapshot = entry
            buckets = self.model.peek(key)
            if buckets is None or bucket >= len(buckets) or buckets[bucket].ledger is None:
                continue  # evicted meanwhile
            buckets[bucket].install_fleet(snapshot, hl, cap, self.view_ttl_s)
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
                for stratum, snapshot in job.seed:
                    keys.append(self.stratum_key(stratum))
                    args += _snapshot_fields(snapshot)
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
        prior = self.model.prior
        args: list[Any] = [self._epoch or "", self.writer, batch.seq if batch else 0, repr(self.model.half_life_s),
                           repr(self.model.max_evidence), len(deltas), int(time.time() * 1000), self.stratum_ttl_ms,
                           self.writer_ttl_ms, len(job.stratum_seeds), repr(self.tick_s), repr(float(job.read_at)),
                           repr(prior.rank1_mean), repr(prior.deeper_rank_mean), repr(prior.strength),
                           # Read from the module each round: the tests switch the carry off.
                           *(_finite(x) for x in (acceptance.CARRY_CHANGE, acceptance.CARRY_FRESH,
                                                  acceptance.STALE_CHANGE, acceptance.STALE_EVIDENCE))]
        for d in deltas:
            args += [repr(float(d.at)), d.depth, d.width, _pack(d.succ), _pack(d.fail), _pack(d.asked),
                     _pack(d.offered)]
        index = {stratum: i + 3 for i, stratum in enumerate(job.reads)}  # KEYS is 1-based: strata from 3
        for stratum, snapshot in job.stratum_seeds:
            args += [index[stratum], *_snapshot_fields(snapshot)]
        return args

    def _parse(self, job: SyncJob, answer: list, epoch_changed: bool, seeded: bool) -> SyncReply:
        flat = answer[3]
        writers = tuple((_text(flat[i]), _text(flat[i + 1])) for i in range(0, len(flat), 2))
        totals = []
        for stratum, fields in zip(job.reads, answer[5:]):
            snapshot = _snapshot(stratum, fields)
            totals.append(None if snapshot is None else (stratum, snapshot))
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
        planning_locally = 0
        for _, buckets in self.model.items():
            for post in buckets:
                if post.ledger is not None:
                    pending += float(post.ledger.pending_succ.sum() + post.ledger.pending_fail.sum())
                    # Holding evidence but no fleet view (the fleet unreachable for view_ttl_s, or nothing rolled yet).
                    planning_locally += post.view is None and (any(post.succ) or any(post.fail))
        batch = self._inflight
        unconfirmed = float(sum(d.succ.sum() + d.fail.sum() for d in batch.deltas)) if batch else 0.0
        return {
            "writer": self.writer, "epoch": self._epoch, "synced": self._synced, "counts": dict(self.counts),
            "unmerged_evidence": pending + unconfirmed,
            "unconfirmed_batch": batch.seq if batch else None,
            "strata_to_install": len(self._to_install),
            "strata_planning_locally": planning_locally,
            "unconfirmed_for_s": self.clock() - batch.sealed_at if batch else 0.0,
            "since_merge_s": self.clock() - self.last_merge_at if self.last_merge_at == self.last_merge_at else None,
            "last_merge_ms": self.last_merge_s * 1000.0,
        }


def _pack(x: np.ndarray) -> bytes:
    return np.ascontiguousarray(x, "<f8").tobytes()


def _finite(x: float) -> str:
    """A number for Lua's ``tonumber`` (which reads no ``inf``): infinity as the largest double."""
    return repr(float(x)) if math.isfinite(x) else repr(1.7976931348623157e308)


def _snapshot_fields(s: FleetSnapshot) -> list[Any]:
    """The 18 fields of :data:`SNAPSHOT_FIELDS` for the scripts ('' for an absent one)."""
    settled = s.settled_at is not None
    opened = s.open_at is not None
    anchor = np.where(np.isnan(s.anchor), -1.0, s.anchor)
    return [repr(float(s.settled_at)) if settled else "", s.settled_tick if settled else "", s.depth, s.width,
            _pack(s.succ), _pack(s.fail), _pack(s.asked), _pack(s.offered), _pack(s.scale), _pack(s.scale_asked),
            _pack(anchor), repr(float(s.carried)) if s.carried == s.carried else "",
            repr(float(s.open_at)) if opened else "", s.open_tick if opened else "",
            _pack(s.open_succ), _pack(s.open_fail), _pack(s.open_asked), _pack(s.open_offered)]


def _snapshot(stratum: StratumId, fields: list) -> FleetSnapshot | None:
    """A stratum's hash (the fields of :data:`SNAPSHOT_FIELDS`) as read; None if nothing is stored."""
    values = dict(zip(SNAPSHOT_FIELDS, fields))
    t, u, d, w = (values[k] for k in ("t", "u", "d", "w"))
    if (t is None and u is None) or d is None or w is None:
        return None
    depth, width = int(d), int(w)
    cells = depth * width

    def array(name: str, fill: float) -> np.ndarray:
        raw = values[name]
        if not raw:
            return np.full(cells, fill)
        x = np.frombuffer(raw, dtype="<f8").astype(float)
        if len(x) != cells:
            raise StoreUnavailable("acceptance_merge", f"stratum {stratum}: stored {name} does not match "
                                                       f"{depth}x{width}")
        return x

    anchor = array("n", -1.0)
    anchor[anchor < 0] = np.nan
    carried = values["c"]
    return FleetSnapshot(
        depth, width, float(t) if t is not None else None, int(values["k"]) if t is not None else None,
        array("s", 0.0), array("f", 0.0), array("a", 0.0), array("o", 0.0), array("l", 1.0), array("m", 1.0),
        anchor, float(carried) if carried is not None else float("nan"),
        float(u) if u is not None else None, int(values["j"]) if u is not None else None,
        array("us", 0.0), array("uf", 0.0), array("ua", 0.0), array("uo", 0.0))


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)
