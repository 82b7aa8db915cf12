"""The server edge every service shares (servicekit.server, servicekit.auth, servicekit.channels):
request size bounds before parsing, undecodable requests, tokens, mTLS with certificates made here,
end users, reflection v1 / v1alpha, drain. Services in-process on loopback (port 0) with a tiny model,
or a principal-echo servicer where only the edge matters; every call has a deadline."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from service_helpers import wait_for

from client.cluster import free_ports, wait_serving
from servicekit.auth import AuthPolicy, current_principal, load_tokens
from servicekit.background import BackgroundServices
from servicekit.channels import open_channel
from servicekit.channels import open_channel as channel
from servicekit.errors import PermissionDenied, Unauthenticated, rpc_method
from servicekit.metrics import ServiceMetrics
from servicekit.options import ServerOptions
from servicekit.server import request_byte_limits, start_service, token_request_bytes
from specmesh.proto.v1 import common_pb2, draft_pb2, stage_pb2, verify_pb2, verify_pb2_grpc
from target_service.options import VerifyOptions
from target_service.server import create_server as create_verify

TIMEOUT_S = 10
ROOT = Path(__file__).resolve().parents[2]
GREEDY = common_pb2.SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=50)
PROMPT = [5, 17, 33, 5, 17, 33, 5, 17]
TOKENS = {"coordinator": "tok-coordinator-1f2e", "alice": "tok-alice-9a8b", "bob": "tok-bob-7c6d"}
OPEN_SESSION = "/specmesh.v1.VerifyService/OpenSession"
REFLECTION_V1 = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
REFLECTION_V1ALPHA = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"


# --- certificates -----------------------------------------------------------------------------------

def _issue(cn: str, issuer=None, *, ca: bool = False, sans=()):
    """(certificate, key) for subject CN=`cn`, signed by `issuer` = (cert, key), self-signed when None."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    issuer_name, signing_key = (subject, key) if issuer is None else (issuer[0].subject, issuer[1])
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                                      data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                                      crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return builder.sign(signing_key, hashes.SHA256()), key


