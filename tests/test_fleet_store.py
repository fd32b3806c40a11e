"""The fleet's shared state (controller/fleet) against a real redis-server.

Each test starts its own ``redis-server`` (tests/redis_support.py) on a free
loopback port and, where it says so, kills it with SIGKILL, stops it with
SIGSTOP, or restarts it on the same port. Replicas are in-process: each one
its own :class:`FleetStore` (own client, own incarnation) over one Redis.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import controller.models.acceptance as acceptance
from controller.background import in_process_config
from controller.core import Controller
from controller.fleet.acceptance_sync import AcceptanceSync
from controller.fleet.alert_log import AlertFeed, AlertIds, AlertLog
from controller.fleet.bench import bench_acceptance_sync
from controller.fleet.bus import PolicyBus, apply_policy_text
from controller.fleet.cost_priors import CostPriorBook, params_from_json, params_to_json
from controller.fleet.directory import Directory
from controller.fleet.leases import LeaseBook
from controller.fleet.settings import StateSettings
from controller.fleet.store import FleetStore, StoreUnavailable
from controller.models.acceptance import AcceptanceModel
from controller.models.cost import CostParams, StepCostModel
from policies.presets import load_preset, preset_path
from tests.redis_support import RedisServer

KEY = ("eagle", "v1")
EDGES = (0, 1024, 4096)


def wait_until(predicate, timeout_s: float = 10.0, step_s: float = 0.02) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met within %.1f s" % timeout_s)
        time.sleep(step_s)


def store_for(server: RedisServer, replica: str, **kw) -> FleetStore:
    kw.setdefault("op_timeout_s", 0.3)
    kw.setdefault("connect_timeout_s", 0.3)
    return FleetStore(server.url, fleet="t", replica_id=replica, **kw)


class Fleet:
    """``n`` replicas (a model and a sync each) and one reference model fed every step."""

    def __init__(self, server: RedisServer, n: int = 2, depth: int = 4, width: int = 2,
                 max_evidence: float = 2000.0, half_life_s: float = 60.0, seed: int = 0) -> None:
        self.depth, self.width = depth, width
        make = lambda: AcceptanceModel(EDGES, half_life_s=half_life_s, max_evidence=max_evidence)  # noqa: E731
        self.models = [make() for _ in range(n)]
        self.single = make()
        self.stores = [store_for(server, f"r{i}") for i in range(n)]
        self.syncs = [AcceptanceSync(m, s, seed_grace_s=0.0) for m, s in zip(self.models, self.stores)]
        self.rng = np.random.default_rng(seed)
        self.now = 0.0
        for sync in self.syncs:  # the fleet exists before the traffic: the first replica seeds it
            assert sync.merge_now() or sync.merge_now()

    def second(self, alpha: float = 0.8, steps: int = 120, merge: bool = True) -> list[bool]:
        """One simulated second: ``steps`` chains spread over replicas and buckets, a tick, a merge each."""
        for i in range(steps):
            replica = self.models[i % len(self.models)]
            bucket = (i // len(self.models)) % len(EDGES)
            tau = 0
            while tau < self.depth and self.rng.random() < alpha:
                tau += 1
            offered = float(self.rng.random() < 0.9)
            for m in (replica, self.single):
                post = m.strata(KEY, self.depth, self.width, self.now)[bucket]
                post.observe_chain(self.depth, tau)
                post.observe_offers(1, offered)
        for m in (*self.models, self.single):
            m.tick(self.now + 0.999)
        self.now += 1.0
        return [s.merge_now() for s in self.syncs] if merge else []

    def settle(self) -> None:
        """A tick later, every replica pushes what it holds and reads the others' (two rounds: the last
        pusher's evidence reaches the first one in the second); the last tick's evidence is rolled by then."""
        self.now += 1.0
        for m in (*self.models, self.single):
            m.tick(self.now)
        for _ in range(2):
            for s in self.syncs:
                assert s.merge_now(), s.store.health()

    def posteriors(self, model: AcceptanceModel, bucket: int):
        return model.strata(KEY, self.depth, self.width)[bucket]

    def max_gap(self) -> tuple[float, float]:
        """Largest difference from the single model over every replica and bucket: (stick mean, evidence share)."""
        mean_gap = evidence_gap = 0.0
        for bucket in range(len(EDGES)):
            ref = self.posteriors(self.single, bucket)
            for m in self.models:
                post = self.posteriors(m, bucket)
                mean_gap = max(mean_gap, float(np.abs(post.stick_mean() - ref.stick_mean()).max()))
                ev, ev_ref = post.effective_samples(), ref.effective_samples()
                evidence_gap = max(evidence_gap, float(np.abs(ev - ev_ref).max() / max(ev_ref.max(), 1.0)))
        return mean_gap, evidence_gap

    def close(self) -> None:
        for s in self.stores:
            s.close()


@pytest.fixture
def no_carry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The carry off: the posterior is then a linear function of the evidence and merging must be exact."""
    monkeypatch.setattr(acceptance, "CARRY_CHANGE", float("inf"))


# ------------------------------------------------------------------ store
def test_store_counts_failures_and_backs_off_without_waiting(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "r")  # never started: nothing listens on its port
    # The store's clock stands still: the failed ping's 5 s of backoff never run out.
    store = FleetStore(server.url, fleet="t", replica_id="a", connect_timeout_s=0.2, backoff_s=(5.0, 5.0),
                       clock=lambda: 100.0)
    try:
        assert store.ping() is False
        attempted = []
        with pytest.raises(StoreUnavailable, match="backing off"):
            store.call("merge", lambda r: attempted.append(r) or r.ping())
        assert attempted == []  # no connect attempt while backing off: the call never reached the client
        health = store.health()
        assert health["up"] is False and health["outages"] == 1
        assert health["failures"] == {"ping": 1, "merge": 1}
    finally:
        store.close()


