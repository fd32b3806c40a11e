"""Security of the gRPC port: TLS, mutual TLS, per-worker bearer tokens bound
to a worker id, the admin token, and tokens kept out of logs. Every test runs
a real controller on a free loopback port with certificates made here (a
throwaway CA, a server certificate for 127.0.0.1/localhost, client
certificates named after worker ids)."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import ipaddress
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from controller.auth import Authenticator, AuthError, Identity, Role, token_digest
from controller.config import ConfigError, ServerConfig, load_config
from controller.server import start_server
from policies.table import Decision
from protos.speculation.v1 import controller_pb2, controller_pb2_grpc, worker_pb2
from specctl import cli
from specctl.tokens import new_token
from tests.support import SyntheticWorker, free_port, make_hello, wait_for
from worker.sdk.agent import AgentOptions, SpeculationAgent, step_to_proto
from worker.sdk.security import ClientSecurity, add_client_security_args

W1_TOKEN, W2_TOKEN, ADMIN_TOKEN = new_token(), new_token(), new_token()
TOKENS = (W1_TOKEN, W2_TOKEN, ADMIN_TOKEN)
AUTH = {"workers": {"w1": token_digest(W1_TOKEN), "w2": [token_digest(W2_TOKEN)]},
        "admins": {"ops": token_digest(ADMIN_TOKEN)}}
FAST_PLANS = {"recompute_interval_s": 0.05, "min_push_interval_s": 0.05, "hysteresis": 0.0}


# ----------------------------------------------------------------- certificates
@dataclass(frozen=True)
class Pki:
    dir: Path

    def path(self, name: str) -> str:
        return str(self.dir / name)

    def read(self, name: str) -> bytes:
        return (self.dir / name).read_bytes()

    def client(self, name: str | None) -> grpc.ChannelCredentials:
        """TLS trusting the test CA, presenting the client certificate ``name`` (or none)."""
        if name is None:
            return grpc.ssl_channel_credentials(self.read("ca.pem"))
        return grpc.ssl_channel_credentials(self.read("ca.pem"), self.read(f"{name}.key"), self.read(f"{name}.pem"))


def _write_pem(directory: Path, name: str, key, cert) -> None:
    (directory / f"{name}.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    (directory / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _certificate(subject: str, key, issuer_name: x509.Name, issuer_key, *, ca: bool = False,
                 sans: list[x509.GeneralName] = ()) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(issuer_name)
               .public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _make_ca(directory: Path, name: str):
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _certificate(f"specctl test {name}", key, x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                                                   f"specctl test {name}")]),
                        key, ca=True)
    _write_pem(directory, name, key, cert)
    return key, cert


def _issue(directory: Path, name: str, ca, sans: list[x509.GeneralName]) -> None:
    ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    _write_pem(directory, name, key, _certificate(name, key, ca_cert.subject, ca_key, sans=sans))


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca = _make_ca(directory, "ca")
    _issue(directory, "server", ca, [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    for worker in ("w1", "w2"):
        _issue(directory, worker, ca, [x509.DNSName(worker)])
    _issue(directory, "stranger", _make_ca(directory, "other-ca"), [x509.DNSName("w1")])  # right name, wrong CA
    return Pki(directory)


def server_config(pki: Pki | None, *, mtls: bool = False, auth: dict | None = AUTH) -> ServerConfig:
    """A config validated like a file (through pydantic), on a free port, state in memory."""
    security = {}
    if pki is not None:
        security["tls"] = {"cert_file": pki.path("server.pem"), "key_file": pki.path("server.key")}
        if mtls:
            security["tls"].update(client_ca_file=pki.path("ca.pem"), require_client_cert=True)
    if auth is not None:
        security["auth"] = auth
    return ServerConfig.model_validate({"listen": f"127.0.0.1:{free_port()}", "plan": FAST_PLANS,
                                        "store": {"path": ""}, "security": security})


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def open_channel(running, credentials: grpc.ChannelCredentials | None = None) -> grpc.aio.Channel:
    if credentials is None:
        return grpc.aio.insecure_channel(running.address)
    return grpc.aio.secure_channel(running.address, credentials)


@pytest.fixture
async def serve():
    servers = []

    async def start(config: ServerConfig):
        running = await start_server(config)
        servers.append(running)
        return running

    yield start
    for running in servers:
        await running.stop(0)


def reports_for(worker_id: str, steps: int = 3) -> worker_pb2.StepReports:
    synthetic = SyntheticWorker(lambda ctx: 0.8, seed=3)
    return worker_pb2.StepReports(steps=[step_to_proto(synthetic.step(lambda *a: Decision.chain(2), 4, 500,
                                                                      prefix=f"{worker_id}-r"))
                                         for _ in range(steps)])


@dataclass(frozen=True)
class Ended:
    code: grpc.StatusCode
    details: str


async def connect(channel, token: str | None, messages: list[worker_pb2.WorkerMessage]) -> Ended:
    """Send ``messages`` on a Connect stream (stopping once the controller
    ends it), read until the end; how it ended."""
    call = controller_pb2_grpc.SpeculationControllerStub(channel).Connect(metadata=bearer(token) if token else None)
    try:
        for m in messages:
            await call.write(m)
        await call.done_writing()
        async for _ in call:
            pass
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        pass  # the status below says why
    return Ended(await call.code(), await call.details())


# ----------------------------------------------------------------------- config
def test_config_names_field_and_path_of_a_missing_certificate(tmp_path, pki):
    config = tmp_path / "controller.yaml"
    config.write_text(yaml.safe_dump({"security": {"tls": {"cert_file": "missing.pem",
                                                           "key_file": pki.path("server.key")}}}))
    with pytest.raises(ConfigError) as err:
        load_config(config)
    assert "security.tls.cert_file" in str(err.value) and str(tmp_path / "missing.pem") in str(err.value)
    assert cli.main(["serve", "--config", str(config)]) == 2


def test_config_resolves_relative_files_against_its_folder(tmp_path, pki):
    for name in ("server.pem", "server.key", "ca.pem"):
        (tmp_path / name).write_bytes(pki.read(name))
    config = tmp_path / "controller.yaml"
    config.write_text(yaml.safe_dump({"security": {"tls": {
        "cert_file": "server.pem", "key_file": "server.key", "client_ca_file": "ca.pem",
        "require_client_cert": True}}}))
    tls = load_config(config).security.tls
    assert tls.cert_file == str(tmp_path / "server.pem") and tls.client_ca_file == str(tmp_path / "ca.pem")


def test_config_refuses_inconsistent_security_sections(tmp_path, pki):
    tls = {"cert_file": pki.path("server.pem"), "key_file": pki.path("server.key")}
    cases = {
        "needs client_ca_file": {"tls": {**tls, "require_client_cert": True}},
        "only used with require_client_cert": {"tls": {**tls, "client_ca_file": pki.path("ca.pem")}},
        "bind_client_cert needs tls.require_client_cert": {"tls": tls, "auth": {**AUTH, "bind_client_cert": True}},
        "lists no workers and no admins": {"auth": {}},
        "shares a token digest": {"auth": {"workers": {"a": token_digest(W1_TOKEN), "b": token_digest(W1_TOKEN)}}},
        "not a PEM file": {"tls": {**tls, "key_file": str(tmp_path / "controller.yaml")}},
    }
    for expected, security in cases.items():
        config = tmp_path / "controller.yaml"
        config.write_text(yaml.safe_dump({"security": security}))
        with pytest.raises(ConfigError, match=expected):
            load_config(config)


def test_config_error_never_echoes_a_token_pasted_instead_of_its_digest(tmp_path):
    config = tmp_path / "controller.yaml"
    config.write_text(yaml.safe_dump({"security": {"auth": {"workers": {"w1": W1_TOKEN}}}}))
    with pytest.raises(ConfigError) as err:
        load_config(config)
    assert "security.auth.workers" in str(err.value) and "'w1'" in str(err.value)
    assert W1_TOKEN not in str(err.value)


def test_unlisted_methods_need_the_admin_token():
    auth = Authenticator(ServerConfig.model_validate({"security": {"auth": AUTH}}).security.auth)
    with pytest.raises(AuthError) as err:
        auth.admit("SomeFutureRpc", bearer(W1_TOKEN), {})
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert auth.admit("SomeFutureRpc", bearer(ADMIN_TOKEN), {}) == Identity(Role.ADMIN, "ops")
    assert auth.admit("GetStatus", [("Authorization", f"bearer  {W2_TOKEN} ")], {}) == Identity(Role.WORKER, "w2")


# -------------------------------------------------------------------------- TLS
async def test_tls_only_client_reaches_the_controller_and_plaintext_does_not(serve, pki):
    running = await serve(server_config(pki, auth=None))
    async with open_channel(running, pki.client(None)) as channel:
        status = await controller_pb2_grpc.SpeculationControllerStub(channel).GetStatus(
            controller_pb2.GetStatusRequest(), timeout=5)
    assert status.policy == "goodput"
    async with open_channel(running) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await controller_pb2_grpc.SpeculationControllerStub(channel).GetStatus(
                controller_pb2.GetStatusRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_mutual_tls_refuses_clients_without_a_certificate_from_its_ca(serve, pki):
    running = await serve(server_config(pki, mtls=True, auth=None))
    for credentials in (pki.client(None), pki.client("stranger")):
        async with open_channel(running, credentials) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await controller_pb2_grpc.SpeculationControllerStub(channel).GetStatus(
                    controller_pb2.GetStatusRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    async with open_channel(running, pki.client("w1")) as channel:
        await controller_pb2_grpc.SpeculationControllerStub(channel).GetStatus(
            controller_pb2.GetStatusRequest(), timeout=5)


# ----------------------------------------------------------------------- tokens
async def test_calls_without_a_valid_token_are_unauthenticated_and_apply_nothing(serve, pki):
    running = await serve(server_config(pki))
    hello = worker_pb2.WorkerMessage(hello=make_hello("w1"))
    async with open_channel(running, pki.client(None)) as channel:
        stub = controller_pb2_grpc.SpeculationControllerStub(channel)
        for metadata in (None, bearer(new_token()), (("authorization", W1_TOKEN),)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Decide(controller_pb2.DecideRequest(worker_id="w1", hello=make_hello("w1"),
                                                               reports=reports_for("w1")), metadata=metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert (await connect(channel, None, [hello])).code == grpc.StatusCode.UNAUTHENTICATED
    assert not running.controller.workers
    failures = running.servicer.auth.failures
    assert failures["missing_token"] == 2 and failures["unknown_token"] == 1 and failures["malformed_header"] == 1


async def test_tokens_work_on_a_plaintext_port_with_a_warning(serve, caplog):
    running = await serve(server_config(None))
    assert any("plaintext" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    async with open_channel(running) as channel:
        stub = controller_pb2_grpc.SpeculationControllerStub(channel)
        await stub.GetStatus(controller_pb2.GetStatusRequest(), metadata=bearer(W1_TOKEN))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetStatus(controller_pb2.GetStatusRequest())
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_a_worker_token_cannot_report_as_another_worker(serve, pki):
    running = await serve(server_config(pki))
    ctl = running.controller
    async with open_channel(running, pki.client(None)) as channel:
        # Connect: the first Hello names another worker (the stream ends before anything else is read).
        err = await connect(channel, W1_TOKEN, [worker_pb2.WorkerMessage(hello=make_hello("w2"))])
        assert err.code == grpc.StatusCode.PERMISSION_DENIED and "'w2'" in err.details
        assert not ctl.workers
        # Connect: a later Hello on an admitted stream names another worker: the stream ends there.
        # (It is the last message sent: writes racing the controller's refusal make the client see INTERNAL.)
        err = await connect(channel, W1_TOKEN, [worker_pb2.WorkerMessage(hello=make_hello("w1")),
                                                worker_pb2.WorkerMessage(reports=reports_for("w1", 2)),
                                                worker_pb2.WorkerMessage(hello=make_hello("w2"))])
        assert err.code == grpc.StatusCode.PERMISSION_DENIED
        assert set(ctl.workers) == {"w1"} and ctl.workers["w1"].steps_ingested == 2
        # Decide as another worker, with an admin token, and with the worker's own token.
        stub = controller_pb2_grpc.SpeculationControllerStub(channel)
        request = controller_pb2.DecideRequest(worker_id="w2", hello=make_hello("w2"), reports=reports_for("w2"))
        for token in (W1_TOKEN, ADMIN_TOKEN):
            with pytest.raises(grpc.aio.AioRpcError) as denied:
                await stub.Decide(request, metadata=bearer(token))
            assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "w2" not in ctl.workers
        await stub.Decide(request, metadata=bearer(W2_TOKEN))
        assert ctl.workers["w2"].steps_ingested == 3
    failures = running.servicer.auth.failures
    assert failures["wrong_worker"] == 3 and failures["not_allowed"] == 1


async def test_admin_calls_need_the_admin_token(serve, pki):
    running = await serve(server_config(pki))
    async with open_channel(running, pki.client(None)) as channel:
        stub = controller_pb2_grpc.SpeculationControllerStub(channel)
        for call, request in ((stub.ReloadPolicy, controller_pb2.ReloadPolicyRequest()),
                              (stub.AckAlert, controller_pb2.AckAlertRequest(alert_id="drift-000001"))):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(request, metadata=bearer(W1_TOKEN))
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(request)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reloads = running.controller.policy_reloads
        response = await stub.ReloadPolicy(controller_pb2.ReloadPolicyRequest(), metadata=bearer(ADMIN_TOKEN))
        assert response.loaded and response.policy == "goodput"
        assert running.controller.policy_reloads == reloads + 1
        with pytest.raises(grpc.aio.AioRpcError) as err:  # admitted: the alert is looked up
            await stub.AckAlert(controller_pb2.AckAlertRequest(alert_id="drift-000001"), metadata=bearer(ADMIN_TOKEN))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        # Reads take either kind of token, and only a valid one.
        for token in (W2_TOKEN, ADMIN_TOKEN):
            await stub.GetStatus(controller_pb2.GetStatusRequest(), metadata=bearer(token))
            watch = stub.WatchAlerts(controller_pb2.WatchAlertsRequest(), metadata=bearer(token))
            assert dict(await watch.initial_metadata())["specctl-existing-alerts"] == "0"
            watch.cancel()
        watch = stub.WatchAlerts(controller_pb2.WatchAlertsRequest())
        assert await watch.code() == grpc.StatusCode.UNAUTHENTICATED
    assert running.servicer.auth.failures["not_allowed"] == 2
    assert running.servicer.auth.failures["missing_token"] == 3


async def test_client_certificate_binds_the_worker_identity(serve, pki):
    running = await serve(server_config(pki, mtls=True, auth={**AUTH, "bind_client_cert": True}))
    hello = [worker_pb2.WorkerMessage(hello=make_hello("w1"))]
    async with open_channel(running, pki.client("w2")) as channel:  # w1's token, w2's certificate
        err = await connect(channel, W1_TOKEN, hello)
    assert err.code == grpc.StatusCode.PERMISSION_DENIED and "certificate" in err.details
    assert not running.controller.workers
    async with open_channel(running, pki.client("w1")) as channel:
        assert (await connect(channel, W1_TOKEN, hello)).code == grpc.StatusCode.OK
        # Admin tokens are not bound to a certificate name.
        await controller_pb2_grpc.SpeculationControllerStub(channel).GetStatus(
            controller_pb2.GetStatusRequest(), metadata=bearer(ADMIN_TOKEN))
    assert "w1" in running.controller.workers
    assert running.servicer.auth.failures["certificate_mismatch"] == 1


async def test_tokens_never_reach_logs_or_error_details(serve, pki, caplog, capfd):
    caplog.set_level(logging.DEBUG)
    running = await serve(server_config(pki))
    details = []
    # An agent holding another worker's token: refused, and says so in its log.
    agent = SpeculationAgent(make_hello("w1"), running.address, channel_credentials=pki.client(None),
                             token=W2_TOKEN).start()
    try:
        await wait_for(lambda: "PERMISSION_DENIED" in agent.stats.last_error)
    finally:
        await asyncio.to_thread(agent.close)
    details.append(agent.stats.last_error)
    async with open_channel(running, pki.client(None)) as channel:
        stub = controller_pb2_grpc.SpeculationControllerStub(channel)
        attempts = [(W1_TOKEN, "w2"), (W2_TOKEN, "w2"), (ADMIN_TOKEN, "w1"), (W1_TOKEN[:-2] + "xx", "w1"),
                    (f"{W1_TOKEN} {W2_TOKEN}", "w1")]
        for token, worker_id in attempts:
            try:
                await stub.Decide(controller_pb2.DecideRequest(worker_id=worker_id, hello=make_hello(worker_id)),
                                  metadata=bearer(token))
            except grpc.aio.AioRpcError as err:
                details.append(f"{err} {err.details()} {err.debug_error_string()}")
        try:
            await stub.ReloadPolicy(controller_pb2.ReloadPolicyRequest(), metadata=bearer(W2_TOKEN))
        except grpc.aio.AioRpcError as err:
            details.append(f"{err} {err.details()} {err.debug_error_string()}")
    assert len(details) == 6 and "w2" in running.controller.workers
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert any(r.startswith("controller") for r in refusals) and any("Decide" in r for r in refusals)
    text = caplog.text + capfd.readouterr().err + "\n".join(details)
    for token in TOKENS:
        assert token not in text
        assert token[:12] not in text


# ------------------------------------------------------------------- end to end
async def test_agents_over_mutual_tls_with_tokens_stream_telemetry_and_receive_plans(serve, pki):
    running = await serve(server_config(pki, mtls=True, auth={**AUTH, "bind_client_cert": True}))
    agents = {wid: SpeculationAgent(make_hello(wid, max_depth=4), running.address,
                                    AgentOptions(fallback=Decision.chain(2), flush_interval_s=0.02),
                                    channel_credentials=pki.client(wid), token=token).start()
              for wid, token in (("w1", W1_TOKEN), ("w2", W2_TOKEN))}
    try:
        worker = SyntheticWorker(lambda ctx: 0.8, seed=5)
        for _ in range(30):
            for wid, agent in agents.items():
                agent.observe(worker.step(agent.decide, 4, 500, prefix=f"{wid}-"))
            if all(a.plan_version >= 1 for a in agents.values()):
                break
            await asyncio.sleep(0.05)
        await wait_for(lambda: all(a.plan_version >= 1 and a.stats.connected for a in agents.values()))
    finally:
        for agent in agents.values():
            await asyncio.to_thread(agent.close)
    for wid, agent in agents.items():
        assert running.controller.workers[wid].steps_ingested > 0
        assert running.controller.workers[wid].plans.acked_version >= 1
        assert agent.stats.last_error == ""
    assert not running.servicer.auth.failures


async def test_specctl_token_new_and_status_over_tls(serve, pki, tmp_path, capsys):
    assert cli.main(["token", "new", "--worker", "gpu-17"]) == 0
    lines = capsys.readouterr().out.splitlines()
    token, config_line = lines[1], lines[-1].strip()
    assert config_line.startswith("gpu-17: sha256:")
    config = tmp_path / "controller.yaml"
    config.write_text(f"listen: 127.0.0.1:{free_port()}\nstore: {{path: ''}}\nsecurity:\n"
                      f"  tls: {{cert_file: {pki.path('server.pem')}, key_file: {pki.path('server.key')}}}\n"
                      f"  auth:\n    workers:\n      {config_line}\n")
    running = await serve(load_config(config))
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    base = ["status", "--controller", f"localhost:{running.port}", "--tls-ca", pki.path("ca.pem")]
    assert await asyncio.to_thread(cli.main, base + ["--token-file", str(token_file)]) == 0
    assert "rejected messages" in capsys.readouterr().out
    assert await asyncio.to_thread(cli.main, base) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert running.servicer.auth.failures["missing_token"] == 1
    security = ClientSecurity(tls=True, ca_pem=pki.read("ca.pem"), token=token)
    assert token not in repr(security)
    admin_file = tmp_path / "admin.token"
    assert cli.main(["token", "new", "--admin", "ops", "--out", str(admin_file)]) == 0
    admin_token = admin_file.read_text().strip()
    assert (admin_file.stat().st_mode & 0o777) == 0o600 and admin_token not in capsys.readouterr().out
    assert cli.main(["token", "new", "--admin", "ops", "--out", str(admin_file)]) == 2  # never overwrites


@pytest.mark.model
async def test_reference_worker_follows_a_controller_over_mutual_tls_with_its_token(serve, pki, tmp_path):
    """`specctl worker`'s security flags reach the agent: the reference engine on
    a tiny model streams telemetry over mTLS with w1's token and gets plans;
    with no token it is refused and keeps decoding on its fallback."""
    import torch

    from worker.reference.drafters.ngram import NgramDrafter
    from worker.reference.load import generate_request
    from worker.reference.models import tiny_llama
    from worker.reference.server import ReferenceWorker, WorkerOptions

    torch.set_num_threads(1)
    model, vocab = tiny_llama(seed=0)
    running = await serve(server_config(pki, mtls=True))
    token_file = tmp_path / "w1.token"
    token_file.write_text(W1_TOKEN + "\n")
    parser = argparse.ArgumentParser()
    add_client_security_args(parser)
    flags = ["--tls-ca", pki.path("ca.pem"), "--tls-cert", pki.path("w1.pem"), "--tls-key", pki.path("w1.key")]
    good = ClientSecurity.from_args(parser.parse_args(flags + ["--token-file", str(token_file)]))
    no_token = ClientSecurity.from_args(parser.parse_args(flags))
    target = f"localhost:{running.port}"  # the server certificate names localhost and 127.0.0.1
    workers = [ReferenceWorker(model, None, NgramDrafter(), "tiny",
                               WorkerOptions(listen="127.0.0.1:0", drafter="ngram", controller=target, max_batch=2,
                                             worker_id="w1", fallback_depth=2, security=security)).start()
               for security in (good, no_token)]
    try:
        prompt = torch.randint(0, vocab, (5,), generator=torch.Generator().manual_seed(4)).tolist() * 3
        for w in workers:  # both serve: the refused one decodes on its fallback plan
            out = await asyncio.to_thread(generate_request, w.address, {"prompt_ids": prompt, "max_new_tokens": 12})
            assert len(out["token_ids"]) == 12
        await wait_for(lambda: workers[0].agent.plan_version >= 1, timeout=20)
        await wait_for(lambda: running.controller.status("w1").workers[0].steps_ingested > 0, timeout=20)
        assert workers[0].agent.stats.connected and workers[0].agent.stats.rejections == 0
        await wait_for(lambda: running.servicer.auth.failures["missing_token"] >= 1, timeout=20)
        await wait_for(lambda: "UNAUTHENTICATED" in workers[1].agent.stats.last_error, timeout=20)
        assert workers[1].agent.plan_version == 0  # never got a plan: still on its fallback
    finally:
        for w in workers:
            w.stop()