def _write(folder: Path, name: str, cert, key) -> tuple[str, str]:
    cert_path, key_path = folder / f"{name}.pem", folder / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 / localhost, client certificates CN=coordinator and
    CN=alice from that CA, and CN=mallory from another CA. Values: (cert path, key path)."""
    folder = tmp_path_factory.mktemp("pki")
    ca, other_ca = _issue("specmesh test CA", ca=True), _issue("another CA", ca=True)
    files = {"ca": _write(folder, "ca", *ca),
             "server": _write(folder, "server", *_issue("specmesh-server", ca, sans=[
                 x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]))}
    for cn in ("coordinator", "alice"):
        files[cn] = _write(folder, cn, *_issue(cn, ca))
    files["mallory"] = _write(folder, "mallory", *_issue("mallory", other_ca))
    return files


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("auth") / "tokens.yaml"
    path.write_text(yaml.safe_dump(TOKENS))
    return str(path)


# --- services ---------------------------------------------------------------------------------------

class PrincipalEcho(verify_pb2_grpc.VerifyServiceServicer):
    """Answers GetInfo with the principal the edge set (in `fused_drafter`); Generate streams it as
    token ids (its characters). The other methods stay the generated UNIMPLEMENTED placeholders."""

    def __init__(self):
        self.metrics = ServiceMetrics("echo")

    @rpc_method
    async def GetInfo(self, request, context):
        return verify_pb2.VerifyGetInfoResponse(fused_drafter=current_principal())

    @rpc_method
    async def Generate(self, request, context):
        for character in current_principal():
            await asyncio.sleep(0)
            yield verify_pb2.VerifyGenerateResponse(token_ids=[ord(character)])


async def _start_echo(options: ServerOptions):
    handle = await start_service(options, ServiceMetrics("echo"), PrincipalEcho(), ["specmesh.v1.VerifyService"])
    return handle, handle.port


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return str(tiny_model_dir("llama", init_std=0.2))


@pytest.fixture(scope="module")
def services(target, pki, token_file):
    tls = dict(tls_cert=pki["server"][0], tls_key=pki["server"][1], tls_client_ca=pki["ca"][0], trusted_callers="coordinator")
    tokens = dict(auth_token_file=token_file, trusted_callers="coordinator")
    model = dict(model=target, dtype="float32", port=0)
    with BackgroundServices() as background:
        handles = {
            "plain": background.start(create_verify(VerifyOptions(**model))),
            "tokens": background.start(create_verify(VerifyOptions(**model, **tokens))),
            "mtls": background.start(create_verify(VerifyOptions(**model, **tls))),
            "no_reflection": background.start(create_verify(VerifyOptions(**model, reflection=False))),
            "echo_tokens": background.start(_start_echo(ServerOptions(**tokens))),
            "echo_mtls": background.start(_start_echo(ServerOptions(**tls))),
        }
        yield {name: (h, f"127.0.0.1:{h.port}") for name, h in handles.items()}


def _code(fn) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _error(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


def _principal_seen(address: str, **channel_kwargs) -> str:
    with open_channel(address, aio=False, **channel_kwargs) as ch:
        return verify_pb2_grpc.VerifyServiceStub(ch).GetInfo(verify_pb2.VerifyGetInfoRequest(), timeout=TIMEOUT_S).fused_drafter


def _packed_prompt(num_tokens: int) -> bytes:
    """A serialized VerifyOpenSessionRequest with `num_tokens` prompt ids, built without protobuf (fast)."""
    length, varint = num_tokens, bytearray()
    while True:
        varint.append((length & 0x7F) | (0x80 if length > 0x7F else 0))
        length >>= 7
        if not length:
            break
    return b"\x0a" + bytes(varint) + b"\x05" * num_tokens


# --- 1. raw request parsing -------------------------------------------------------------------------

def test_request_byte_limits_follow_the_context_for_token_requests_and_the_message_limit_for_tensors():
    class Servicer:
        max_context = 100

    limits = request_byte_limits(verify_pb2.DESCRIPTOR.services_by_name["VerifyService"], Servicer(), 64)
    assert token_request_bytes(100) == 16 + 6 * 100 + 64 * 1024
    small = {"OpenSession", "Step", "Fork", "CloseSession", "Generate", "GetInfo"}
    assert {m: limits[m] for m in small} == dict.fromkeys(small, token_request_bytes(100))
    assert limits["Verify"] == limits["VerifyBatch"] == 64 * 1024 * 1024  # q tensors
    stage = request_byte_limits(stage_pb2.DESCRIPTOR.services_by_name["StageService"], Servicer(), 8)
    assert stage["VerifyAndExtend"] == 8 * 1024 * 1024 and stage["OpenSession"] == token_request_bytes(100)
    no_context = request_byte_limits(draft_pb2.DESCRIPTOR.services_by_name["DraftService"], object(), 8)
    assert set(no_context.values()) == {8 * 1024 * 1024}  # unknown context: the message limit


def test_an_oversized_prompt_is_refused_before_parsing_while_health_answers(services):
    """48 MB of token ids (under grpc's 64 MB limit) took seconds of event-loop time to parse; now the
    size is checked first: INVALID_ARGUMENT naming the limit, and health checks keep answering."""
    handle, address = services["plain"]
    big = _packed_prompt(48 * 1024 * 1024)
    with grpc.insecure_channel(address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)  # connected
        call = ch.unary_unary(OPEN_SESSION, request_serializer=None, response_deserializer=None).future(big, timeout=TIMEOUT_S)
        latencies = []
        while not call.done() or not latencies:
            start = time.perf_counter()
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S).status == health_pb2.HealthCheckResponse.SERVING
            latencies.append(time.perf_counter() - start)
        assert call.exception() is not None and call.code() == grpc.StatusCode.INVALID_ARGUMENT
        limit = token_request_bytes(handle.servicer.engine.max_context)
        assert f"{len(big)} bytes is larger than the {limit}-byte limit of specmesh.v1.VerifyService/OpenSession" in call.details()
        assert max(latencies) < 1.0, latencies
        # a prompt of the whole context is still accepted
        opened = verify_pb2_grpc.VerifyServiceStub(ch).OpenSession(verify_pb2.VerifyOpenSessionRequest(
            prompt_token_ids=[7] * (handle.servicer.engine.max_context - 1)), timeout=TIMEOUT_S)
        verify_pb2_grpc.VerifyServiceStub(ch).CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=opened.session_id))


@pytest.mark.parametrize("path", [OPEN_SESSION, "/specmesh.v1.VerifyService/Verify", "/specmesh.v1.VerifyService/Generate"])
def test_undecodable_bytes_are_invalid_argument(services, path):
    garbage = b"\x0f" + os.urandom(40)  # wire type 7 does not exist: never a valid message
    with grpc.insecure_channel(services["plain"][1]) as ch:
        if path.endswith("Generate"):
            call = lambda: list(ch.unary_stream(path, request_serializer=None, response_deserializer=None)(garbage, timeout=TIMEOUT_S))
        else:
            call = lambda: ch.unary_unary(path, request_serializer=None, response_deserializer=None)(garbage, timeout=TIMEOUT_S)
        error = _error(call)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "undecodable specmesh.v1." in error.details()


def test_server_streaming_generate_works_through_the_edge_with_a_token(services):
    async def main():
        async with channel(services["tokens"][1], token=TOKENS["alice"]) as ch:
            stub = verify_pb2_grpc.VerifyServiceStub(ch)
            stream = stub.Generate(verify_pb2.VerifyGenerateRequest(prompt_token_ids=PROMPT, sampling=GREEDY), timeout=TIMEOUT_S)
            return [t async for r in stream for t in r.token_ids]

    assert len(asyncio.run(main())) == GREEDY.max_new_tokens


# --- 2. authentication and principals ---------------------------------------------------------------

def test_tokens_guard_every_specmesh_rpc_but_not_health(services):
    address = services["tokens"][1]
    info = lambda **kw: _principal_seen(address, **kw)
    assert _code(lambda: info(token=TOKENS["alice"])) == grpc.StatusCode.OK
    for kwargs in ({}, {"token": "tok-wrong"}, {"token": TOKENS["alice"] + "x"}):
        error = _error(lambda: info(**kwargs))  # noqa: B023 - called at once
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED, kwargs
    with grpc.insecure_channel(address) as ch:  # no token: load balancers probe health
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="specmesh.v1.VerifyService"), timeout=TIMEOUT_S)
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        stub = verify_pb2_grpc.VerifyServiceStub(ch)
        request = verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=PROMPT)
        assert _code(lambda: stub.OpenSession(request, timeout=TIMEOUT_S)) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: stub.OpenSession(request, timeout=TIMEOUT_S, metadata=[("authorization", TOKENS["alice"])])) \
            == grpc.StatusCode.UNAUTHENTICATED  # not "Bearer <token>"


def test_sessions_belong_to_their_principal_over_the_wire(services):
    address = services["tokens"][1]
    with open_channel(address, token=TOKENS["alice"], aio=False) as alice_ch, \
            open_channel(address, token=TOKENS["bob"], aio=False) as bob_ch, \
            open_channel(address, token=TOKENS["coordinator"], end_user="alice", aio=False) as for_alice_ch:
        alice, bob = verify_pb2_grpc.VerifyServiceStub(alice_ch), verify_pb2_grpc.VerifyServiceStub(bob_ch)
        for_alice = verify_pb2_grpc.VerifyServiceStub(for_alice_ch)
        session = alice.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=PROMPT, sampling=GREEDY), timeout=TIMEOUT_S).session_id
        verify = verify_pb2.VerifyRequest(session_id=session, draft_token_ids=[1], deterministic_draft=True)
        for other in (bob, for_alice):  # "coordinator/alice" is not alice
            assert _code(lambda: other.Verify(verify, timeout=TIMEOUT_S)) == grpc.StatusCode.NOT_FOUND  # noqa: B023
            assert not other.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=session), timeout=TIMEOUT_S).existed
        assert alice.Verify(verify, timeout=TIMEOUT_S).accepted_token_ids
        assert alice.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=session), timeout=TIMEOUT_S).existed


def test_the_service_sees_the_token_name_or_the_end_user_a_trusted_caller_acts_for(services):
    address = services["echo_tokens"][1]
    assert _principal_seen(address, token=TOKENS["alice"]) == "alice"
    assert _principal_seen(address, token=TOKENS["coordinator"]) == "coordinator"
    assert _principal_seen(address, token=TOKENS["coordinator"], end_user="bob") == "coordinator/bob"
    assert _principal_seen(address, token=TOKENS["alice"], end_user="alice") == "alice"  # naming oneself is fine
    error = _error(lambda: _principal_seen(address, token=TOKENS["alice"], end_user="bob"))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED and "'alice' may not act for end user 'bob'" in error.details()

    async def streamed():  # the principal is set for a server-streaming call too (asyncio channel + token)
        async with open_channel(address, token=TOKENS["coordinator"], end_user="carol") as ch:
            stream = verify_pb2_grpc.VerifyServiceStub(ch).Generate(verify_pb2.VerifyGenerateRequest(), timeout=TIMEOUT_S)
            return "".join([chr(t) async for r in stream for t in r.token_ids])

    assert asyncio.run(streamed()) == "coordinator/carol"


def test_mtls_accepts_certificates_of_its_ca_and_names_the_principal_by_cn(services, pki):
    ca = pki["ca"][0]
    cert = lambda name: dict(tls_ca=ca, client_cert=pki[name][0], client_key=pki[name][1])
    with open_channel(services["mtls"][1], aio=False, **cert("alice")) as ch:
        info = verify_pb2_grpc.VerifyServiceStub(ch).GetInfo(verify_pb2.VerifyGetInfoRequest(), timeout=TIMEOUT_S)
        assert info.model.vocab_size > 0
    echo = services["echo_mtls"][1]
    assert _principal_seen(echo, **cert("alice")) == "alice"
    assert _principal_seen(echo, **cert("coordinator"), end_user="bob") == "coordinator/bob"
    assert _code(lambda: _principal_seen(echo, **cert("alice"), end_user="bob")) == grpc.StatusCode.PERMISSION_DENIED
    # health needs the client certificate too (the handshake comes first); wait_serving can bring one
    wait_serving(services["mtls"][1], time.monotonic() + TIMEOUT_S, tls_ca=ca, client_cert=pki["alice"][0], client_key=pki["alice"][1])


@pytest.mark.parametrize("client", ["no certificate", "another CA's certificate"])
def test_mtls_refuses_clients_without_a_certificate_of_its_ca(services, pki, client):
    kwargs = dict(tls_ca=pki["ca"][0])
    if client != "no certificate":
        kwargs.update(client_cert=pki["mallory"][0], client_key=pki["mallory"][1])
    assert _code(lambda: _principal_seen(services["mtls"][1], **kwargs)) == grpc.StatusCode.UNAVAILABLE


def test_principal_resolution_rules():
    tokens = AuthPolicy(tokens={"gateway": "g-token", "alice": "a-token"}, trusted_callers=frozenset({"gateway"}))
    bearer = lambda token: ("authorization", f"Bearer {token}")
    assert tokens.resolve([bearer("a-token")], {}) == "alice"
    assert tokens.resolve([("authorization", "bearer g-token"), ("specmesh-end-user", "dave")], {}) == "gateway/dave"
    assert tokens.resolve([bearer("g-token"), ("specmesh-end-user", "")], {}) == "gateway"
    for metadata in ([], [bearer("nope")], [("authorization", "Basic a-token")], [bearer("a-token"), bearer("g-token")]):
        with pytest.raises(Unauthenticated):
            tokens.resolve(metadata, {})
    with pytest.raises(PermissionDenied):
        tokens.resolve([bearer("a-token"), ("specmesh-end-user", "dave")], {})
    with pytest.raises(ValueError, match="at most one"):
        tokens.resolve([bearer("g-token"), ("specmesh-end-user", "a"), ("specmesh-end-user", "b")], {})
    with pytest.raises(ValueError, match="longer than"):
        tokens.resolve([bearer("g-token"), ("specmesh-end-user", "x" * 300)], {})

    mtls = AuthPolicy(mtls=True, trusted_callers=frozenset({"coordinator"}))
    assert mtls.resolve([], {"x509_common_name": [b"coordinator"], "x509_subject": [b"CN=coordinator,O=x"]}) == "coordinator"
    assert mtls.resolve([], {"x509_subject": [b"O=no cn"]}) == "O=no cn"  # no CN: the full subject
    for context in ({}, {"x509_common_name": [b"a/b"]}):
        with pytest.raises(Unauthenticated):
            mtls.resolve([], context)
    # tokens and mTLS together: the certificate admits the connection, the token names the caller
    both = AuthPolicy(tokens={"alice": "a-token"}, mtls=True)
    assert both.resolve([bearer("a-token")], {"x509_common_name": [b"machine-7"]}) == "alice"

    off = AuthPolicy()
    assert off.resolve([bearer("anything")], {}) == "anonymous" == current_principal()
    with pytest.raises(PermissionDenied):
        off.resolve([("specmesh-end-user", "dave")], {})


@pytest.mark.parametrize("content, match", [
    ("[a, b]", "mapping"), ("{}", "mapping"), ("{'a/b': t}", "without '/'"), ("{a: ''}", "non-empty"), ("{a: t, b: t}", "share"),
])
def test_token_files_are_checked(tmp_path, content, match):
    path = tmp_path / "tokens.yaml"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        load_tokens(path)


def test_channel_helpers_check_their_arguments():
    with pytest.raises(ValueError, match="client_cert and client_key"):
        open_channel("127.0.0.1:1", client_cert="c.pem")


# --- 5. reflection ----------------------------------------------------------------------------------

def _reflect(address: str, path: str, *requests: reflection_pb2.ServerReflectionRequest) -> list[reflection_pb2.ServerReflectionResponse]:
    with grpc.insecure_channel(address) as ch:
        call = ch.stream_stream(path, request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        return list(call(iter(requests), timeout=TIMEOUT_S))


@pytest.mark.parametrize("path", [REFLECTION_V1, REFLECTION_V1ALPHA])
def test_reflection_answers_on_v1_and_v1alpha(services, path):
    listed, verify_file, v1_file = _reflect(
        services["plain"][1], path, reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="specmesh.v1.VerifyService"),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="grpc.reflection.v1.ServerReflection"))
    names = {s.name for s in listed.list_services_response.service}
    assert {"specmesh.v1.VerifyService", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= names
    files = [descriptor_pb2.FileDescriptorProto.FromString(b) for b in verify_file.file_descriptor_response.file_descriptor_proto]
    assert {"specmesh/v1/verify.proto", "specmesh/v1/common.proto"} <= {f.name for f in files}
    (v1,) = [descriptor_pb2.FileDescriptorProto.FromString(b) for b in v1_file.file_descriptor_response.file_descriptor_proto]
    assert v1.package == "grpc.reflection.v1" and v1.service[0].method[0].input_type == ".grpc.reflection.v1.ServerReflectionRequest"
    assert {m.name for m in v1.message_type} == {m.name for m in reflection_pb2.DESCRIPTOR.message_types_by_name.values()}
    assert descriptor_pool.Default().FindServiceByName("grpc.reflection.v1.ServerReflection").methods[0].name == "ServerReflectionInfo"


def test_reflection_can_be_turned_off(services):
    for path in (REFLECTION_V1, REFLECTION_V1ALPHA):
        error = _error(lambda: _reflect(services["no_reflection"][1], path, reflection_pb2.ServerReflectionRequest(list_services="")))  # noqa: B023
        assert error.code() == grpc.StatusCode.UNIMPLEMENTED


# --- 6. drain ---------------------------------------------------------------------------------------

def _health(stub) -> int:
    try:
        return stub.Check(health_pb2.HealthCheckRequest(service="specmesh.v1.VerifyService"), timeout=1.0).status
    except grpc.RpcError:
        return -1


def _wait_for(predicate, timeout_s: float = TIMEOUT_S) -> bool:
    return wait_for(predicate, timeout_s)


def test_drain_refuses_new_sessions_and_lets_open_ones_finish(target):
    with BackgroundServices() as background:
        handle = background.start(create_verify(VerifyOptions(model=target, dtype="float32", port=0)))
        with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as ch:
            stub, health = verify_pb2_grpc.VerifyServiceStub(ch), health_pb2_grpc.HealthStub(ch)
            opened = stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=PROMPT, sampling=GREEDY), timeout=TIMEOUT_S)
            drain = asyncio.run_coroutine_threadsafe(handle.drain(5.0), background.loop)
            assert _wait_for(lambda: _health(health) == health_pb2.HealthCheckResponse.NOT_SERVING)
            error = _error(lambda: stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=PROMPT), timeout=TIMEOUT_S))
            assert error.code() == grpc.StatusCode.UNAVAILABLE and "draining" in error.details()
            verified = stub.Verify(verify_pb2.VerifyRequest(session_id=opened.session_id, draft_token_ids=[opened.first_token_id],
                                                            deterministic_draft=True), timeout=TIMEOUT_S)
            assert verified.accepted_token_ids
            assert not drain.done()
            closed_at = time.monotonic()
            assert stub.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=opened.session_id), timeout=TIMEOUT_S).existed
            drain.result(timeout=5.0)
            assert time.monotonic() - closed_at < 1.5  # not the whole grace
        background.handles.remove(handle)


def test_drain_stops_when_the_grace_expires_with_a_session_open(target):
    with BackgroundServices() as background:
        handle = background.start(create_verify(VerifyOptions(model=target, dtype="float32", port=0)))
        with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as ch:
            stub = verify_pb2_grpc.VerifyServiceStub(ch)
            stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=PROMPT), timeout=TIMEOUT_S)
            start = time.monotonic()
            background.call(handle.drain(1.0), timeout_s=5.0)
            assert 0.9 < time.monotonic() - start < 2.5
            assert _code(lambda: stub.GetInfo(verify_pb2.VerifyGetInfoRequest(), timeout=2.0)) == grpc.StatusCode.UNAVAILABLE
        background.handles.remove(handle)


@pytest.mark.parametrize("ending", ["the session closes", "a second signal"])
def test_sigterm_drains_the_service_process(target, ending):
    command = [sys.executable, "-m", "target_service", "--model", target, "--dtype", "float32", "--port", "0", "--drain-grace-s", "30"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, env=env, text=True)
    try:
        lines = []
        while not (match := re.search(r"listening on [\d.]+:(\d+)", lines[-1] if lines else "")):
            line = process.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        with grpc.insecure_channel(f"127.0.0.1:{match.group(1)}") as ch:
            stub, health = verify_pb2_grpc.VerifyServiceStub(ch), health_pb2_grpc.HealthStub(ch)
            session = stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=PROMPT), timeout=TIMEOUT_S).session_id
            process.send_signal(signal.SIGTERM)
            assert _wait_for(lambda: _health(health) == health_pb2.HealthCheckResponse.NOT_SERVING)
            assert _code(lambda: stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=PROMPT), timeout=TIMEOUT_S)) \
                == grpc.StatusCode.UNAVAILABLE
            time.sleep(0.3)
            assert process.poll() is None  # still serving the open session
            if ending == "the session closes":
                assert stub.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=session), timeout=TIMEOUT_S).existed
            else:
                process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=5.0) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


# --- 8. ports -----------------------------------------------------------------------------------------

def test_a_port_another_service_holds_is_a_bind_error_not_a_shared_port(services):
    """gRPC binds with SO_REUSEPORT by default on Linux: a second service on a taken port would start,
    and the two would split the connections (a launcher that picked one port twice served that way)."""
    _, address = services["echo_tokens"]
    taken = int(address.rsplit(":", 1)[1])
    with BackgroundServices() as background, pytest.raises(OSError, match=f"could not bind 127.0.0.1:{taken}: the port is in use"):
        background.start(_start_echo(ServerOptions(host="127.0.0.1", port=taken)))


def test_free_ports_are_distinct_while_picked_together():
    ports = free_ports(64)
    assert len(set(ports)) == 64 and all(0 < p < 65536 for p in ports)