def test_store_reconnects_after_a_restart_on_the_same_port(redis_server: RedisServer) -> None:
    store = store_for(redis_server, "a", backoff_s=(0.05, 0.05))
    try:
        assert store.ping()
        redis_server.kill()
        assert store.ping() is False
        redis_server.start()
        time.sleep(0.06)  # past the backoff
        assert store.ping()
        health = store.health()
        assert health["up"] is True and health["outages"] == 1 and health["calls"]["ping"] == 2
    finally:
        store.close()


def test_settings_need_a_redis_url() -> None:
    assert StateSettings().backend == "embedded"
    with pytest.raises(ValueError, match="needs url"):
        StateSettings(backend="redis")
    with pytest.raises(ValueError, match="must start with redis://"):
        StateSettings(backend="redis", url="http://x")
    assert StateSettings(backend="redis", url="redis://h:1/0", replica_id="ctl-a").replica_id == "ctl-a"


# ---------------------------------------------------- acceptance statistics
def test_two_replicas_hold_exactly_what_one_model_fed_everything_holds(redis_server, no_carry) -> None:
    fleet = Fleet(redis_server, n=2)
    try:
        for second in range(90):
            fleet.second(alpha=0.8 if second < 45 else 0.55)
        fleet.settle()
        mean_gap, evidence_gap = fleet.max_gap()
        # Decay is exponential and the cap scales the totals where the single model's does: exact.
        assert mean_gap < 1e-9 and evidence_gap < 1e-9, (mean_gap, evidence_gap)
        for bucket in range(len(EDGES)):
            ref = fleet.posteriors(fleet.single, bucket)
            for m in fleet.models:
                assert fleet.posteriors(m, bucket).offer_probs() == pytest.approx(ref.offer_probs(), abs=1e-9)
        # Capped at its last tick, then decayed over the second settle() waits.
        assert fleet.posteriors(fleet.single, 0).effective_samples()[0] == pytest.approx(2000.0 * 0.5 ** (1 / 60),
                                                                                        rel=1e-4)
        counts = fleet.syncs[0].counts
        assert counts["batches_applied"] >= 89 and counts["merge_failures"] == 0
    finally:
        fleet.close()


def test_under_a_binding_cap_replicas_still_hold_exactly_one_models_posterior(redis_server, no_carry) -> None:
    """600 and 6,000 steps a second, far above what a second of decay removes at the cap (and at 6,000 above
    the cap itself every tick): the fleet caps the sum of every replica's deltas once per tick, as one model
    caps its tick's evidence, so merge order does not matter and the views are exact."""
    for steps in (600, 6000):
        fleet = Fleet(redis_server, n=2)
        try:
            fleet.stores[0].client.flushall()
            for second in range(60):
                fleet.second(alpha=0.8 if second < 30 else 0.55, steps=steps)
            fleet.settle()
            mean_gap, evidence_gap = fleet.max_gap()
            assert mean_gap < 1e-9 and evidence_gap < 1e-9, (steps, mean_gap, evidence_gap)
        finally:
            fleet.close()


def test_a_late_delta_joins_its_tick_through_the_cap_factors(redis_server, no_carry) -> None:
    """Replica 1's push for tick k lands after replica 0's push for tick k + 1 has rolled tick k: it joins
    the settled posterior through the cap factors that roll left, which is exactly the roll with it in."""
    fleet = Fleet(redis_server, n=2)
    try:
        for _ in range(10):
            fleet.second(steps=6000)
        fleet.second(steps=6000, merge=False)  # tick k
        late = fleet.syncs[1].prepare()  # sealed now, lands later
        assert late.batch is not None and fleet.syncs[0].merge_now()
        tick_k = int(np.floor(late.batch.deltas[0].at))
        fleet.second(steps=6000, merge=False)  # tick k + 1
        assert fleet.syncs[0].merge_now()
        key = fleet.syncs[0].stratum_key(late.batch.deltas[0].stratum)
        assert int(fleet.stores[0].client.hget(key, "k")) == tick_k  # rolled without replica 1's delta
        reply = fleet.stores[1].call("acceptance_merge", lambda r: fleet.syncs[1].exchange(late, r))
        assert reply.applied and fleet.syncs[1].install(reply)
        assert fleet.syncs[1].merge_now()  # its tick k + 1
        fleet.settle()
        mean_gap, evidence_gap = fleet.max_gap()
        assert mean_gap < 1e-9 and evidence_gap < 1e-9, (mean_gap, evidence_gap)
    finally:
        fleet.close()


def test_with_the_carry_replicas_stay_near_one_model(redis_server) -> None:
    """The carry is a thresholded heuristic: a replica may carry on another tick than one model would
    (its reference differs by the other's last second), so deep cells may differ a little; the
    reference cell (position 1, every step tests it) stays exact to sampling."""
    fleet = Fleet(redis_server, n=2)
    try:
        for second in range(120):
            fleet.second(alpha=0.8 if second < 60 else 0.5)
        fleet.settle()
        mean_gap, evidence_gap = fleet.max_gap()
        assert mean_gap < 0.04 and evidence_gap < 0.01, (mean_gap, evidence_gap)
        for bucket in range(len(EDGES)):
            ref = fleet.posteriors(fleet.single, bucket).stick_mean()[0, 0]
            for m in fleet.models:
                assert fleet.posteriors(m, bucket).stick_mean()[0, 0] == pytest.approx(ref, abs=0.002)
    finally:
        fleet.close()


