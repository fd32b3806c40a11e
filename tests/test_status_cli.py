"""`specctl status` as a real process against a real controller with a worker
on it: `--json` prints the GetStatus answer as one JSON document, and the
tables stay readable when piped at 80 columns."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest

from controller.config import ServerConfig, StoreSettings
from controller.server import start_server
from policies.table import Decision
from tests.support import SyntheticWorker, feed, free_port, make_hello, wait_for
from worker.sdk.agent import SpeculationAgent

LOADS = [(1, 500), (4, 500), (2, 3000)]


async def specctl(*args: str, columns: int | None = None) -> tuple[int, str, str]:
    """Run ``specctl`` in a subprocess (piped: not a TTY) without blocking the controller's loop."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    if columns is not None:
        env["COLUMNS"] = str(columns)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "specctl.cli", *args, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode, out.decode(), err.decode()


@pytest.fixture
async def served():
    """A controller with worker w0 on it, past its first fitted plan."""
    running = await start_server(ServerConfig(listen=f"127.0.0.1:{free_port()}", store=StoreSettings(path="")))
    agent = SpeculationAgent(make_hello("w0", max_depth=5, version="heads-a"), running.address).start()
    try:
        worker = SyntheticWorker(lambda ctx: 0.8, seed=3)
        await feed(agent, worker, LOADS, rounds=10, decide=lambda rid, ctx, b: Decision.chain(4))
        await wait_for(lambda: agent.plan_version >= 1)
        yield running
    finally:
        agent.stop()
        await running.stop(0)


async def test_status_json_is_one_document(served) -> None:
    rc, out, err = await specctl("status", "--controller", served.address, "--json")
    assert rc == 0, err
    status = json.loads(out)  # the whole of stdout is one JSON document
    assert status["policy"] == "goodput"
    (w0,) = status["workers"]
    assert w0["hello"]["worker_id"] == "w0" and w0["hello"]["drafter"]["version"] == "heads-a"
    assert w0["connected"] is True
    assert int(w0["steps_ingested"]) == 10 * len(LOADS)  # uint64: a string in proto3 JSON
    assert int(w0["plan_version"]) >= 1 and w0["plan"]["table"]
    assert "rejections" in status  # zero values and empty lists are written, not left out

    rc, out, err = await specctl("status", "--controller", served.address, "--json", "--worker", "nobody")
    assert rc == 0 and json.loads(out)["workers"] == []


async def test_status_json_unreachable_controller_errs_on_stderr() -> None:
    rc, out, err = await specctl("status", "--controller", f"127.0.0.1:{free_port()}", "--json")
    assert rc == 1 and out == ""
    assert "specctl status" in err and "UNAVAILABLE" in err


async def test_status_table_piped_at_80_columns(served) -> None:
    rc, out, err = await specctl("status", "--controller", served.address, columns=80)
    assert rc == 0, err
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80
    # Too wide for 80 columns: each worker becomes a block of `field  value` lines instead of a
    # twelve-column table squeezed until every header and value wraps over several lines.
    for name in ("plan at this context: depth(×width) by batch", "verify ms = max(mem, compute)", "est. speedup"):
        assert sum(name in line for line in lines) == 1, name
    (worker_line,) = [line for line in lines if " worker " in line]
    assert "w0" in worker_line
    assert any("drafter" in line and "eagle heads-a" in line for line in lines)
    # Narrow tables that fit are still tables.
    assert any("reason" in line and "count" in line for line in lines)

    # A wide terminal (or COLUMNS) keeps the one-row-per-worker table (wide enough for a plan of five runs).
    rc, out, err = await specctl("status", "--controller", served.address, columns=320)
    assert rc == 0, err
    header = [line for line in out.splitlines() if "plan at this context" in line]
    assert len(header) == 1 and "est. speedup" in header[0] and "fit rmse ms" in header[0]


def test_status_shows_replicas_and_the_store_only_with_several_replicas() -> None:
    from protos.speculation.v1 import controller_pb2
    from specctl.status import replica_section, status_sections

    one = controller_pb2.GetStatusResponse(policy="goodput")
    assert replica_section(one) is None and len(status_sections(one)) == 3
    fleet = controller_pb2.GetStatusResponse(
        policy="goodput", replica_id="r1",
        replicas=[controller_pb2.ReplicaStatus(replica_id="r1", address="10.0.0.1:50051", live=True, workers=2),
                  controller_pb2.ReplicaStatus(replica_id="r2", address="10.0.0.2:50051", live=False, workers=1)],
        placements=[controller_pb2.WorkerPlacement(worker_id=w, replica_id=r, replica_live=r == "r1")
                    for w, r in (("w1", "r1"), ("w0", "r1"), ("w2", "r2"))],
        fleet_store=controller_pb2.FleetStoreHealth(backend="redis", url="redis://***@h:6379/0", up=False,
                                                    down_for_s=12, last_error="connection refused",
                                                    failed_merges=12, unmerged_evidence=340))
    section = replica_section(fleet)
    assert "answered by r1" in section.title and "DOWN for 12 s" in section.title and "failed merges 12" in section.title
    assert section.rows == [("r1 (this)", "10.0.0.1:50051", "yes", "2", "w0, w1"),
                            ("r2", "10.0.0.2:50051", "NO", "1", "w2")]
    assert section in status_sections(fleet)
