"""Placement and failover of agents over several controller replicas (issue #30).

Unit: the rendezvous hash is the documented one, spreads workers evenly and
moves only a removed replica's workers; names resolve to replica sets;
placement's failover, backoff and return rules; what the agent does with
steps a failed replica never confirmed.

With real ``specctl serve`` processes: ``kill -9`` of a replica under load
moves its workers, and only them, to their next replica, each ACKing a plan
there within the failover goal, none deciding on the fallback meanwhile, and
the new replica reads exactly the steps the dead one had not confirmed; when
the replica comes back they return to it once it has been healthy for
``return_after_s``. A hung replica (SIGSTOP) is left after
``response_deadline_s``. The same kill with the replicas sharing state in a
real ``redis-server``.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import random
import socket
import time
from pathlib import Path

import grpc
import pytest

from bench.fleet import FleetLoad, ReplicaProcess, Replicas
from policies.table import Decision
from protos.speculation.v1 import plan_pb2, worker_pb2
from specctl.cli import build_parser
from specctl.worker_cli import controller_targets
from tests.support import make_hello, wait_for
from worker.sdk.agent import AgentOptions, SpeculationAgent
from worker.sdk.placement import Endpoint, Placement, Targets, rendezvous_order, rendezvous_weight
from worker.sdk.telemetry import RequestTelemetry, StepTelemetry

FAILOVER_GOAL_S = 5.0


# ------------------------------------------------------------------ the hash
def test_the_weight_is_the_top_64_bits_of_sha256_of_address_nul_worker_id():
    # Fixed vectors, so an implementation in another language can check itself against them:
    # printf '10.0.0.1:50051\0gpu-17' | sha256sum | cut -c1-16
    assert rendezvous_weight("10.0.0.1:50051", "gpu-17") == 0x68BD6DF4FE5F88DA
    assert rendezvous_weight("ctl-a:50051", "w-000") == 0x9FBD514AA3911B97
    for address, worker in (("a:1", "w"), ("[fd00::5]:50051", "gpu-éß"), ("", "")):
        digest = hashlib.sha256(address.encode() + b"\0" + worker.encode()).digest()
        assert rendezvous_weight(address, worker) == int.from_bytes(digest[:8], "big")
    assert rendezvous_order(["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"], "gpu-17") == \
        ["10.0.0.2:50051", "10.0.0.1:50051", "10.0.0.3:50051"]


def _firsts(addresses: list[str], workers: list[str]) -> dict[str, str]:
    return {w: rendezvous_order(addresses, w)[0] for w in workers}


def test_rendezvous_spreads_workers_evenly():
    addresses = [f"10.0.0.{i}:50051" for i in range(1, 6)]
    workers = [f"gpu-{i:05d}" for i in range(10_000)]
    counts = collections.Counter(_firsts(addresses, workers).values())
    # Binomial(10000, 1/5): sd 40. Five sd either side.
    assert set(counts) == set(addresses)
    assert all(abs(n - 2000) <= 200 for n in counts.values()), counts


def test_removing_a_replica_moves_only_its_workers_and_spreads_them():
    addresses = [f"ctl-{c}:50051" for c in "abcd"]
    workers = [f"gpu-{i:05d}" for i in range(8_000)]
    before = _firsts(addresses, workers)
    survivors = [a for a in addresses if a != "ctl-b:50051"]
    after = _firsts(survivors, workers)
    moved = [w for w in workers if before[w] != after[w]]
    assert all(before[w] == "ctl-b:50051" for w in moved)  # nobody else moves
    assert len(moved) == sum(1 for w in workers if before[w] == "ctl-b:50051")
    # Each goes to its own second choice: spread over the three others (~667 each, sd ~21).
    landed = collections.Counter(after[w] for w in moved)
    assert all(abs(n - len(moved) / 3) <= 130 for n in landed.values()), landed
    assert all(after[w] == rendezvous_order(addresses, w)[1] for w in moved)


def test_adding_a_replica_takes_a_fair_share_all_to_itself():
    addresses = [f"ctl-{c}:50051" for c in "abc"]
    workers = [f"gpu-{i:05d}" for i in range(8_000)]
    before = _firsts(addresses, workers)
    after = _firsts(addresses + ["ctl-d:50051"], workers)
    moved = [w for w in workers if before[w] != after[w]]
    assert all(after[w] == "ctl-d:50051" for w in moved)
    assert abs(len(moved) - 2000) <= 200


# ----------------------------------------------------------------- targets
def fake_getaddrinfo(table: dict[str, list[str]]):
    def getaddrinfo(host, port, type=0, **_):
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (ip, port, 0, 0) if ":" in ip else (ip, port)) for ip in table[host]]

    return getaddrinfo


def test_a_name_that_resolves_to_several_addresses_is_several_replicas():
    table = {"ctl.prod": ["10.0.0.7", "10.0.0.5", "10.0.0.7", "10.0.0.6"], "one": ["10.0.1.1"],
             "dual": ["127.0.0.1", "::1"], "v6": ["fd00::1", "fd00::2"]}
    targets = Targets("dns:///ctl.prod:50051", getaddrinfo=fake_getaddrinfo(table))
    assert targets.has_names
    assert targets.resolve() == [Endpoint(f"10.0.0.{i}:50051", "ctl.prod") for i in (7, 5, 6)]
    # One address: left to gRPC as written. A dual-stack host is one replica. IPv6 in brackets.
    assert Targets("one:7", getaddrinfo=fake_getaddrinfo(table)).resolve() == [Endpoint("one:7")]
    assert Targets("dual:7", getaddrinfo=fake_getaddrinfo(table)).resolve() == [Endpoint("dual:7")]
    assert Targets("v6:7", getaddrinfo=fake_getaddrinfo(table)).resolve() == \
        [Endpoint("[fd00::1]:7", "v6"), Endpoint("[fd00::2]:7", "v6")]
    # A list: each entry as given; a name that does not resolve stays (gRPC retries it), counted.
    mixed = Targets(["10.9.9.9:1", "gone:2", "unix:/run/ctl.sock"], getaddrinfo=fake_getaddrinfo(table))
    assert mixed.resolve() == [Endpoint("10.9.9.9:1"), Endpoint("gone:2"), Endpoint("unix:/run/ctl.sock")]
    assert mixed.failures == 1
    assert not Targets("10.0.0.1:1,[::1]:2").has_names  # literals are never resolved


@pytest.mark.parametrize("spec, message", [
    ("", "no controller address"), (" , ", "no controller address"),
    ("dns://8.8.8.8/ctl:50051", "system resolver"), ("[::1:50051", "IPv6"), ("ctl:http", "not a number"),
    ("ctl:70000", "out of range"), (":50051", "names no host"),
])
def test_malformed_targets_are_refused_naming_the_entry(spec, message):
    with pytest.raises(ValueError, match=message):
        Targets(spec)


def test_worker_cli_takes_several_controllers():
    args = build_parser().parse_args(["worker", "--controller", "ctl-a:50051", "--controller", "ctl-b:50051,ctl-c:1"])
    assert controller_targets(args) == "ctl-a:50051,ctl-b:50051,ctl-c:1"
    assert controller_targets(build_parser().parse_args(["worker"])) is None
    with pytest.raises(ValueError, match="out of range"):
        controller_targets(build_parser().parse_args(["worker", "--controller", "ctl:0"]))


# --------------------------------------------------------------- placement
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_placement_fails_over_in_rendezvous_order_backs_off_and_returns_after_probes():
    clock = Clock()
    addresses = ["a:1", "b:1", "c:1"]
    order = rendezvous_order(addresses, "w7")
    p = Placement(Targets(addresses), "w7", backoff_initial_s=0.1, backoff_max_s=2.0, return_after_s=10.0,
                  clock=clock, rng=random.Random(1))
    first, second, third = (Endpoint(a) for a in order)
    assert p.next() == (first, 0.0)
    p.failed(first)
    assert p.next() == (second, 0.0)  # at once: another replica works
    p.failed(second)
    assert p.next() == (third, 0.0)
    p.failed(third, up_for_s=0.5)
    # All failed: the one whose retry comes first, after a jittered delay within its cap.
    endpoint, wait = p.next()
    assert endpoint in (first, second, third) and 0.0 <= wait <= 0.1
    for _ in range(6):
        p.failed(first)
    assert p.health(first).failures == 7 and p.health(first).retry_at - clock.now <= 2.0  # capped at backoff_max
    p.failed(first, up_for_s=5.0)  # a session that had been healthy: a new incident, the count starts over
    assert p.health(first).failures == 1

    # On `third` with the two better ones failed: probes re-admit one once it served for return_after_s.
    assert p.ahead_of(third) == [first, second]
    p.probed(first, True)
    clock.now += 6.0
    p.probed(second, True)
    assert p.return_target(third) is None
    clock.now += 3.0
    p.probed(first, False)  # a failed probe starts its run over
    clock.now += 2.0
    p.probed(first, True)
    assert p.return_target(third) is None  # first: 0 s of serving; second: 5 s
    clock.now += 5.0
    assert p.return_target(third) == second  # 10 s of serving
    assert p.health(second).failures == 0 and p.next() == (second, 0.0)
    clock.now += 5.0
    assert p.return_target(second) == first

    # A new replica set keeps the health of the replicas still in it.
    p.failed(second)
    assert p.update([Endpoint(a) for a in order[1:]] + [Endpoint("d:1")])
    assert p.health(second).failures == 1 and first.address not in [e.address for e in p.order]
    assert not p.update(list(p.order))


# ------------------------------------------------------------ the agent alone
def plan(version: int) -> plan_pb2.Plan:
    cell = plan_pb2.Decision(depth=3, width=1, max_nodes=3)
    return plan_pb2.Plan(version=version, nonce=f"n{version}", batch_size_edges=[1], context_len_edges=[0],
                         table=[cell])


def test_the_fallback_is_counted_before_the_first_plan_and_never_after():
    agent = SpeculationAgent(make_hello("w"), "a:1,b:1", AgentOptions(fallback=Decision.chain(2)))
    assert [agent.decide(f"r{i}", 100, 1) for i in range(3)] == [Decision.chain(2)] * 3
    assert agent.stats.fallback_decisions == 3
    agent._apply_plan(plan(4))
    agent.roll_drafter(worker_pb2.Drafter(kind=worker_pb2.DRAFTER_KIND_EAGLE, version="v2", max_depth=2,
                                          max_width=1, max_tree_nodes=2))  # clamped, still the plan
    assert agent.decide("r", 100, 1) == Decision.chain(2) and agent.stats.fallback_decisions == 3


def test_unconfirmed_steps_follow_the_worker_to_another_replica_but_not_back_to_the_same():
    agent = SpeculationAgent(make_hello("w"), ["a:1", "b:1"], AgentOptions(queue_size=3))
    a, b = Endpoint("a:1"), Endpoint("b:1")

    def written(ids):
        for i in ids:
            agent._unconfirmed.append(i)
            agent._resendable.append(worker_pb2.StepReport(step_id=i))

    written(range(1, 6))  # 5 written, the newest 3 kept as protos
    agent._confirm(1)
    agent._settle(a, b, "failed")
    assert [s.step_id for s in agent._carry] == [3, 4, 5] and agent.stats.steps_unconfirmed == 1  # step 2: beyond
    outbox: asyncio.Queue = asyncio.Queue()
    agent._arrived(b, outbox)
    [msg] = [outbox.get_nowait() for _ in range(outbox.qsize())]
    assert [s.step_id for s in msg.reports.steps] == [3, 4, 5] and agent.stats.steps_resent == 3
    (move,) = agent.stats.moves
    assert (move.source, move.target, move.reason, move.resent, move.confirmed_through) == ("a:1", "b:1",
                                                                                            "failover", 3, 1)
    written([6])
    agent._settle(b, b, "expired")  # staying: counted, not carried (b may have read it)
    assert agent._carry == [] and agent.stats.steps_unconfirmed == 2
    written([7, 8])
    agent._settle(b, a, "failed")
    agent._arrived(a, asyncio.Queue())  # back on a, which never had 7 and 8: they go there
    assert agent.stats.steps_resent == 5 and len(agent.stats.moves) == 2 and agent.stats.failovers == 2
    written([9])
    agent._settle(a, b, "failed")
    agent._arrived(a, asyncio.Queue())  # the dial of b failed and we are back on a, which may have read 9
    assert agent.stats.steps_unconfirmed == 3 and agent.stats.steps_resent == 5 and len(agent.stats.moves) == 2
    assert agent.backlog() == 0


async def test_a_replica_dialled_by_a_resolved_ip_is_checked_against_the_name(tmp_path: Path) -> None:
    """TLS with a certificate for the name only (no IP in it): the agent dials the IPs the name
    resolved to and checks the name. Of the two addresses only 127.0.0.1 serves."""
    from cryptography import x509

    from controller.config import ServerConfig
    from controller.server import start_server
    from tests.support import free_port
    from tests.test_auth import _issue, _make_ca

    ca = _make_ca(tmp_path, "ca")
    _issue(tmp_path, "ctl", ca, [x509.DNSName("ctl.prod.test")])
    port = free_port()
    running = await start_server(ServerConfig.model_validate({
        "listen": f"127.0.0.1:{port}", "store": {"path": ""},
        "security": {"tls": {"cert_file": str(tmp_path / "ctl.pem"), "key_file": str(tmp_path / "ctl.key")}}}))
    targets = Targets(f"ctl.prod.test:{port}",
                      getaddrinfo=fake_getaddrinfo({"ctl.prod.test": ["127.0.0.1", "127.0.0.3"]}))
    agent = SpeculationAgent(make_hello("w-tls"), targets, AgentOptions(backoff_max_s=0.2),
                             channel_credentials=grpc.ssl_channel_credentials((tmp_path / "ca.pem").read_bytes()))
    task = asyncio.create_task(agent.run())
    try:
        await wait_for(lambda: agent.stats.connected, 15)
        assert agent.stats.replica == f"127.0.0.1:{port}"
        assert [e.authority for e in agent.placement.order] == ["ctl.prod.test"] * 2
        agent.observe(StepTelemetry(1, time.time(), 1, 0.5, 10.0, [RequestTelemetry("r", 100, 2, 1, 2, 1)]))
        await wait_for(lambda: agent.stats.steps_confirmed == 1, 15)
    finally:
        agent.stop()
        await task
        await running.stop(0)


# ------------------------------------------------------------ real replicas
def agent_options(**kw):
    def make(on_plan):
        return AgentOptions(fallback=Decision.chain(2), on_plan=on_plan, flush_interval_s=0.05,
                            probe_interval_s=0.5, **kw)

    return make


async def start_replicas(folder: Path, n: int, config: dict | None = None) -> list[ReplicaProcess]:
    procs = [ReplicaProcess(folder, f"r{i}", {"drift": {"enabled": False}, **(config or {})}) for i in range(n)]
    try:
        await asyncio.gather(*(asyncio.to_thread(p.start) for p in procs))
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs


async def expect(predicate, timeout_s: float, agents: dict[str, SpeculationAgent], workers) -> None:
    """``wait_for`` that names, when it fails, where each of ``workers`` is and its last moves and error."""
    try:
        await wait_for(predicate, timeout_s)
    except AssertionError:
        raise AssertionError("; ".join(
            f"{w}: on {agents[w].stats.replica} connected={agents[w].stats.connected} moves={list(agents[w].stats.moves)} "
            f"error={agents[w].stats.last_error!r}" for w in workers)) from None


def arrived(agent: SpeculationAgent, moves_before: int, reason: str) -> bool:
    moves = agent.stats.moves
    return len(moves) > moves_before and moves[-1].reason == reason and moves[-1].first_plan_at > 0


async def check_nothing_acknowledged_lost(load: FleetLoad, view: Replicas, workers: list[str]) -> None:
    """With the load paused and every receipt in: the replica each worker moved to read exactly
    the steps the one it left had not confirmed (none lost, none twice), and none was refused."""
    load.paused = True
    assert await load.settle(15.0)
    for w in workers:
        move = load.agents[w].stats.moves[-1]
        [ws] = (await view.status(move.target, w)).workers
        assert move.confirmed_through > 0  # the old replica had confirmed some: the split is real
        assert ws.steps_received == load.observed(w) - move.confirmed_through, w
        assert ws.steps_ingested == ws.steps_received  # no stale or malformed step among them
        assert load.agents[w].stats.steps_dropped_total == 0
    load.paused = False


async def test_kill_9_moves_a_replicas_workers_and_they_return_when_it_is_back(tmp_path: Path) -> None:
    procs = await start_replicas(tmp_path, 3)
    addresses = [p.address for p in procs]
    load = FleetLoad(addresses, 12, steps_per_s=20, requests=4, options=agent_options(return_after_s=3.0))
    view = Replicas(addresses)
    agents = load.agents
    try:
        await load.start()
        await wait_for(lambda: all(a.plan_version > 0 and a.stats.connected for a in agents.values()), 30)
        for w, a in agents.items():  # every worker on its first rendezvous choice
            assert a.stats.replica == rendezvous_order(addresses, w)[0]
        victim = max(procs, key=lambda p: len(load.on(p.address)))
        moved = load.on(victim.address)
        survivors = [a for a in addresses if a != victim.address]
        assert len(moved) >= 2
        await wait_for(lambda: all(agents[w].stats.receipts > 0 for w in moved), 10)
        fallback = {w: a.stats.fallback_decisions for w, a in agents.items()}

        t_kill = time.time()
        victim.kill()
        await expect(lambda: all(arrived(agents[w], 0, "failover") for w in moved), 15, agents, moved)
        for w in moved:
            move = agents[w].stats.moves[-1]
            assert (move.source, move.target) == (victim.address, rendezvous_order(survivors, w)[0])
            assert move.first_plan_at - t_kill <= FAILOVER_GOAL_S, (w, move)
            assert agents[w].stats.replica == move.target and agents[w].stats.failovers == 1
        for w, a in agents.items():
            assert a.stats.fallback_decisions == fallback[w], w  # on its last plan throughout
            if w not in moved:
                assert not a.stats.moves and a.stats.replica == rendezvous_order(addresses, w)[0]
        await check_nothing_acknowledged_lost(load, view, moved)
        assert all(agents[w].stats.steps_unconfirmed == 0 for w in moved)  # carried, not written off

        # ---- The replica comes back (empty) on its port: its workers return once it served return_after_s.
        t_back = time.time()
        await asyncio.to_thread(victim.start)
        await expect(lambda: all(arrived(agents[w], 1, "rebalance") for w in moved), 20, agents, moved)
        for w in moved:
            move = agents[w].stats.moves[-1]
            assert move.target == victim.address and move.source in survivors
            assert move.left_at - t_back >= 3.0  # not before it had been healthy for return_after_s
            assert agents[w].stats.rebalances == 1
        for w, a in agents.items():
            assert a.stats.fallback_decisions == fallback[w]
            assert len(a.stats.moves) == (2 if w in moved else 0)
        await check_nothing_acknowledged_lost(load, view, moved)
    finally:
        await load.stop()
        await view.close()
        for p in procs:
            p.stop()


async def test_a_hung_replica_is_left_after_the_response_deadline(tmp_path: Path) -> None:
    procs = await start_replicas(tmp_path, 2, {"receipt_interval_s": 0.2})
    addresses = [p.address for p in procs]
    load = FleetLoad(addresses, 6, steps_per_s=20, requests=4,
                     options=agent_options(response_deadline_s=1.5, return_after_s=600.0))
    agents = load.agents
    try:
        await load.start()
        await wait_for(lambda: all(a.plan_version > 0 and a.stats.connected for a in agents.values()), 30)
        victim = max(procs, key=lambda p: len(load.on(p.address)))
        moved = load.on(victim.address)
        fallback = {w: a.stats.fallback_decisions for w, a in agents.items()}
        t_stop = time.time()
        victim.pause()  # SIGSTOP: its sockets stay open, nothing answers
        await expect(lambda: all(arrived(agents[w], 0, "failover") for w in moved), 15, agents, moved)
        for w in moved:
            move = agents[w].stats.moves[-1]
            # Nothing came back for the deadline: at most a receipt interval of it can predate the stop.
            assert 1.5 - 0.2 <= move.left_at - t_stop <= 1.5 + 2.0
            assert move.first_plan_at - t_stop <= 1.5 + FAILOVER_GOAL_S
            assert "sent nothing" in agents[w].stats.last_error
        assert all(a.stats.fallback_decisions == fallback[w] for w, a in agents.items())
    finally:
        await load.stop()
        for p in procs:
            p.stop()  # SIGCONT first


async def test_kill_9_with_the_replicas_sharing_state_in_redis(tmp_path: Path, redis_server) -> None:
    procs = [ReplicaProcess(tmp_path, f"r{i}", {"drift": {"enabled": False},
                                                "state": {"backend": "redis", "url": redis_server.url,
                                                          "fleet": "failover", "replica_id": f"r{i}"}})
             for i in range(2)]
    await asyncio.gather(*(asyncio.to_thread(p.start) for p in procs))
    addresses = [p.address for p in procs]
    load = FleetLoad(addresses, 8, steps_per_s=20, requests=4, options=agent_options(return_after_s=600.0))
    view = Replicas(addresses)
    agents = load.agents
    try:
        await load.start()
        await wait_for(lambda: all(a.plan_version > 0 and a.stats.connected for a in agents.values()), 30)
        victim = max(procs, key=lambda p: len(load.on(p.address)))
        [survivor] = [a for a in addresses if a != victim.address]
        moved = load.on(victim.address)
        await wait_for(lambda: all(agents[w].stats.receipts > 0 for w in moved), 10)
        fallback = {w: a.stats.fallback_decisions for w, a in agents.items()}
        t_kill = time.time()
        victim.kill()
        await expect(lambda: all(arrived(agents[w], 0, "failover") for w in moved), 15, agents, moved)
        for w in moved:
            move = agents[w].stats.moves[-1]
            assert move.target == survivor and move.first_plan_at - t_kill <= FAILOVER_GOAL_S, (w, move)
        assert all(a.stats.fallback_decisions == fallback[w] for w, a in agents.items())
        await check_nothing_acknowledged_lost(load, view, moved)
    finally:
        await load.stop()
        await view.close()
        for p in procs:
            p.stop()


async def test_a_worker_without_a_plan_is_planned_before_the_rotation() -> None:
    """A replica that takes over a dead one's workers plans them first, not in their turn among every
    re-plan: with a policy budget that allows one worker per tick, a newcomer still gets its first
    plan on the next tick, wherever the round-robin stands."""
    from controller.config import PlanSettings, ServerConfig
    from controller.core.controller import Controller
    from controller.service import SpeculationControllerServicer, Stream
    from policies.presets import load_preset
    from protos.speculation.v1 import worker_pb2
    from tests.support import SyntheticWorker, make_hello
    from worker.sdk.agent import step_to_proto

    synthetic = SyntheticWorker(lambda ctx: 0.7, seed=1)

    def report(state) -> None:  # the worker streams a step: its policy is due
        step = synthetic.step(lambda rid, ctx, b: Decision.off(), 2, 500, prefix=f"{state.worker_id}-")
        assert not controller.ingest(state, worker_pb2.StepReports(steps=[step_to_proto(step)]))

    now = [0.0]
    config = ServerConfig(plan=PlanSettings(steps_before_first_plan=0, recompute_interval_s=0.0,
                                            min_push_interval_s=0.0, hysteresis=0.0))
    controller = Controller(config, load_preset("static"), clock=lambda: now[0])
    servicer = SpeculationControllerServicer(controller)
    for i in range(6):  # workers this replica already serves, each with its plan
        state = controller.hello(make_hello(f"old-{i}"))
        servicer.streams[state.worker_id] = Stream(state, 64)
        report(state)
    for _ in range(6):
        await servicer.push_due_plans(0.0)
    for stream in servicer.streams.values():  # every one of them due again
        report(stream.state)
    assert all(s.state.plans.plan_version > 0 for s in servicer.streams.values())
    servicer._next_stream = 1  # the rotation stands at an old worker
    moved = make_hello("moved-in")
    moved.current_plan_version = 7  # it decoded on another replica's plan v7 until that replica died
    newcomer = controller.hello(moved)
    servicer.streams[newcomer.worker_id] = Stream(newcomer, 64)
    report(newcomer)
    await servicer.push_due_plans(0.0)  # one policy run's worth of budget
    message = servicer.streams["moved-in"].queue.get_nowait()
    assert message.HasField("plan") and message.plan.version == 8  # newer than what it runs
    # Back on the replica that served it before, with a newer plan from elsewhere: planned afresh.
    old = servicer.streams["old-2"].state
    back = make_hello("old-2")
    back.current_plan_version = old.plans.current_version + 5
    controller.hello(back)
    report(old)
    servicer._next_stream = 0
    await servicer.push_due_plans(0.0)
    message = servicer.streams["old-2"].queue.get_nowait()
    while not message.HasField("plan") or message.plan.version <= back.current_plan_version:
        message = servicer.streams["old-2"].queue.get_nowait()
    assert message.plan.version == back.current_plan_version + 1