def test_a_resent_batch_is_not_counted_twice(redis_server, no_carry) -> None:
    fleet = Fleet(redis_server, n=2)
    try:
        for _ in range(10):
            fleet.second()
        sync = fleet.syncs[0]
        for _ in range(3):
            fleet.second(merge=False)
        job = sync.prepare()
        assert job.batch is not None
        # The round trip lands in Redis but its answer is lost (a timeout on the way back).
        fleet.stores[0].call("acceptance_merge", lambda r: sync.exchange(job, r))
        sync.failed(StoreUnavailable("acceptance_merge", "no answer"))
        retry = sync.prepare()
        assert retry.batch is job.batch  # the same sealed batch, not a new one
        assert sync.merge_now()
        assert sync.counts["batches_already_applied"] == 1 and sync.counts["batches_resent"] >= 1
        fleet.syncs[1].merge_now()
        fleet.settle()
        mean_gap, evidence_gap = fleet.max_gap()
        assert mean_gap < 1e-9 and evidence_gap < 1e-9, (mean_gap, evidence_gap)
    finally:
        fleet.close()


def test_redis_down_keeps_serving_counts_and_reconciles(tmp_path: Path, no_carry) -> None:
    server = RedisServer(tmp_path / "redis", persist=True).start()  # SIGKILL loses nothing acknowledged
    fleet = Fleet(server, n=2)
    try:
        for _ in range(20):
            fleet.second()
        server.kill()
        before = fleet.posteriors(fleet.models[0], 0).stick_mean()[0, 0]
        for _ in range(10):
            assert fleet.second(alpha=0.3) == [False, False]
        status = fleet.syncs[0].status()
        assert status["counts"]["merge_failures"] == 10
        assert status["unmerged_evidence"] > 0 and status["unconfirmed_batch"] is not None
        assert fleet.stores[0].health()["failures"]["acceptance_merge"] == 10
        # Still planning from local state: its own workers' drop shows in its model.
        assert fleet.posteriors(fleet.models[0], 0).stick_mean()[0, 0] < before - 0.02
        server.start()
        fleet.stores[0]._retry_at = fleet.stores[1]._retry_at = float("-inf")  # not waiting out the backoff
        for _ in range(5):
            assert fleet.second() == [True, True]
        fleet.settle()
        mean_gap, evidence_gap = fleet.max_gap()
        assert mean_gap < 1e-9 and evidence_gap < 1e-9, (mean_gap, evidence_gap)
        assert fleet.syncs[0].status()["unmerged_evidence"] == 0.0
        assert fleet.syncs[0].counts["seeds"] + fleet.syncs[1].counts["seeds"] == 1  # only the first start
    finally:
        fleet.close()
        server.stop()


def test_redis_restarted_empty_is_reseeded_without_double_counting(redis_server, no_carry) -> None:
    fleet = Fleet(redis_server, n=2)
    try:
        for _ in range(30):
            fleet.second()
        redis_server.kill()
        for _ in range(3):
            fleet.second()  # evidence gathered while it is down
        redis_server.start()  # no persistence: everything is gone
        for store in fleet.stores:
            store._retry_at = float("-inf")
        empty_before = [s.counts["store_empty"] for s in fleet.syncs]
        assert fleet.second() == [False, False]  # the store is empty: both notice
        assert [s.counts["store_empty"] for s in fleet.syncs] == [n + 1 for n in empty_before]
        for _ in range(3):
            fleet.second()
        fleet.settle()
        # Re-seeded by one replica with the totals it last read; everything unmerged pushed once. What the
        # other replica merged after that read (its last second before the crash) went with the store:
        # 20 steps per bucket per replica per second here. Nothing is counted twice.
        for bucket in range(len(EDGES)):
            ref = fleet.posteriors(fleet.single, bucket)
            for m in fleet.models:
                post = fleet.posteriors(m, bucket)
                lost_s = np.asarray(ref.succ) - np.asarray(post.succ)
                lost_f = np.asarray(ref.fail) - np.asarray(post.fail)
                assert (lost_s >= -1e-6).all() and (lost_f >= -1e-6).all()  # never more than one model holds
                assert (lost_s + lost_f).max() <= 21.0
        mean_gap, evidence_gap = fleet.max_gap()
        assert mean_gap < 0.01 and evidence_gap < 0.02, (mean_gap, evidence_gap)
        seeds = [s.counts["seeds"] for s in fleet.syncs]
        assert sum(seeds) == 2  # the first start, and one re-seed
        assert all(s.counts["epochs_adopted"] >= 1 for s in fleet.syncs)
    finally:
        fleet.close()


