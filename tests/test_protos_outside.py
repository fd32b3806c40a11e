"""The protos work outside this repository.

An engine team copies ``protos/`` into its own tree and runs protoc with
``-I protos``; the code it gets must talk to the controller with none of
this project's Python on the path. Reflection answers under v1 (what
current tools ask for) and v1alpha, with the descriptors named as that team
compiled them.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2

from controller.config import PlanSettings, ServerConfig
from controller.server import start_server
from protos.generate import PROTO_DIR
from tests.support import free_port

CLIENT = textwrap.dedent('''
    """A worker written from the protos alone: Hello -> steps -> Plan -> Ack."""
    import sys, time
    import grpc
    try:
        import protos  # this project's package must not be reachable
    except ImportError:
        pass
    else:
        sys.exit("the project's own protos package is importable: " + protos.__file__)
    from speculation.v1 import controller_pb2, controller_pb2_grpc, plan_pb2, worker_pb2

    channel = grpc.insecure_channel(sys.argv[1])
    stub = controller_pb2_grpc.SpeculationControllerStub(channel)
    hello = worker_pb2.Hello(
        worker_id="outsider", engine="outside-engine", model="m", max_batch_size=8,
        drafter=worker_pb2.Drafter(kind=worker_pb2.DRAFTER_KIND_NGRAM, version="v1", max_depth=4, max_width=1,
                                   max_tree_nodes=4))
    outbox = [worker_pb2.WorkerMessage(hello=hello)]
    outbox += [worker_pb2.WorkerMessage(reports=worker_pb2.StepReports(steps=[worker_pb2.StepReport(
        step_id=i, timestamp=time.time(), batch_size=1, draft_ms=0.5, verify_ms=10.0,
        requests=[worker_pb2.RequestStep(request_id="r", context_len=100 + i, depth=2, width=1, nodes=2,
                                         accepted=1)])])) for i in range(1, 21)]
    acked, done = [], []

    def messages():
        yield from outbox
        while not acked:
            time.sleep(0.05)
        yield worker_pb2.WorkerMessage(ack=acked[0])
        while not done:
            time.sleep(0.05)

    responses = stub.Connect(messages(), timeout=30)
    for msg in responses:
        if msg.WhichOneof("payload") == "plan":
            plan = msg.plan
            acked.append(worker_pb2.Ack(version=plan.version, nonce=plan.nonce))
            break
    deadline = time.time() + 10
    while True:  # the stream stays open while the controller reads the Ack
        [w] = stub.GetStatus(controller_pb2.GetStatusRequest(worker_id="outsider")).workers
        if w.acked_plan_version == plan.version:
            break
        assert time.time() < deadline, (w.acked_plan_version, plan.version)
        time.sleep(0.05)
    done.append(True)
    responses.cancel()
    assert plan.version >= 1 and w.plan.version == plan.version and len(w.plan.table) == len(plan.table)
    print("ok", plan.version, worker_pb2.DESCRIPTOR.name, controller_pb2.DESCRIPTOR.dependencies[0].name)
''')


def compile_outside(folder: Path) -> Path:
    """Copy the protos into ``folder/protos`` and compile them from there with
    ``-I protos``, as another project would; return the output folder."""
    tree = folder / "protos" / "speculation" / "v1"
    tree.mkdir(parents=True)
    for proto in PROTO_DIR.glob("*.proto"):
        shutil.copy(proto, tree / proto.name)
    out = folder / "gen"
    out.mkdir()
    protos = sorted(str(p.relative_to(folder)) for p in tree.glob("*.proto"))
    result = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", "protos", "--python_out=gen",
                             "--grpc_python_out=gen", *protos], cwd=folder, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture
async def server():
    running = await start_server(ServerConfig(
        listen=f"127.0.0.1:{free_port()}", policy_poll_interval_s=0.05,
        plan=PlanSettings(recompute_interval_s=0.05, min_push_interval_s=0.05)))
    yield running
    await running.stop(0)


async def test_code_generated_outside_completes_hello_steps_plan_ack(tmp_path: Path, server):
    gen = compile_outside(tmp_path)
    assert (gen / "speculation" / "v1" / "controller_pb2_grpc.py").exists()
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    # -I isolates the client from this checkout (no cwd, no PYTHONPATH, no user site), and the
    # editable install's finder is taken out, so only the venv's packages (grpc, protobuf) and
    # the generated folder remain.
    repo = str(PROTO_DIR.parents[2])
    bootstrap = (
        "import sys, runpy; "
        "sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in type(f).__module__ "
        "and '__editable__' not in getattr(f, '__module__', '')]; "
        f"sys.path[:] = [{str(gen)!r}] + [p for p in sys.path if p not in ('', {repo!r})]; "
        "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    import asyncio
    result = await asyncio.to_thread(subprocess.run, [sys.executable, "-I", "-c", bootstrap, str(script),
                                                      server.address], cwd=tmp_path, capture_output=True,
                                     text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split()[0] == "ok"
    assert result.stdout.split()[2:] == ["speculation/v1/worker.proto", "speculation/v1/worker.proto"]
    assert server.controller.workers["outsider"].plans.acked_version >= 1


async def _reflect(address: str, service: str, request: reflection_pb2.ServerReflectionRequest):
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.stream_stream(f"/{service}/ServerReflectionInfo",
                                     request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                     response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        async for response in call(iter([request])):
            return response


@pytest.mark.parametrize("service", ["grpc.reflection.v1.ServerReflection",
                                     "grpc.reflection.v1alpha.ServerReflection"])
async def test_reflection_v1_and_v1alpha_list_the_service_and_its_files(server, service):
    from google.protobuf import descriptor_pb2

    listed = await _reflect(server.address, service, reflection_pb2.ServerReflectionRequest(list_services=""))
    names = {s.name for s in listed.list_services_response.service}
    assert {"speculation.v1.SpeculationController", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection", "grpc.health.v1.Health"} <= names
    files = await _reflect(server.address, service, reflection_pb2.ServerReflectionRequest(
        file_containing_symbol="speculation.v1.SpeculationController"))
    protos = [descriptor_pb2.FileDescriptorProto.FromString(b)
              for b in files.file_descriptor_response.file_descriptor_proto]
    by_name = {p.name: p for p in protos}
    assert set(by_name["speculation/v1/controller.proto"].dependency) == {"speculation/v1/worker.proto",
                                                                          "speculation/v1/plan.proto"}
    assert by_name["speculation/v1/controller.proto"].options.go_package.endswith(";speculationv1")


def test_protos_carry_language_options() -> None:
    for proto in PROTO_DIR.glob("*.proto"):
        text = proto.read_text()
        for option in ("option go_package", "option java_package", "option csharp_namespace"):
            assert option in text, (proto.name, option)
        assert 'import "protos/' not in text, proto.name
