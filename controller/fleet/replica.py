"""One ``specctl serve`` replica wired to the fleet's shared state (``state: {backend: redis}``).

:class:`FleetReplica` owns the store connection and every fleet module
(``controller/fleet``), hooks them into the :class:`~controller.core.Controller`,
the policy file watcher and the drift alerting, and runs their loops:

* **acceptance** — every ``merge_interval_s`` (and at once when a worker
  of a drafter version new to this replica says Hello) the strict and the
  typical rule's models merge their deltas into the fleet totals and install
  the totals (:class:`~controller.fleet.acceptance_sync.AcceptanceSync`);
  the housekeeping tick installs what a round left within its budget;
* **first plans** — a worker whose drafter version this replica has no
  fleet totals for yet (a new worker, or one that moved here from another
  replica) gets its first plan only after a merge round that started after
  its Hello completed, at most ``2 × merge_interval_s`` later: it is planned
  from the fleet's statistics, not from the prior. A Decide-only worker's
  Decide waits for the same round (without blocking the loop);
* **cost priors** — a new worker's cost model starts from the fleet's fit
  for its accelerator × count × model when one is known
  (:class:`~controller.fleet.cost_priors.CostPriorBook`); fitted workers'
  parameters are published every few heartbeats;
* **directory** — Hello and disconnect say which worker this replica serves;
  a heartbeat every ``heartbeat_interval_s`` keeps the replica alive in it
  (:class:`~controller.fleet.directory.Directory`); GetStatus reads it;
* **policy** — an accepted reload (file, SIGHUP, ReloadPolicy) is published;
  other replicas' reloads are applied through the same validation
  (:class:`~controller.fleet.bus.PolicyBus`);
* **drift alerts** — :class:`~controller.fleet.alerts.FleetAlerts` (leases,
  fleet-wide ids, the alert log and its feed);
* **drift monitors** — one per drafter version fleet-wide
  (:class:`~controller.fleet.drift_owner.FleetDriftMonitor`, unless
  ``state.drift_monitor: replica``): every ``drift_interval_s`` the sampled
  outcomes go to the versions' streams, the owner reads its versions' and
  checkpoints them.

Never on the hot path: Hello, disconnect, ingest and plan pushes only touch
local tables; every Redis round trip runs on the store's threads
(:meth:`FleetStore.run` / :meth:`FleetStore.offload`) under a timeout, and a
failure is counted and skipped — a replica whose Redis is down or slow
serves from its local state and reconciles when it answers again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Awaitable, Callable

from controller.core import Controller, WorkerState
from controller.fleet.acceptance_sync import AcceptanceSync
from controller.fleet.alerts import FleetAlerts
from controller.fleet.bus import PolicyBus, apply_policy_text
from controller.fleet.cost_priors import CostPriorBook
from controller.fleet.directory import Directory, FleetView
from controller.fleet.drift_owner import FleetDriftMonitor
from controller.fleet.settings import StateSettings
from controller.fleet.store import FleetStore, StoreUnavailable
from controller.models.cost import CostParams
from protos.speculation.v1 import controller_pb2, worker_pb2

log = logging.getLogger("specctl.fleet")

COST_PUBLISH_EVERY = 5  # heartbeats between two publications of the fitted cost models
COST_WAIT_HEARTBEATS = 3  # a worker whose kind's fit was not cached waits this many heartbeats for the fetch
# The fleet's alert table is read at start and again this often: the feed carries every event in between
# (it resumes where it stopped after an outage), so this only repairs what a trimmed stream lost.
RECONCILE_ALERTS_S = 300.0


class _Periodic:
    """``await step()`` every ``interval_s``, or sooner when woken; never dies of a failed round."""

    def __init__(self, interval_s: float, step: Callable[[], Awaitable[Any]], name: str) -> None:
        self.interval_s = interval_s
        self.step = step
        self.name = name
        self.rounds = 0
        self._wake = asyncio.Event()

    def wake(self) -> None:
        """Run the next round now (on the loop)."""
        self._wake.set()

    async def run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.step()
            except StoreUnavailable:
                pass  # counted where it happened
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a fleet round's bug must not stop serving
                log.exception("fleet %s round failed", self.name)
            self.rounds += 1


@dataclass
class _Hold:
    """A worker's first plan waits for merge round ``round`` (or ``until``, monotonic)."""

    key: tuple[str, str]
    round: int
    until: float