def test_strata_the_reseeding_replica_never_held_keep_their_history(redis_server, no_carry) -> None:
    """Redis restarted empty and re-seeded by a replica that never ran drafter version "b": the replicas
    that ran it offer what they last read of its strata, and the first offer of each is added once, so
    "b" keeps its fleet history (without the offers its totals would restart from the outage's evidence,
    and every replica would install those in place of what it knew)."""
    a_key, b_key = ("eagle", "a"), ("eagle", "b")
    make = lambda: AcceptanceModel(EDGES, half_life_s=60.0, max_evidence=1e9)  # noqa: E731 - no cap: exact
    models, single = [make() for _ in range(3)], make()
    stores = [store_for(redis_server, f"r{i}") for i in range(3)]
    syncs = [AcceptanceSync(m, st, seed_grace_s=0.0) for m, st in zip(models, stores)]
    rng = np.random.default_rng(5)
    now = 0.0

    def second(merge: bool = True) -> None:
        nonlocal now
        for i, key in ((0, a_key), (1, b_key), (2, b_key)):
            for _ in range(40):
                tau = int(min(rng.geometric(0.3) - 1, 4))
                for m in (models[i], single):
                    m.strata(key, 4, 1, now)[0].observe_chain(4, tau)
        for m in (*models, single):
            m.tick(now + 0.999)
        now += 1.0
        if merge:
            for sync in syncs:
                sync.merge_now()

    try:
        for _ in range(10):
            second()
        for _ in range(2):  # settled: every replica holds the fleet totals, nothing unmerged
            for sync in syncs:
                assert sync.merge_now()
        redis_server.kill()
        redis_server.start()
        for st in stores:
            st._retry_at = float("-inf")
        assert syncs[0].merge_now() is False and syncs[0].merge_now()  # r0 (only "a") notices first, seeds
        assert syncs[0].counts["seeds"] == 2
        assert [sync.merge_now() for sync in syncs[1:]] == [False, False]  # a new epoch: offer first
        for _ in range(2):
            for sync in syncs:
                assert sync.merge_now()
        reseeded = [sync.counts["strata_reseeded"] for sync in syncs]
        assert sorted(reseeded) == [0, 0, 1], reseeded  # "b"'s one stratum with evidence, added once
        now += 1.0  # a tick later, with no new evidence: the last tick's deltas are rolled into what they plan from
        for m in (*models, single):
            m.tick(now)
        for sync in syncs:
            assert sync.merge_now()
        ref = single.strata(b_key, 4, 1)[0]
        for m in models[1:]:
            post = m.strata(b_key, 4, 1)[0]
            assert post.effective_samples() == pytest.approx(ref.effective_samples(), rel=1e-9)
            assert post.stick_mean() == pytest.approx(ref.stick_mean(), abs=1e-9)
    finally:
        for st in stores:
            st.close()


def test_a_replica_meeting_a_drafter_version_first_plans_from_the_fleet(redis_server, no_carry) -> None:
    """A worker failing over to a replica that never ran its drafter version: one merge round and that
    replica's view is the fleet's totals, not the prior. (Without the carry, which each replica keeps
    locally, so that the old replicas' views are the totals too.)"""
    fleet = Fleet(redis_server, n=2)
    late_store = store_for(redis_server, "late")
    try:
        for _ in range(30):
            fleet.second(alpha=0.7)
        fleet.settle()
        late = AcceptanceModel(EDGES, half_life_s=60.0, max_evidence=2000.0)
        sync = AcceptanceSync(late, late_store, seed_grace_s=60.0)  # never seeds: the fleet has an epoch
        late.strata(KEY, fleet.depth, fleet.width)  # the Hello of a worker of this version
        assert not sync.knows(KEY)
        assert sync.merge_now() and sync.knows(KEY)
        for bucket in range(len(EDGES)):
            got = late.strata(KEY, fleet.depth, fleet.width)[bucket]
            want = fleet.posteriors(fleet.models[0], bucket)
            # Equal up to the decay between the totals' time and replica 0's last tick (under 1e-6 here).
            assert got.stick_mean() == pytest.approx(want.stick_mean(), abs=1e-6)
            assert got.effective_samples() == pytest.approx(want.effective_samples(), rel=1e-4)
            # It plans from the fleet's settled posterior itself (decayed to its own clock).
            stored, at = late_store.client.hmget(sync.stratum_key((KEY, bucket)), "s", "t")
            decay = 0.5 ** ((got.updated_at - float(at)) / late.half_life_s)
            assert got.view is not None
            assert got.planning_arrays()[0] == pytest.approx(np.frombuffer(stored, "<f8") * decay, rel=1e-12)
        assert sync.counts["seeds"] == 0 and sync.counts["epochs_adopted"] == 1
    finally:
        fleet.close()
        late_store.close()


def test_a_new_replica_does_not_seed_an_empty_store_at_once(redis_server) -> None:
    clock = [0.0]
    model = AcceptanceModel(EDGES, half_life_s=60.0)
    store = store_for(redis_server, "new")
    sync = AcceptanceSync(model, store, seed_grace_s=3.0, clock=lambda: clock[0])
    try:
        model.strata(KEY, 4, 1, 0.0)[0].observe_chain(4, 2, 10.0)
        model.tick(0.0)
        assert sync.merge_now() is False and not store.client.exists(store.key("acc-epoch"))
        clock[0] = 2.0
        assert sync.merge_now() is False and not store.client.exists(store.key("acc-epoch"))
        clock[0] = 3.5
        assert sync.merge_now() is False  # grace over: this round asks for the seed
        assert sync.merge_now() is True and sync.counts["seeds"] == 1
        # Seeded with nothing settled (it had no evidence but its own unpushed delta), which then opened
        # the fleet's current tick.
        settled, opened = store.client.hmget(sync.stratum_key((KEY, 0)), "t", "us")
        assert settled is None
        assert np.frombuffer(opened, "<f8")[:3].tolist() == pytest.approx([10.0, 10.0, 0.0])
    finally:
        store.close()


