"""One drift monitor per drafter version fleet-wide (``controller/fleet/drift_*.py``), in process.

Replicas here are the real parts of one (a :class:`DriftAlerting` with its
monitor and feed, a :class:`FleetDriftMonitor` with its own
:class:`FleetStore`) against a real ``redis-server``; the rounds a replica's
loop would run are called by the test. ``tests/test_fleet_drift_replicas.py``
runs whole ``specctl serve`` processes.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import zlib
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import redis

from controller.alerts.alerting import DriftAlerting, is_sampled
from controller.alerts.store import StateStore
from controller.drift.monitor import AcceptanceDriftMonitor, MonitorConfig
from controller.drift.persistence import install_version, version_from_dict, version_to_dict
from controller.drift.strata import Version
from controller.fleet.drift_owner import Checkpoint, Cursor, FleetDriftMonitor, Phase
from controller.fleet.alerts import FleetAlerts
from controller.fleet.drift_stream import EvidenceGroup, Outcome, StreamLimits, decode_groups, encode_groups
from controller.fleet.leases import LeaseBook
from controller.fleet.store import FleetStore, StoreUnavailable
from controller.protocol import RequestRow

FAST = dict(baseline_steps=500, window=300, round_steps=500, ert=2_000_000, n_bootstrap=512, cusum_paths=128,
            cusum_horizon=2048)
LIMITS = SimpleNamespace(kind="eagle", version="fv1", max_depth=6, max_width=1, max_tree_nodes=6,
                         trained_context_len=8192)


# ------------------------------------------------------------------ codec

def test_codec_round_trips_trees_chains_domains_and_markers() -> None:
    lim = StreamLimits("medusa", "v:7", 5, 4, 4096)
    rng = np.random.default_rng(0)
    groups = []
    for k in range(50):
        outcomes = []
        for _ in range(8):
            depth = int(rng.integers(0, 6))
            accepted = int(rng.integers(0, depth + 1))
            levels = min(depth, accepted + 1)
            cands = tuple(int(c) for c in rng.integers(1, 5, size=levels))
            ranks = tuple(int(rng.integers(1, c + 1)) if i < accepted else 0 for i, c in enumerate(cands))
            outcomes.append(Outcome(int(rng.integers(0, 1 << 20)), accepted, depth, ranks, cands,
                                    ["", "code", "chat"][k % 3]))
        groups.append(EvidenceGroup(f"w{k % 4}", 1000.0 + k / 50, lim, tuple(outcomes)))
    groups.append(EvidenceGroup("w1", 1001.0, lim, (), moved_to="medusa/v8"))
    data = encode_groups(groups)
    assert decode_groups(data) == groups


@pytest.mark.parametrize("outcome, message", [
    (Outcome(10, 300, 6, (), (), ""), "accepted 300 must be in 0..255"),
    (Outcome(-1, 1, 6, (), (), ""), "context_len -1 must be in 0..4294967295"),
    (Outcome(10, 1, 6, (1, 0), (2,), ""), "level_candidates: 1 entries, accepted_rank has 2"),
    (Outcome(10, 1, 6, (1,), (999,), ""), "level_candidates 999 must be in 0..255"),
])
def test_codec_refuses_what_it_cannot_hold_naming_field_and_value(outcome: Outcome, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        encode_groups([EvidenceGroup("w0", 1.0, StreamLimits("eagle", "v1", 6, 1, 0), (outcome,))])


def test_codec_refuses_a_damaged_entry() -> None:
    data = encode_groups([EvidenceGroup("w0", 1.0, StreamLimits("eagle", "v1", 6, 1, 0),
                                        (Outcome(10, 1, 6, (), (), ""),))])
    raw = zlib.decompress(data)
    with pytest.raises(ValueError, match="malformed evidence entry"):
        decode_groups(zlib.compress(raw[:-3]))
    with pytest.raises(ValueError, match="malformed evidence entry"):
        decode_groups(b"not zlib at all")


# ------------------------------------------------------------- checkpoint

def _learn(mon: AcceptanceDriftMonitor, rng: np.random.Generator, n: int, alpha: float, t0: float = 0.0,
           worker: str = "w0", contexts=(500, 3000)) -> None:
    for t in range(n):
        ctx = int(rng.choice(contexts))
        tau = min(int(rng.geometric(1 - alpha)) - 1, 6)
        mon.observe_request(LIMITS, ctx, tau, 6, now=t0 + t, worker_id=worker)


def test_a_version_checkpoint_round_trips_into_another_monitor() -> None:
    rng = np.random.default_rng(1)
    mon = AcceptanceDriftMonitor(MonitorConfig(**FAST))
    _learn(mon, rng, 2000, 0.8)
    v = mon._versions[("eagle", "fv1")]
    cp = Checkpoint(4, "r0/abcd", 123.0, Cursor("17-2", 9, {"r1/x": 5}), version_to_dict(v),
                    list(mon.config.context_edges))
    back = Checkpoint.from_json(json.loads(json.dumps(cp.to_json())))
    assert back == cp
    other = AcceptanceDriftMonitor(MonitorConfig(**FAST))
    install_version(other, version_from_dict(back.version, other.config, other.ert_cusum))
    assert other.to_dict() == mon.to_dict(alerts=True) | {"alerts": [], "next_id": 1}
    restored = AcceptanceDriftMonitor.from_dict(mon.to_dict())  # what a restart from the local store gives
    mine, theirs = restored.snapshot()["versions"][0], other.snapshot()["versions"][0]
    assert theirs["cusum_thresholds"] == pytest.approx(mine["cusum_thresholds"])
    assert theirs["workers"] == ["w0"] and [s["baseline_ready"] for s in theirs["strata"]] == [True, True]


def test_a_bad_checkpoint_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="cursor.last_id 'x-y' is not a stream id"):
        Checkpoint.from_json(json.dumps({"format": 1, "gen": 1, "owner": "r", "at": 0.0,
                                         "cursor": {"last_id": "x-y"}, "version": None}))


# ---------------------------------------------- one monitor sees more, sooner

def _first_alarm(monitors: list[AcceptanceDriftMonitor], rng: np.random.Generator, steps: int, drift_at: int,
                 alpha: float, drop: float) -> int | None:
    """Request-steps (fleet-wide, after ``drift_at``) until any monitor opens an alert; the fleet's steps go
    round-robin over ``monitors``."""
    for t in range(steps):
        a = alpha * (1 - drop) if t >= drift_at else alpha
        tau = min(int(rng.geometric(1 - a)) - 1, 6)
        mon = monitors[t % len(monitors)]
        mon.observe_request(LIMITS, int(rng.choice((500, 3000))), tau, 6, now=float(t), worker_id=f"w{t % 4}")
        if t >= drift_at and mon.open_alerts():
            return t - drift_at
    return None


def test_one_monitor_fed_both_replicas_outcomes_catches_a_drift_two_halves_do_not() -> None:
    """The same outcomes (a 5 % acceptance drop on two replicas' workers): one monitor fed all of them
    alarms within the horizon; two monitors fed half each (per-replica monitors) do not, in the same
    fleet-wide request-steps."""
    warmup, horizon = 3000, 3000
    one = _first_alarm([AcceptanceDriftMonitor(MonitorConfig(**FAST))], np.random.default_rng(7),
                       warmup + horizon, warmup, 0.8, 0.05)
    two = _first_alarm([AcceptanceDriftMonitor(MonitorConfig(**FAST)) for _ in range(2)], np.random.default_rng(7),
                       warmup + horizon, warmup, 0.8, 0.05)
    assert one is not None and one < horizon
    assert two is None, two


# ------------------------------------------------- replicas through Redis

class Node:
    """One replica's drift parts: alerting (monitor + feed) and the fleet drift monitor, on its own store."""

    def __init__(self, url: str, name: str, ttl_s: float = 1.0, budget_s: float = 10.0, sample_fraction: float = 1.0,
                 config: dict | None = None, cpu: "VirtualCPU | None" = None, round_s: float | None = None,
                 **kw) -> None:
        self.store = FleetStore(url, fleet="fleet-drift-test", replica_id=name, op_timeout_s=0.5,
                                connect_timeout_s=0.3, backoff_s=(0.05, 0.2))
        # cpu: the monitor's budget measured on a VirtualCPU (its work's exact cost) instead of thread time.
        monitor = AcceptanceDriftMonitor(MonitorConfig(**(config or FAST)), cpu_clock=cpu or time.thread_time)
        self.alerting = DriftAlerting(monitor, StateStore(""), [], sample_fraction=sample_fraction, cpu_fraction=1.0,
                                      max_buffered=100_000)
        self.budget_s = budget_s  # the monitor's CPU budget per round
        # round_s: the fleet monitor's clock (windows, leases) advances by exactly this much a round.
        self.now = 0.0
        self.round_s = round_s
        if round_s is not None:
            kw["monotonic"] = lambda: self.now
        self.drift = FleetDriftMonitor(self.store, self.alerting, None, lease_ttl_s=ttl_s, checkpoint_interval_s=0.3,
                                       **kw)
        self.drift.attach()
        self.rng = np.random.default_rng(zlib.crc32(name.encode()))
        self.sent = 0
        self.step_id = 0

    def steps(self, worker: str, count: int, alpha: float, ctx: int = 500, batch: int = 8) -> None:
        state = SimpleNamespace(limits=LIMITS, worker_id=worker)
        for _ in range(count):
            self.step_id += 1
            accepted = np.minimum(self.rng.geometric(1 - alpha, size=batch) - 1, 6)
            rows = [RequestRow(f"{worker}-{self.step_id}-{i}", ctx, 6, 1, 6, int(a), None, None, 6, 1, 6, 0)
                    for i, a in enumerate(accepted)]
            step = SimpleNamespace(timestamp=time.time(), requests=[SimpleNamespace(domain="")] * batch)
            self.alerting.feed.on_rows(state, step, rows)
            self.sent += batch

    async def round(self) -> None:
        if self.round_s is not None:
            self.now += self.round_s
        await self.drift.run_round()
        self.alerting.feed.drain(self.budget_s)

    def seen(self) -> int:
        """Request-steps the monitor's strata counted for the version (persisted with the baselines)."""
        v = self.alerting.monitor._versions.get(("eagle", "fv1"))
        return sum(s.n_seen for s in v.strata.values()) if v is not None else 0

    def phase(self) -> Phase | None:
        watch = self.drift.watches.get(("eagle", "fv1"))
        return watch.phase if watch is not None else None

    def close(self) -> None:
        self.store.close()
        self.alerting.store.close()


class VirtualCPU:
    """A thread-CPU clock that moves only by the work charged to it (see the ``virtual_cpu`` fixture): a
    monitor's budget measured on it is the same on a fast machine and on a slow minute of a shared one."""

    def __init__(self, per_step_s: float, per_calibration_s: float) -> None:
        self.per_step_s = per_step_s
        self.per_calibration_s = per_calibration_s
        self.t = 0.0
        self.calibrations = 0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def virtual_cpu(monkeypatch):
    """``virtual_cpu(per_step_s, per_calibration_s)`` -> :class:`VirtualCPU`: every request-step any monitor
    observes costs ``per_step_s`` on it, every CUSUM calibration ``per_calibration_s`` (charged inside the
    calibration, where the monitor's ``calibration_s`` measures it). Rounds run one at a time on this thread,
    so one clock for every node is each node's thread time."""
    made: list[VirtualCPU] = []
    observe, calibrate = AcceptanceDriftMonitor.observe_request, Version.calibrate

    def charged_observe(self, *args, **kwargs):
        made[0].t += made[0].per_step_s
        return observe(self, *args, **kwargs)

    def charged_calibrate(self, *args, **kwargs):
        made[0].t += made[0].per_calibration_s
        made[0].calibrations += 1
        return calibrate(self, *args, **kwargs)

    def make(per_step_s: float, per_calibration_s: float) -> VirtualCPU:
        assert not made, "one virtual CPU a test"
        made.append(VirtualCPU(per_step_s, per_calibration_s))
        monkeypatch.setattr(AcceptanceDriftMonitor, "observe_request", charged_observe)
        monkeypatch.setattr(Version, "calibrate", charged_calibrate)
        return made[0]

    return make


async def rounds(nodes, until, timeout_s: float = 15.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        for n in nodes:
            await n.round()
        await asyncio.sleep(0.02)


@pytest.fixture
def make_node(redis_server):
    """``make_node(name, **Node options)``: a replica's drift parts on this test's Redis, closed after the test."""
    made: list[Node] = []

    def make(name: str, **kw) -> Node:
        node = Node(redis_server.url, name, **kw)
        made.append(node)
        return node

    yield make
    for node in made:
        node.close()


async def elect(a: Node, b: Node) -> tuple[Node, Node]:
    """Rounds until one of the two runs the version's monitor: (owner, the other)."""
    await rounds([a, b], lambda: Phase.OWNED in (a.phase(), b.phase()), what="an owner")
    return (a, b) if a.phase() is Phase.OWNED else (b, a)


async def step_both(a: Node, b: Node, count: int, alpha: float, **kw) -> None:
    """``count`` steps on each node's worker (``wa``, ``wb``), then a round of each."""
    a.steps("wa", count, alpha, **kw)
    b.steps("wb", count, alpha, **kw)
    await a.round()
    await b.round()


async def test_every_replicas_outcomes_reach_the_one_owner_once(make_node) -> None:
    a, b = make_node("a"), make_node("b")
    a.steps("wa", 40, 0.8)
    b.steps("wb", 40, 0.8, ctx=3000)
    owner, other = await elect(a, b)
    await rounds([a, b], lambda: owner.seen() == a.sent + b.sent, what="every outcome at the owner")
    assert other.seen() == 0 and other.phase() is Phase.IDLE
    assert ("eagle", "fv1") not in other.alerting.monitor._versions
    # A flush whose answer was lost after Redis applied it: the entry is sent again, same number.
    real_call = other.store.call
    lost = []

    def answer_lost(op, fn):
        result = real_call(op, fn)
        if op == "drift_evidence" and not lost:
            lost.append(op)
            raise StoreUnavailable(op, "answer lost")
        return result

    other.store.call = answer_lost
    other.steps("wb" if other is b else "wa", 30, 0.8)
    await rounds([a, b], lambda: bool(lost) and other.drift.outbox.buffered() == 0, what="the resend")
    await rounds([a, b], lambda: owner.drift.watches[("eagle", "fv1")].lag == 0, what="caught up")
    for _ in range(3):
        await owner.round()
    watch = owner.drift.watches[("eagle", "fv1")]
    assert watch.counts["entries_duplicate"] == 1
    assert owner.seen() == a.sent + b.sent  # the copy was skipped
    status = {d["drafter_version"]: d for d in other.drift.status()}["fv1"]
    assert status["owner"] == owner.store.replica_id and not status["owned_here"]


async def test_a_dead_owners_monitor_is_taken_over_from_its_checkpoint(make_node) -> None:
    a, b = make_node("a"), make_node("b")
    a.steps("wa", 20, 0.8)
    await rounds([a], lambda: a.phase() is Phase.OWNED, what="a owning")
    b.steps("wb", 150, 0.8)  # baselines (500 request-steps a stratum) from both replicas
    a.steps("wa", 100, 0.8)
    await rounds([a, b], lambda: a.seen() == a.sent + b.sent, what="a fed everything")
    gen = a.drift.watches[("eagle", "fv1")].gen
    await rounds([a, b], lambda: a.drift.watches[("eagle", "fv1")].gen > gen, what="a checkpoint after that")
    fed_by_a = a.seen()
    # a dies: no more rounds, its lease is left to expire. Outcomes keep coming from b.
    b.steps("wb", 50, 0.8)
    await rounds([b], lambda: b.phase() is Phase.OWNED, what="b taking over")
    await rounds([b], lambda: b.drift.watches[("eagle", "fv1")].lag == 0 and b.seen() >= fed_by_a, what="caught up")
    for _ in range(3):
        await b.round()
    assert b.seen() == a.sent + b.sent  # from the checkpoint on, every outcome once
    v = b.alerting.monitor._versions[("eagle", "fv1")]
    assert all(s.weights is not None for s in v.strata.values())  # baselines came with it, not relearnt
    assert b.drift.counts["takeovers"] == b.drift.counts["takeovers_from_checkpoint"] == 1
    # It read on from the checkpoint's entry: less than everything sent, which a start over would re-read.
    assert b.drift.watches[("eagle", "fv1")].counts["outcomes_queued"] < a.sent + b.sent - 500


async def test_redis_lost_and_back_nothing_counted_twice_drops_counted(redis_server, make_node) -> None:
    a = make_node("a", max_buffered=400)
    for _ in range(10):  # ten entries in the stream
        a.steps("wa", 10, 0.8)
        await a.round()
    await rounds([a], lambda: a.seen() == a.sent, what="all fed")
    redis_server.kill()
    a.steps("wa", 30, 0.8)  # 240 outcomes wait
    for _ in range(5):
        await a.round()
    assert a.drift.outbox.buffered() == 240 and a.seen() == 800
    a.steps("wa", 40, 0.8)  # 320 more: past the bound, the oldest entry (240) is dropped whole
    a.alerting.feed.drain(0.0)  # the tick forwards every buffered step
    assert a.drift.outbox.counts["dropped"] == 240 and a.drift.outbox.buffered() == 320
    redis_server.start()  # empty: no lease, no checkpoint, no stream
    await rounds([a], lambda: a.seen() == a.sent - 240, timeout_s=20.0, what="the rest fed once")
    for _ in range(5):
        await a.round()
    assert a.seen() == a.sent - 240
    watch = a.drift.watches[("eagle", "fv1")]
    assert watch.phase is Phase.OWNED and watch.counts["stream_resets"] == 1
    v = a.alerting.monitor._versions[("eagle", "fv1")]
    assert all(s.weights is not None for s in v.strata.values())  # its own copy, not relearnt


# ------------------------------------------- a finding waiting for its lease

DRIFTED, QUIET = "eagle/fv1/ctx[1024,2048)", "eagle/fv1/ctx[0,1024)"


@dataclass
class LeaseContest:
    """This replica's alerting (monitor + :class:`FleetAlerts` on store ``a``) and another replica's stratum
    lease book (store ``b``), both on the test's Redis."""

    alerting: DriftAlerting
    fleet: FleetAlerts
    holder: LeaseBook  # the other replica's leases

    @property
    def mon(self) -> AcceptanceDriftMonitor:
        return self.alerting.monitor


@pytest.fixture
def lease_contest(redis_server):
    """``lease_contest(**FleetAlerts options)`` -> :class:`LeaseContest`; its stores closed after the test."""
    opened: list = []

    def make(**fleet_kw) -> LeaseContest:
        mine, theirs = (FleetStore(redis_server.url, fleet="fleet-drift-test", replica_id=name, op_timeout_s=0.5,
                                   connect_timeout_s=0.3) for name in "ab")
        alerting = DriftAlerting(AcceptanceDriftMonitor(MonitorConfig(**FAST)), StateStore(""), [],
                                 cpu_fraction=1.0)
        opened.extend([mine, theirs, alerting.store])
        fleet = FleetAlerts(mine, alerting, lease_ttl_s=5.0, **fleet_kw)
        fleet.attach()
        return LeaseContest(alerting, fleet, LeaseBook(theirs, ttl_s=5.0))

    yield make
    for closable in opened:
        closable.close()


def _drift_long_contexts(mon: AcceptanceDriftMonitor, rng: np.random.Generator, t0: int, n: int) -> None:
    """``n`` request-steps alternating short and long contexts; the drafter got worse on long ones only."""
    for t in range(t0, t0 + n):
        ctx = (500, 1500)[t % 2]
        tau = min(int(rng.geometric(1 - (0.8 if ctx == 500 else 0.5))) - 1, 6)
        mon.observe_request(LIMITS, ctx, tau, 6, now=float(t), worker_id="w0")


def test_a_finding_waiting_for_its_stratum_lease_holds_its_stratum_out_of_the_tests(lease_contest) -> None:
    """Long contexts drift while another replica holds that stratum's alert lease: this replica's finding
    waits (``FleetAlerts.claim`` answers None). Its stratum waits with it, out of the CUSUMs: left in, the
    drift fires the bank again every few steps, and among those many localisations the quiet stratum's
    noise crosses ``localize_llr`` and is named too, a second alert for one drift once the leases come."""
    c = lease_contest(pending_s=60.0)
    mon, fleet, holder = c.mon, c.fleet, c.holder
    holder.want(DRIFTED)
    holder.cycle()
    assert holder.holds(DRIFTED)
    rng = np.random.default_rng(5)
    _learn(mon, rng, 3000, 0.8, contexts=(500, 1500))  # baselines of both strata
    assert not mon.alerts and not fleet.stats()["pending"]
    _drift_long_contexts(mon, rng, 3000, 6000)
    assert fleet.counts["deferred"] == 1, fleet.counts  # one finding, on the drifted stratum, waiting
    assert not mon.alerts
    fleet.cycle_leases()  # still the other replica's: nothing opens
    fleet.after_lease_cycle()
    assert not mon.alerts and fleet.stats()["pending"] == 1
    holder.drop(DRIFTED)  # the other replica lets go: the waiting finding opens, the only alert
    holder.cycle()
    fleet.cycle_leases()
    fleet.after_lease_cycle()
    assert [(a.stratum, a.detector) for a in mon.open_alerts()] == [("ctx[1024,2048)", "cusum")]
    assert fleet.leases.holds(DRIFTED) and not fleet.leases.holds(QUIET)
    assert fleet.counts["opened"] == 1 and not fleet.stats()["pending"]


def test_a_finding_given_up_on_returns_its_stratum_to_the_cusums(lease_contest) -> None:
    """A waiting finding dropped (not granted within ``pending_s``) is withdrawn from the monitor: its
    stratum, still drifting, fires again and the new finding opens once the lease is free."""
    now = [0.0]
    c = lease_contest(pending_s=10.0, monotonic=lambda: now[0])
    mon, fleet, holder = c.mon, c.fleet, c.holder
    rng = np.random.default_rng(6)
    holder.want(DRIFTED)
    holder.cycle()
    _learn(mon, rng, 3000, 0.8, contexts=(500, 1500))
    _drift_long_contexts(mon, rng, 3000, 2000)
    assert fleet.counts["deferred"] == 1 and fleet.stats()["pending"] == 1
    now[0] = 11.0  # waited past pending_s: given up
    fleet.after_lease_cycle()
    assert fleet.counts["deferred_dropped"] == 1 and not fleet.stats()["pending"]
    holder.drop(DRIFTED)
    holder.cycle()
    _drift_long_contexts(mon, rng, 5000, 2000)  # back in the CUSUMs: found again
    assert fleet.counts["deferred"] == 2 and not mon.alerts, fleet.counts
    fleet.cycle_leases()
    fleet.after_lease_cycle()
    assert [a.stratum for a in mon.open_alerts()] == ["ctx[1024,2048)"]


# ---------------------------------------------------------- admission

def _kept_ids(node: Node, ids: list[str]) -> set[str]:
    """The request ids of one step of ``ids`` that ``node``'s feed keeps (forwards) for the version."""
    feed = node.alerting.feed
    rows = [RequestRow(r, i, 6, 1, 6, 3, None, None, 6, 1, 6, 0) for i, r in enumerate(ids)]
    step = SimpleNamespace(timestamp=time.time(), requests=[SimpleNamespace(domain="")] * len(ids))
    before = len(feed._buffer)
    feed.on_rows(SimpleNamespace(limits=LIMITS, worker_id="probe"), step, rows)
    kept = {ids[o[0]] for o in feed._buffer[-1][3]} if len(feed._buffer) > before else set()
    if len(feed._buffer) > before:  # take the probe out again: it is not traffic
        feed.buffered -= len(feed._buffer.pop()[3])
    return kept


PROBE_IDS = [f"probe-{i}" for i in range(4000)]


def _sampled(fraction: float) -> set[str]:
    return {r for r in PROBE_IDS if is_sampled(r, fraction)}


async def test_an_owner_short_of_budget_shrinks_the_fleets_sampling_and_keeps_up(make_node, virtual_cpu) -> None:
    """Two writers send far more than the owner's monitor budget feeds: the owner publishes a lower
    fraction, both writers sample by it (the same request ids), and the evidence lag stops growing.

    The budget is measured on a :class:`VirtualCPU` (20 µs a request-step) and rounds are 50 ms apart on
    the monitor's clock: 0.8 of the 0.5 ms a round affords 20 request-steps, the writers offer 1,280 a round
    (640 at their own 0.5), so the fraction that fits is 0.5 × 20 / 640 = 1/64, on any machine."""
    cpu = virtual_cpu(per_step_s=20e-6, per_calibration_s=0.030)
    # Baselines never complete here (cpu.calibrations stays 0), so no calibration (tens of ms, paid back over
    # many rounds) blurs the budget.
    learning = FAST | {"baseline_steps": 10**9, "baseline_max": 10**9}
    a, b = (make_node(n, budget_s=0.0005, sample_fraction=0.5, config=learning, admit_every_s=0.0, cpu=cpu,
                      round_s=0.05, ttl_s=30.0) for n in "ab")
    # Before anything is published both sample at their own fraction.
    await a.round()
    await b.round()
    configured = _sampled(0.5)
    assert _kept_ids(a, PROBE_IDS) == _kept_ids(b, PROBE_IDS) == configured
    a.steps("wa", 5, 0.8)
    b.steps("wb", 5, 0.8)
    owner, other = await elect(a, b)
    watch = owner.drift.watches[("eagle", "fv1")]
    lags, fractions = [], []
    for _ in range(200):
        await step_both(a, b, 40, 0.8, batch=16)
        lags.append(watch.lag or 0)
        fractions.append(watch.fraction)
    await owner.round()  # publishes (and applies) its latest fraction
    await other.round()  # reads it
    published = watch.fraction
    assert published is not None and published < 0.4, published  # fell well below the configured 0.5
    # Once the start-up burst (admitted at 0.5 before anything was published) is worked off, the fraction
    # sits at what the budget fits, 1/64, give or take the hash sample's noise (20 request-steps a round).
    settled = statistics.median(fractions[100:])
    assert 1 / 96 < settled < 1 / 43, (settled, fractions)
    for n in (a, b):
        assert n.drift.sample_fraction(("eagle", "fv1")) == pytest.approx(published)
    kept_a, kept_b = _kept_ids(a, PROBE_IDS), _kept_ids(b, PROBE_IDS)
    assert kept_a == kept_b == _sampled(published)
    assert 0 < len(kept_a) < len(configured)
    # The lag stops growing: the burst's backlog is worked off, and over the last 100 rounds (200 entries
    # added) it stays within a few rounds' entries.
    assert max(lags[100:]) < 20 and max(lags[100:]) < max(lags[:100]), lags
    assert cpu.calibrations == 0


async def test_an_owner_whose_monitor_recalibrates_keeps_sampling_and_sees_a_drop(make_node, virtual_cpu) -> None:
    """Baselines that complete cost a calibration (30 ms here) in one drain, far over one round's budget,
    paid back by skipping the next rounds: those rounds end with evidence queued, so the monitor looks
    saturated although, spread over the steps around it, it fits the budget easily. The fraction the owner
    publishes must follow that amortized cost, not collapse towards the floor (as it did, halving every
    window, in the fleet benchmark: 1.0 -> 1/4096 in 25 s, and a drop seen only 35 s later); and a drop
    then opens an alert.

    The budget is measured on a :class:`VirtualCPU` (20 µs a request-step, 30 ms a calibration) and the
    rounds are 50 ms apart on the monitor's clock, so the run is the same on any machine: 64 request-steps
    a round cost 1.28 ms of a 4 ms budget, well within the 0.8 of it (3.2 ms) the fraction is sized to fill,
    so once the calibrations are paid back the fraction is at its ceiling, 1.0; and the cost per
    request-step the owner prices it with is exactly the 20 µs charged, calibrations left out (counted in,
    each 30 ms would read as a dearer step)."""
    cpu = virtual_cpu(per_step_s=20e-6, per_calibration_s=0.030)
    a, b = (make_node(n, budget_s=0.004, sample_fraction=1.0, admit_every_s=0.0, cpu=cpu, round_s=0.05, ttl_s=30.0)
            for n in "ab")
    a.steps("wa", 5, 0.8)
    b.steps("wb", 5, 0.8)
    owner, _ = await elect(a, b)
    watch = owner.drift.watches[("eagle", "fv1")]
    fractions = []
    for _ in range(160):  # baselines complete and calibrate early on
        await step_both(a, b, 4, 0.8)
        fractions.append(watch.fraction)
    assert cpu.calibrations >= 1, "the scenario needs a calibration to pay back"
    assert owner.alerting.monitor.open_alerts() == [], "no drift yet"
    assert min(fractions) >= 0.25, fractions  # dips while a calibration is paid back, never a collapse
    assert fractions[-40:] == [1.0] * 40, fractions  # 64 request-steps a round fit a 4 ms budget
    unit = owner.drift._capacity.unit_costs()
    assert unit is not None and unit.per_step == pytest.approx(20e-6, rel=1e-9), unit
    assert unit.per_forward == 0.0  # forwarding is charged nothing here
    for _ in range(400):
        await step_both(a, b, 4, 0.3)
        if owner.alerting.monitor.open_alerts():
            break
    assert owner.alerting.monitor.open_alerts(), (watch.fraction, watch.lag)


async def test_an_unreachable_or_silent_owner_leaves_the_writers_at_their_own_fraction(redis_server,
                                                                                       make_node) -> None:
    """No published fraction (nobody owns the version, or what was published lapsed): the configured one."""
    a = make_node("a", sample_fraction=0.5, admit_every_s=0.0, fraction_ttl_s=0.3)
    lease = a.drift.leases.key(a.drift.lease_name(("eagle", "fv1")))
    with redis.Redis.from_url(redis_server.url) as r:
        r.set(lease, "elsewhere/0000", px=60_000)  # another replica owns the version, and publishes nothing
    a.steps("wa", 3, 0.8)
    for _ in range(3):
        await a.round()
    assert a.phase() is Phase.IDLE and not a.alerting.feed.version_thresholds
    assert _kept_ids(a, PROBE_IDS) == _sampled(0.5)
    # A fraction published by an owner that then goes silent lapses after its TTL.
    with redis.Redis.from_url(redis_server.url) as r:
        r.set(a.drift.fraction_key(("eagle", "fv1")), "0.125", px=300)
    await a.round()
    assert _kept_ids(a, PROBE_IDS) == _sampled(0.125)
    await rounds([a], lambda: not a.alerting.feed.version_thresholds, what="the fraction lapsing")
    assert _kept_ids(a, PROBE_IDS) == _sampled(0.5)