def fleet_prior(params: CostParams) -> CostParams:
    """A fit of another worker of the same kind, as a new worker's starting point: its curve, but no
    evidence (the policy prices its verify time with a whole RMSE of doubt until this worker's own steps
    say more).

    >>> fleet_prior(CostParams(mem_ms=9.0, compute_evidence=(400.0, 12.0))).compute_evidence
    (0.0, 0.0)
    """
    return replace(params, compute_evidence=tuple(0.0 for _ in params.compute_evidence),
                   live_evidence=tuple(0.0 for _ in params.live_evidence))


class FleetReplica:
    """This replica's part of the fleet.

    Parameters
    ----------
    settings : StateSettings
        The config's ``state:`` section (``backend: redis``).
    controller : Controller
    address : str
        Where workers reach this replica (``host:port``), for the directory.
    policy_source : controller.reload.PolicySource or None
        Accepted reloads are published from it.
    alerting : controller.alerts.alerting.DriftAlerting or None
        Drift alerts shared fleet-wide (None: the monitor is off).
    hold_s : float or None
        Longest wait of a first plan for the fleet's statistics (default
        ``2 × merge_interval_s``).
    """

    def __init__(self, settings: StateSettings, controller: Controller, *, address: str = "",
                 policy_source: Any = None, alerting: Any = None, hold_s: float | None = None) -> None:
        self.settings = settings
        self.ctl = controller
        self.store = FleetStore(settings.url, fleet=settings.fleet, replica_id=settings.replica_id,
                                op_timeout_s=settings.op_timeout_s, connect_timeout_s=settings.connect_timeout_s)
        self.replica_id = self.store.replica_id
        # Open fleet ticks are rolled by the controller's clock; a fleet view not refreshed for three merge
        # rounds (at least 3 s) gives way to the local model (acceptance_sync, Faults).
        shared = dict(stratum_ttl_s=settings.stratum_ttl_s, seed_grace_s=settings.seed_grace_s,
                      model_clock=controller.clock, view_ttl_s=max(3.0, 3.0 * settings.merge_interval_s))
        self.sync = AcceptanceSync(controller.acceptance, self.store, **shared)
        self.sync_typical = AcceptanceSync(controller.acceptance_typical, self.store, namespace="acct", **shared)
        self.costs = CostPriorBook(self.store)
        self.directory = Directory(self.store, address, ttl_s=settings.replica_ttl_s)
        self.bus = PolicyBus(self.store, self._from_bus_thread, adopt_current=False)
        self.hold_s = hold_s if hold_s is not None else 2.0 * settings.merge_interval_s
        self.counts: Counter = Counter()
        self._holds: dict[str, _Hold] = {}
        # worker -> (kind missed at registration, heartbeats left to wait for the fleet's fit)
        self._cost_waiting: dict[str, tuple[tuple[str, int, str], int]] = {}
        self._rounds_started = 0
        self._rounds_done = 0  # the last round (strict model) that completed
        self._heartbeats = 0
        self._last_reconcile = float("-inf")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []
        self._closed = False
        self._merge = _Periodic(settings.merge_interval_s, self._merge_round, "acceptance")
        self._heartbeat = _Periodic(settings.heartbeat_interval_s, self._heartbeat_round, "heartbeat")
        self.alerts: FleetAlerts | None = None
        self.drift: FleetDriftMonitor | None = None  # one drift monitor per drafter version, fleet-wide
        if alerting is not None:
            self.alerts = FleetAlerts(self.store, alerting, lease_ttl_s=settings.lease_ttl_s, wake=self._wake_alerts)
            if settings.drift_monitor == "fleet":
                self.drift = FleetDriftMonitor(
                    self.store, alerting, self.alerts, lease_ttl_s=settings.lease_ttl_s,
                    checkpoint_interval_s=settings.drift_checkpoint_interval_s, maxlen=settings.drift_stream_maxlen,
                    max_buffered=5 * alerting.feed.max_buffered, checkpoint_ttl_s=settings.stratum_ttl_s)
                self._drift_round = _Periodic(settings.drift_interval_s, self.drift.run_round, "drift monitors")
            self._leases = _Periodic(settings.lease_ttl_s / 3.0, self._lease_round, "leases")
            self._alert_flush = _Periodic(settings.heartbeat_interval_s, self._alert_flush_round, "alert log")
        controller.on_hello.append(self._on_hello)
        controller.on_disconnect.append(self._on_disconnect)
        controller.cost_prior = self._cost_prior
        controller.first_plan_hold = self._holds_first_plan
        if policy_source is not None:
            policy_source.on_reload.append(self._publish_policy)
        if self.alerts is not None:
            self.alerts.attach()
        if self.drift is not None:
            self.drift.attach()

    # ------------------------------------------------------------ lifecycle
    def start(self) -> "FleetReplica":
        """Start the loops and the subscriber threads (on the controller's loop; nothing here waits on Redis)."""
        self._loop = asyncio.get_running_loop()
        self.bus.start()
        loops = [self._merge, self._heartbeat]
        if self.alerts is not None:
            self.alerts.start(self._loop)
            loops += [self._leases, self._alert_flush]
        if self.drift is not None:
            loops.append(self._drift_round)
        self._tasks = [asyncio.create_task(p.run(), name=f"fleet-{p.name}") for p in loops]
        self._heartbeat.wake()  # join the directory and read the fleet's alerts now, not in a heartbeat
        log.info("replica %s sharing state in %s (fleet %s)", self.replica_id, self.store.health()["url"],
                 self.settings.fleet)
        return self

    async def quiesce(self) -> None:
        """Stop the loops and the subscribers (before the alert store closes: nothing is mirrored after)."""
        self._closed = True
        if self.alerts is not None:
            self.alerts.closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        stoppers = [self.bus.stop] + ([self.alerts.stop] if self.alerts is not None else [])
        await asyncio.gather(*(asyncio.to_thread(stop) for stop in stoppers))

    async def close(self, timeout_s: float = 2.0) -> None:
        """Last merge and alert flush, leave the directory, close the store (each bounded: Redis may be gone)."""
        if not self._closed:
            await self.quiesce()
        if not await self._sync_round(self.sync, None, timeout_s):
            log.warning("replica %s: last merge failed (%s); its unmerged evidence is lost to the fleet",
                        self.replica_id, self.store.health()["last_error"])
        if self.drift is not None:  # what the alerting's last drain forwarded, a last checkpoint, the leases
            await self.drift.close(timeout_s)
        steps = ([self.alerts.log.flush] if self.alerts is not None else []) + [self.directory.leave]
        for step in steps:
            try:
                await self.store.offload(step, timeout_s)
            except StoreUnavailable as err:
                log.warning("replica %s: %s", self.replica_id, err)
        self.store.close()

    def tick(self, tick_s: float) -> None:
        """Housekeeping tick (on the loop): install fleet totals a merge round left, within a small budget."""
        budget = tick_s * 0.1
        self.sync.drain(budget)
        self.sync_typical.drain(budget)

    # ------------------------------------------------------------ acceptance
    async def _sync_round(self, sync: AcceptanceSync, budget_s: float | None, timeout_s: float | None = None) -> bool:
        """One merge round; True when it completed (Redis answered, even "nothing stored")."""
        job = sync.prepare()
        try:
            reply = await self.store.run("acceptance_merge", lambda client: sync.exchange(job, client), timeout_s)
        except StoreUnavailable as err:
            sync.failed(err)
            return False
        sync.install(reply, budget_s)
        return True

    async def _merge_round(self) -> None:
        # Evidence joins the pending delta at a model tick; ingest ticks, but a replica whose workers
        # fell silent would otherwise keep their last second of evidence from the fleet.
        self.ctl.tick_acceptance(self.ctl.clock())
        self._rounds_started += 1
        number = self._rounds_started
        # A worker waiting for its first plan wants every stratum installed now, not over the next ticks.
        budget = None if self._holds else self.ctl.config.plan.tick_s * 0.1
        if await self._sync_round(self.sync, budget):
            self._rounds_done = number
        if self.ctl.acceptance_typical.items():  # nothing to share before a relaxed class drafts
            await self._sync_round(self.sync_typical, budget)

    def _holds_first_plan(self, state: WorkerState) -> bool:
        """``Controller.first_plan_hold``: True while the worker's first plan waits for a merge round."""
        hold = self._holds.get(state.worker_id)
        if hold is None:
            return False
        if self._rounds_done >= hold.round:
            self.counts["first_plans_from_fleet"] += 1
        elif time.monotonic() >= hold.until:
            self.counts["first_plans_after_timeout"] += 1
        else:
            return True
        del self._holds[state.worker_id]
        return False

    async def wait_first_plan(self, state: WorkerState) -> None:
        """Await the end of ``state``'s first-plan hold (a Decide; the loop keeps running)."""
        while self._holds_first_plan(state):
            await asyncio.sleep(0.01)

    # -------------------------------------------------------------- workers
    def _on_hello(self, state: WorkerState) -> None:
        self.directory.assign(state.worker_id)
        if state.plans.current is not None or state.worker_id in self._holds:
            return
        key = state.drafter_key
        if self.sync.knows(key):
            return  # this replica already plans from the fleet's totals for that drafter version
        # Hold the posteriors now, so that the next round reads the version's fleet totals.
        self.ctl.acceptance.strata(key, state.limits.max_depth, state.limits.max_width, self.ctl.clock())
        self._holds[state.worker_id] = _Hold(key, self._rounds_started + 1, time.monotonic() + self.hold_s)
        self.counts["first_plans_held"] += 1
        self._merge.wake()

    def _on_disconnect(self, state: WorkerState) -> None:
        self.directory.release(state.worker_id)
        self._holds.pop(state.worker_id, None)
        self._cost_waiting.pop(state.worker_id, None)

    def _cost_prior(self, hello: worker_pb2.Hello) -> CostParams | None:
        """``Controller.cost_prior``: the fleet's fit for the worker's kind, if this replica knows it yet."""
        hw = hello.hardware
        found = self.costs.lookup(hw.accelerator, hw.count, hello.model)
        if found is None:
            if hw.accelerator and hello.model:
                self._cost_waiting[hello.worker_id] = ((hw.accelerator, hw.count, hello.model), COST_WAIT_HEARTBEATS)
                self._heartbeat.wake()
            return None
        self.counts["cost_priors_used"] += 1
        return fleet_prior(found)

    def _late_cost_priors(self) -> None:
        """Workers that registered before their kind's fit was fetched start from it now (the prior is
        the fit's ridge target: the worker's own steps still decide once they say more)."""
        for worker_id, (kind, left) in list(self._cost_waiting.items()):
            state = self.ctl.workers.get(worker_id)
            if state is None or left <= 0:  # gone, or nobody fitted its kind yet: its own steps will
                del self._cost_waiting[worker_id]
                continue
            found = self.costs.lookup(*kind)
            if found is None:
                self._cost_waiting[worker_id] = (kind, left - 1)
                continue
            del self._cost_waiting[worker_id]
            prior = fleet_prior(found)
            state.cost.prior = prior
            if state.cost.samples == 0:
                state.cost.params = prior
            self.counts["cost_priors_late"] += 1

    def _publish_costs(self) -> None:
        for state in self.ctl.workers.values():
            if state.session.connected:
                hw = state.hello.hardware
                self.costs.publish(hw.accelerator, hw.count, state.hello.model, state.cost.params,
                                   state.cost.samples)

    async def _heartbeat_round(self) -> None:
        self._heartbeats += 1
        if self._heartbeats % COST_PUBLISH_EVERY == 0:
            self._publish_costs()
        for step in (self.directory.cycle, self.bus.flush, self.costs.flush):
            try:
                await self.store.offload(step)
            except StoreUnavailable:
                pass
        self._late_cost_priors()
        if self.alerts is not None and time.monotonic() - self._last_reconcile >= RECONCILE_ALERTS_S:
            history = await self.store.offload(self.alerts.read_open)
            self._last_reconcile = time.monotonic()
            self.alerts.reconcile(history)

    # --------------------------------------------------------------- policy
    def _publish_policy(self, text: str, source: str) -> None:
        """``PolicySource.on_reload``: an accepted local reload goes to every replica (never waits)."""
        self.counts["policies_published"] += 1
        future = self.bus.publish(text, source)
        future.add_done_callback(self._published)

    def _published(self, future) -> None:
        err = future.exception()
        if err is not None:  # the next heartbeat's bus.flush sends it
            log.warning("policy reload not published yet (%s); retried with the next heartbeat", err)

    def _from_bus_thread(self, text: str, version: int, source: str) -> None:
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._apply_policy, text, version, source)
            except RuntimeError:  # the loop closed meanwhile (shutdown)
                pass

    def _apply_policy(self, text: str, version: int, source: str) -> None:
        if self._closed:
            return
        if apply_policy_text(self.ctl, text, f"fleet policy v{version} from {source}"):
            self.counts["policies_applied"] += 1
        else:
            self.counts["policies_refused"] += 1

    # --------------------------------------------------------------- alerts
    def _wake_alerts(self) -> None:
        if self.alerts is not None and not self._closed:
            self._leases.wake()
            self._alert_flush.wake()

    async def _lease_round(self) -> None:
        try:
            await self.store.offload(self.alerts.cycle_leases)
        except StoreUnavailable:
            self.alerts.leases.counts["cycle_failures"] += 1
        self.alerts.after_lease_cycle()

    async def _alert_flush_round(self) -> None:
        await self.store.offload(self.alerts.flush)

    # --------------------------------------------------------------- status
    def status(self) -> dict[str, Any]:
        """Health of the store and of sharing, for GetStatus and /metrics (on the loop)."""
        health = self.store.health()
        sync = self.sync.status()
        view = self._view()
        counts = sync["counts"]
        return {
            "replica_id": self.replica_id, "health": health, "sync": sync,
            "sync_typical": self.sync_typical.status(),
            "failed_calls": sum(health["failures"].values()),
            "failed_merges": counts.get("merge_failures", 0),
            "merges": counts.get("merges", 0),
            "live_replicas": len(view.live) if view is not None else 0,
            "leases_held": len(self.alerts.leases.stats()["held"]) if self.alerts is not None else 0,
            "alert_events_queued": self.alerts.log.queued() if self.alerts is not None else 0,
            "counts": dict(self.counts), "costs": self.costs.stats(),
            "alerts": self.alerts.stats() if self.alerts is not None else None,
            "drift": self.drift.stats() if self.drift is not None else None,
            "bus": {"counts": dict(self.bus.counts), "applied_version": self.bus.applied_version,
                    "subscribed": self.bus.subscribed.is_set()},
        }

    def _view(self) -> FleetView | None:
        """The directory as last read; one older than a heartbeat is read again at the next (asking for it is
        what keeps it fresh: a replica nobody asks does not read the whole directory every heartbeat)."""
        return self.directory.view(max_age_s=self.settings.heartbeat_interval_s)

    def annotate(self, out: controller_pb2.GetStatusResponse, worker_id: str = "") -> None:
        """Fill GetStatus's fleet fields: this replica, the directory's replicas and placements, the
        store's health. The directory is the last one read (a few seconds old at most)."""
        status = self.status()
        health, sync = status["health"], status["sync"]
        view = self._view()
        out.replica_id = self.replica_id
        since = sync["since_merge_s"]
        out.fleet_store.CopyFrom(controller_pb2.FleetStoreHealth(
            backend="redis", url=health["url"], fleet=health["fleet"], up=bool(health["up"]),
            outages=health["outages"], down_for_s=health["down_for_s"], last_error=health["last_error"],
            failed_calls=status["failed_calls"], failed_merges=status["failed_merges"],
            unmerged_evidence=sync["unmerged_evidence"], since_merge_s=-1.0 if since is None else since,
            merges=status["merges"], live_replicas=status["live_replicas"], leases_held=status["leases_held"],
            alert_events_queued=status["alert_events_queued"],
            first_plans_held=status["counts"].get("first_plans_held", 0),
            drift_evidence_dropped=status["drift"]["outbox"]["counts"].get("dropped", 0) if status["drift"] else 0))
        for d in status["drift"]["versions"] if status["drift"] else ():
            out.drift_monitors.add(drafter_kind=d["drafter_kind"], drafter_version=d["drafter_version"],
                                   owner_replica_id=d["owner"], owned_here=d["owned_here"],
                                   evidence_lag=d["evidence_lag"], evidence_queued=d["evidence_queued"],
                                   entries_lost=d["entries_lost"], checkpoint_age_s=d["checkpoint_age_s"])
        live = view.live if view is not None else frozenset()
        if view is not None:
            for replica, info in sorted(view.info.items()):
                out.replicas.add(replica_id=replica, address=str(info.get("address", "")), live=replica in live,
                                 workers=int(info.get("workers", 0)), started_at=float(info.get("started_at", 0.0)))
            for worker, (replica, since_s) in sorted(view.workers.items()):
                if not worker_id or worker == worker_id:
                    out.placements.add(worker_id=worker, replica_id=replica, replica_live=replica in live,
                                       since=since_s)
        for ws in out.workers:
            entry = view.workers.get(ws.hello.worker_id) if view is not None else None
            if entry is not None:
                ws.replica_id, ws.replica_live = entry[0], entry[0] in live
            elif ws.connected:  # connected here since the last directory read
                ws.replica_id, ws.replica_live = self.replica_id, True