def test_replicas_with_different_drafter_limits_share_the_common_cells(redis_server, no_carry) -> None:
    small, large = AcceptanceModel(EDGES, half_life_s=60.0), AcceptanceModel(EDGES, half_life_s=60.0)
    stores = [store_for(redis_server, "s"), store_for(redis_server, "l")]
    syncs = [AcceptanceSync(small, stores[0], seed_grace_s=0), AcceptanceSync(large, stores[1], seed_grace_s=0)]
    try:
        for s in syncs:
            s.merge_now()  # seeds the fleet
        small.strata(KEY, 2, 1, 0.0)[0].observe_chain(2, 1, 40.0)  # position 1 ok, position 2 fails
        large.strata(KEY, 4, 2, 0.0)[0].observe_chain(4, 3, 10.0)  # positions 1-3 ok, 4 fails
        for m in (small, large):
            m.tick(0.0)  # no time passed: nothing decays
        for _ in range(2):
            for s in syncs:
                assert s.merge_now()
        a, b = small.strata(KEY, 2, 1)[0].beta_params(), large.strata(KEY, 4, 2)[0].beta_params()
        assert a[0][:, 0] - small.prior.rank1_mean * 2 == pytest.approx([50.0, 10.0])
        assert a[1][:, 0] - (1 - small.prior.rank1_mean) * 2 == pytest.approx([0.0, 40.0])
        assert b[0][:, 0] - large.prior.rank1_mean * 2 == pytest.approx([50.0, 10.0, 10.0, 0.0])
        assert b[1][:, 0] - (1 - large.prior.rank1_mean) * 2 == pytest.approx([0.0, 40.0, 0.0, 10.0])
        assert stores[0].client.hmget(syncs[0].stratum_key((KEY, 0)), "d", "w") == [b"4", b"2"]
    finally:
        for s in stores:
            s.close()


async def test_a_hung_redis_never_blocks_the_event_loop(redis_server) -> None:
    fleet = Fleet(redis_server, n=1)
    gaps: list[float] = []

    async def heartbeat() -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    beat = asyncio.create_task(heartbeat())
    try:
        fleet.second(merge=False)
        assert await fleet.syncs[0].sync_once()
        os.kill(redis_server.pid, signal.SIGSTOP)  # alive, accepting, answering nothing
        try:
            fleet.second(merge=False)
            gaps.clear()
            failed = fleet.stores[0].failures["acceptance_merge"]
            assert await fleet.syncs[0].sync_once(timeout_s=0.5) is False  # given up on, not waited for
            assert fleet.stores[0].failures["acceptance_merge"] > failed
            # The loop kept running while the round trip hung: the 5 ms heartbeat beat during the call (a
            # round trip run on the loop would block it for the whole call, and it would not beat at all).
            assert len(gaps) >= 2, gaps
        finally:
            os.kill(redis_server.pid, signal.SIGCONT)
        fleet.stores[0]._retry_at = float("-inf")
        await asyncio.sleep(0.35)  # the hung call's socket timeout passes
        assert await fleet.syncs[0].sync_once()
        assert fleet.syncs[0].counts["batches_applied"] + fleet.syncs[0].counts["batches_already_applied"] == 2
    finally:
        beat.cancel()
        fleet.close()


def test_installs_spread_over_ticks_within_a_loop_budget(redis_server, no_carry) -> None:
    fleet = Fleet(redis_server, n=2)
    try:
        for _ in range(5):
            fleet.second()
        for m in fleet.models:  # more strata: three more drafter versions
            for v in ("v2", "v3", "v4"):
                m.strata(("eagle", v), fleet.depth, fleet.width, fleet.now)
        sync = fleet.syncs[0]
        assert sync.knows(KEY) and not sync.knows(("eagle", "v2"))  # nobody pushed v2 yet
        fleet.second(merge=False)
        job = sync.prepare()
        reply = fleet.stores[0].call("acceptance_merge", lambda r: sync.exchange(job, r))
        assert sync.install(reply, budget_s=0.0)  # one stratum at least, the rest wait
        waiting = sync.status()["strata_to_install"]
        assert 0 < waiting < len(job.reads)
        assert sync.drain() == waiting and sync.status()["strata_to_install"] == 0
        fleet.syncs[1].merge_now()
        fleet.settle()
        mean_gap, evidence_gap = fleet.max_gap()
        assert mean_gap < 1e-9 and evidence_gap < 1e-9
    finally:
        fleet.close()


def test_sync_benchmark_reports_cpu_per_thousand_steps(redis_server) -> None:
    out = bench_acceptance_sync(redis_server.url, replicas=2, versions=2, seconds=4, steps_per_s=2000)
    assert out["steps"] == 2 * 4 * 2000 and out["merges"] == 8
    # What the CPU figures are made of (how large they are is the benchmark's to report, not a test's): the
    # merges' CPU is part of the total per 1,000 steps, and the loop's share is part of each merge's.
    merges_ms_per_1k = out["merge_cpu_ms_mean"] * out["merges"] * 1000.0 / out["steps"]
    assert out["cpu_per_1k_steps_ms"] >= merges_ms_per_1k * (1 - 1e-9) > 0
    assert out["merge_cpu_ms_mean"] >= out["merge_loop_cpu_ms_mean"] * (1 - 1e-9)
    assert isinstance(out["redis_cpu_per_1k_steps_ms"], float) and out["redis_cpu_per_1k_steps_ms"] >= 0
    assert out["merge_ms_p99"] >= out["merge_ms_p50"] > 0


# ------------------------------------------------------------- cost priors
def test_cost_priors_reach_a_replica_meeting_the_same_kind(redis_server) -> None:
    a, b = store_for(redis_server, "a"), store_for(redis_server, "b")
    book_a, book_b = CostPriorBook(a, min_steps=100), CostPriorBook(b, min_steps=100)
    try:
        fitted = CostParams(mem_ms=7.25, mem_ms_per_kv_token=3e-5, compute_ms_per_token=0.05,
                            compute_knots=(1.0, 2.0, 4.0), compute_rise_ms=(0.0, 0.1, 0.4))
        assert not book_a.publish("H100-SXM", 1, "llama-3-8b", fitted, steps=50)  # too few steps
        assert book_a.publish("H100-SXM", 1, "llama-3-8b", fitted, steps=500)
        assert book_b.lookup("H100-SXM", 1, "llama-3-8b") is None  # a miss: fetched by the next flush
        book_a.flush()
        book_b.flush()
        got = book_b.lookup("H100-SXM", 1, "llama-3-8b")
        assert got == fitted
        assert StepCostModel(prior=got).refit() == fitted  # a new worker's cost model starts there
        assert book_b.lookup("H100-SXM", 8, "llama-3-8b") is None  # another kind
        # A fit on fewer steps does not replace it; one on more does.
        worse = CostParams(mem_ms=99.0)
        book_b.publish("H100-SXM", 1, "llama-3-8b", worse, steps=200)
        book_b.flush()
        assert book_a.fetch_now("H100-SXM", 1, "llama-3-8b") == fitted
        assert book_b.fetch_now("H100-SXM", 1, "llama-3-8b") == fitted  # its own cache follows the store
        better = CostParams(mem_ms=8.0)
        book_b.publish("H100-SXM", 1, "llama-3-8b", better, steps=5000)
        book_b.flush()
        assert book_a.fetch_now("H100-SXM", 1, "llama-3-8b") == better
        assert book_b.counts["kept_stored"] == 1 and book_b.counts["published"] == 1
    finally:
        a.close()
        b.close()


def test_cost_prior_json_tolerates_unknown_and_missing_fields() -> None:
    text = params_to_json(CostParams(mem_ms=3.0)).replace('"mem_ms"', '"future_field": 1, "mem_ms"')
    assert params_from_json(text) == CostParams(mem_ms=3.0)
    assert params_from_json('{"mem_ms": 4.0}') == CostParams(mem_ms=4.0)


def test_cost_prior_publish_is_kept_while_redis_is_down(redis_server) -> None:
    a = store_for(redis_server, "a")
    book = CostPriorBook(a, min_steps=1)
    try:
        redis_server.kill()
        book.publish("L4", 1, "m", CostParams(mem_ms=5.0), steps=10)
        with pytest.raises(StoreUnavailable):
            book.flush()
        assert book.stats()["queued"] == 1
        redis_server.start()
        a._retry_at = float("-inf")
        book.flush()
        assert book.stats()["queued"] == 0 and book.fetch_now("L4", 1, "m") == CostParams(mem_ms=5.0)
    finally:
        a.close()


# ------------------------------------------------------ leases and alerts
def test_replicas_racing_for_strata_get_one_holder_each(redis_server) -> None:
    stores = [store_for(redis_server, f"r{i}") for i in range(3)]
    books = [LeaseBook(s, ttl_s=5.0) for s in stores]
    strata = [f"eagle/v1/ctx{i}" for i in range(20)]
    try:
        for book in books:
            for name in strata:
                book.want(name)
        barrier = threading.Barrier(len(books))

        def race(book: LeaseBook) -> None:
            barrier.wait()
            book.cycle()

        threads = [threading.Thread(target=race, args=(b,)) for b in books]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        for name in strata:
            assert sum(b.holds(name) for b in books) == 1, name
        assert sum(b.counts["taken"] for b in books) == len(strata)
        assert sum(b.counts["refused"] for b in books) == 2 * len(strata)
    finally:
        for s in stores:
            s.close()


def test_a_lease_is_renewed_by_its_holder_and_taken_over_when_it_dies(redis_server) -> None:
    a, b = store_for(redis_server, "a"), store_for(redis_server, "b")
    la, lb = LeaseBook(a, ttl_s=0.6), LeaseBook(b, ttl_s=0.6)
    try:
        la.want("s")
        lb.want("s")
        la.cycle()
        lb.cycle()
        assert la.holds("s") and not lb.holds("s") and lb.held_by("s") == a.incarnation
        for _ in range(4):  # past the ttl twice over: renewals keep it
            time.sleep(0.25)
            la.cycle()
            lb.cycle()
        assert la.counts["renewed"] >= 2 and la.holds("s") and not lb.holds("s")
        # The holder stops (crashed: no release); its own belief lapses before Redis frees the key.
        time.sleep(0.55)
        assert not la.holds("s")
        wait_until(lambda: (lb.cycle(), lb.holds("s"))[1], timeout_s=2.0, step_s=0.05)
        la.cycle()  # back from its pause: it finds the lease gone and does not take it back
        assert not la.holds("s") and la.held_by("s") == b.incarnation
        # Released on purpose, it is free at once.
        lb.drop("s")
        lb.cycle()
        assert la.take_now("s")
    finally:
        a.close()
        b.close()


def test_a_drift_seen_on_two_replicas_opens_one_alert_every_replica_sees(redis_server) -> None:
    stores = [store_for(redis_server, f"r{i}") for i in range(2)]
    books = [LeaseBook(s, ttl_s=5.0) for s in stores]
    logs = [AlertLog(s) for s in stores]
    ids = [AlertIds(s, block=4, low=2) for s in stores]
    seen: list[list] = [[], []]
    feeds = [AlertFeed(s, seen[i].append, skip_origin=s.incarnation).start() for i, s in enumerate(stores)]
    try:
        wait_until(lambda: all(f.connected for f in feeds))
        opened = []
        barrier = threading.Barrier(2)

        def replica(i: int) -> None:
            # Both monitors flag the same stratum at once; only the lease holder opens the alert.
            books[i].want("eagle/v1/ctx0")
            barrier.wait()
            books[i].cycle()
            if books[i].holds("eagle/v1/ctx0"):
                ids[i].refill()
                alert = {"id": f"A{ids[i].take()}", "stratum": "ctx0", "drafter_version": "v1", "status": "open",
                         "opened_at": 10.0, "acked_at": None, "acked_by": ""}
                logs[i].record("opened", alert, 10.0)
                logs[i].flush()
                opened.append(i)

        threads = [threading.Thread(target=replica, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(opened) == 1
        owner, other = opened[0], 1 - opened[0]
        history = logs[other].history()
        assert [a["id"] for a in history] == ["A1"] and history[0]["status"] == "open"
        wait_until(lambda: len(seen[other]) == 1)
        assert seen[other][0].event == "opened" and seen[other][0].alert["id"] == "A1"
        assert seen[owner] == []  # its own events are local already
        # Acked on the other replica; the owner then resolves it: both survive, the first ack wins.
        acked = dict(history[0], acked_at=11.0, acked_by="ops")
        logs[other].record("acknowledged", acked, 11.0)
        logs[other].flush()
        logs[other].record("acknowledged", dict(acked, acked_at=12.0, acked_by="late"), 12.0)
        logs[other].flush()
        logs[owner].record("resolved", dict(history[0], status="resolved", resolved_at=13.0), 13.0)
        logs[owner].flush()
        final = logs[owner].history()[0]
        assert (final["status"], final["acked_by"], final["acked_at"]) == ("resolved", "ops", 11.0)
        wait_until(lambda: [e.event for e in seen[owner]] == ["acknowledged", "acknowledged"])
        wait_until(lambda: [e.event for e in seen[other]] == ["opened", "resolved"])
        assert logs[owner].history(open_only=True) == []
    finally:
        for f in feeds:
            f.stop()
        for s in stores:
            s.close()


def test_alert_ids_never_repeat_across_replicas(redis_server) -> None:
    stores = [store_for(redis_server, f"r{i}") for i in range(3)]
    pools = [AlertIds(s, block=5, low=2) for s in stores]
    try:
        pools[0].at_least(100)  # numbers a local store already used
        taken = []
        for _ in range(12):
            for pool in pools:
                pool.refill()
                taken.append(pool.take())
        assert len(set(taken)) == len(taken) and min(taken) > 100
    finally:
        for s in stores:
            s.close()


def test_alert_feed_and_log_survive_a_redis_restart(redis_server) -> None:
    a, b = store_for(redis_server, "a", backoff_s=(0.05, 0.05)), store_for(redis_server, "b")
    log_a = AlertLog(a)
    seen: list = []
    feed = AlertFeed(b, seen.append, skip_origin=b.incarnation).start()
    try:
        wait_until(lambda: feed.connected)
        log_a.record("opened", {"id": "A1", "status": "open", "opened_at": 1.0}, 1.0)
        log_a.flush()
        wait_until(lambda: len(seen) == 1)
        redis_server.kill()
        log_a.record("resolved", {"id": "A1", "status": "resolved", "opened_at": 1.0}, 2.0)
        with pytest.raises(StoreUnavailable):
            log_a.flush()
        assert log_a.queued() == 1  # kept for the next flush
        wait_until(lambda: not feed.connected)
        redis_server.start()
        time.sleep(0.06)
        assert log_a.flush() == 1
        wait_until(lambda: [e.event for e in seen] == ["opened", "resolved"])
        assert feed.counts["errors"] >= 1 and feed.counts["connects"] >= 2
    finally:
        feed.stop()
        a.close()
        b.close()


# ------------------------------------------------------------- policy bus
def test_a_policy_reload_reaches_the_other_replicas_through_the_same_validation(redis_server) -> None:
    config = in_process_config("goodput")
    controllers = [Controller(config, load_preset("goodput")) for _ in range(3)]
    stores = [store_for(redis_server, f"r{i}") for i in range(3)]
    applied: list[list[tuple[int, str]]] = [[], [], []]

    def applier(i: int):
        def apply(text: str, version: int, source: str) -> None:
            applied[i].append((version, source))
            apply_policy_text(controllers[i], text, source)
        return apply

    buses = [PolicyBus(s, applier(i)).start() for i, s in enumerate(stores[:2])]
    try:
        wait_until(lambda: all(b.subscribed.is_set() for b in buses))
        static = Path(preset_path("static")).read_text()
        # Replica 0 reloaded its file and accepted it; then it publishes the text.
        assert apply_policy_text(controllers[0], static, "static.yaml")
        version = buses[0].publish(static, "static.yaml").result(5)
        wait_until(lambda: controllers[1].policy.name == "static")
        assert applied[0] == [] and applied[1] == [(version, "r0:static.yaml")]  # not applied twice on r0
        # One that fails the validation (a field the policy does not have) keeps the policy in force.
        bad = static.replace("policy: static", "policy: static\nno_such_field: 3")
        bad_version = buses[0].publish(bad, "broken.yaml").result(5)
        wait_until(lambda: controllers[1].policy_reload_failures == 1)
        assert controllers[1].policy.name == "static"
        # A replica started after those catches up with the current version (the bad one: refused too).
        buses.append(PolicyBus(stores[2], applier(2)).start())
        wait_until(lambda: controllers[2].policy_reload_failures == 1)
        assert controllers[2].policy.name == "goodput"
        # A good one from replica 1 reaches replicas 0 and 2.
        heuristic = Path(preset_path("hf-heuristic")).read_text()
        assert apply_policy_text(controllers[1], heuristic, "hf.yaml")
        good = buses[1].publish(heuristic, "hf.yaml").result(5)
        wait_until(lambda: controllers[0].policy.name == controllers[2].policy.name == "hf-heuristic")
        assert applied[0][-1][0] == applied[2][-1][0] == good
        assert version < bad_version < good
        assert [v for v, _ in applied[1]] == [version, bad_version]  # its own publication not applied again
    finally:
        for bus in buses:
            bus.stop()
        for s in stores:
            s.close()


def test_the_policy_bus_resubscribes_and_catches_up_after_redis_restarts(redis_server) -> None:
    a, b = store_for(redis_server, "a", backoff_s=(0.05, 0.05)), store_for(redis_server, "b")
    got: list[int] = []
    bus_b = PolicyBus(b, lambda text, version, source: got.append(version)).start()
    bus_a = PolicyBus(a, lambda *args: None)
    try:
        wait_until(bus_b.subscribed.is_set)
        before = bus_a.publish("policy: static\n", "s.yaml").result(5)
        wait_until(lambda: got == [before])
        redis_server.kill()
        wait_until(lambda: not bus_b.subscribed.is_set())
        # A reload while the store is down: not published yet, kept for the next flush.
        with pytest.raises(StoreUnavailable):
            bus_a.publish("policy: static\n", "s.yaml").result(5)
        assert got == [before]
        redis_server.start()
        time.sleep(0.06)
        wait_until(bus_b.subscribed.is_set)
        after = bus_a.flush()
        assert after > before  # the store restarted empty, and the version still rose
        assert bus_a.flush() is None  # sent once
        wait_until(lambda: got == [before, after])
        assert bus_b.counts["subscribed"] >= 2
    finally:
        bus_b.stop()
        a.close()
        b.close()


# --------------------------------------------------------------- directory
def test_directory_says_which_replica_serves_each_worker(redis_server) -> None:
    clock = [1000.0]
    a, b = store_for(redis_server, "ctl-a"), store_for(redis_server, "ctl-b")
    da = Directory(a, "10.0.0.1:50051", ttl_s=1.0, clock=lambda: clock[0])
    db = Directory(b, "10.0.0.2:50051", ttl_s=5.0, clock=lambda: clock[0])
    try:
        da.assign("w1")
        da.assign("w2")
        db.assign("w3")
        da.cycle()
        db.cycle()
        view = db.read_now()
        assert view.live == {"ctl-a", "ctl-b"} and view.info["ctl-a"]["address"] == "10.0.0.1:50051"
        assert {w: view.serving(w) for w in ("w1", "w2", "w3")} == {"w1": "ctl-a", "w2": "ctl-a", "w3": "ctl-b"}
        # w1 moves to b (its Hello is newer); a's stream for it ends later: a's release leaves b's entry.
        clock[0] += 1.0
        db.assign("w1")
        db.cycle()
        da.release("w1")
        da.cycle()
        assert db.read_now().serving("w1") == "ctl-b"
        # a full re-send from a (it still lists w2) does not take anything back either
        da._cycles = da.resync_every - 1
        da.cycle()
        assert db.read_now().serving("w1") == "ctl-b"
        # a stops heartbeating: past its ttl it is not alive and its workers have no live replica.
        time.sleep(1.1)
        db.cycle()
        view = db.read_now()
        assert view.live == {"ctl-b"} and view.serving("w2") is None and view.workers["w2"][0] == "ctl-a"
        # Non-blocking read for GetStatus: the cached view, refreshed by the next cycle when old.
        assert db.view(max_age_s=60.0) is view
    finally:
        a.close()
        b.close()


def test_directory_rejoins_and_resends_after_redis_loses_its_data(redis_server) -> None:
    a = store_for(redis_server, "ctl-a", backoff_s=(0.05, 0.05))
    da = Directory(a, "h:1", ttl_s=5.0)
    try:
        da.assign("w1")
        da.cycle()
        redis_server.kill()
        da.assign("w2")
        with pytest.raises(StoreUnavailable):
            da.cycle()
        redis_server.start()
        time.sleep(0.06)
        da.cycle()
        view = da.read_now()
        assert view.serving("w1") == "ctl-a" and view.serving("w2") == "ctl-a"
        assert da.counts["rejoined"] == 2  # the first heartbeat, and the one after the restart
        da.leave()
        view = da.read_now()
        assert view.live == frozenset() and view.workers == {}
    finally:
        a.close()


# ------------------------------------------------- every module, one crash
def test_every_module_reconnects_after_kill_9_mid_run(tmp_path: Path, no_carry) -> None:
    server = RedisServer(tmp_path / "redis", persist=True).start()
    fleet = Fleet(server, n=2)
    book = LeaseBook(fleet.stores[0], ttl_s=0.9)  # renewed every 0.3 s
    directory = Directory(fleet.stores[1], "h:2", ttl_s=5.0)
    try:
        book.want("s")
        for _ in range(5):
            fleet.second()
            book.cycle()
            directory.cycle()
        assert book.holds("s")
        server.kill()
        time.sleep(0.35)  # the lease's renewal is due
        for _ in range(4):
            fleet.second()
            with pytest.raises(StoreUnavailable):
                book.cycle()
            with pytest.raises(StoreUnavailable):
                directory.cycle()
        failed = {i: s.health()["failures"] for i, s in enumerate(fleet.stores)}
        assert failed[0]["acceptance_merge"] == 4 and failed[1]["acceptance_merge"] == 4
        assert failed[1]["directory"] == 4 and failed[0]["leases"] == 4
        server.start()
        for s in fleet.stores:
            s._retry_at = float("-inf")
        for _ in range(3):
            assert fleet.second() == [True, True]
        for _ in range(2):  # its lease expired meanwhile: found lost, then taken again
            book.cycle()
        directory.cycle()
        fleet.settle()
        mean_gap, evidence_gap = fleet.max_gap()
        assert mean_gap < 1e-9 and evidence_gap < 1e-9
        assert book.holds("s") and directory.read_now().live == {"r1"}
        assert all(s.health()["up"] and s.health()["outages"] == 1 for s in fleet.stores)
    finally:
        fleet.close()
        server.stop()
