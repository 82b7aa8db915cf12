"""What travels: draft distributions q are validated, undecodable bytes are the client's mistake,
and the services describe themselves through both reflection protocols."""

from __future__ import annotations

import random
from array import array

import grpc
import pytest
from contract_helpers import DEADLINE_S, PROMPT_A, SAMPLED, assert_code
from google.protobuf.message import DecodeError
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT


def _dense(wire, rows: list[list[float]]):
    pb = wire.pb.common
    data = array("f", [p for row in rows for p in row]).tobytes()  # float32, little-endian on x86/arm
    return pb.DraftDistributions(dense=pb.Tensor(dtype=pb.D_TYPE_FLOAT32, shape=[len(rows), len(rows[0])], data=data))


def _sparse(wire, rows: list[list[tuple[int, float]]]):
    pb = wire.pb.common
    offsets = [0]
    for row in rows:
        offsets.append(offsets[-1] + len(row))
    ids = [t for row in rows for t, _ in row]
    probs = array("f", [p for row in rows for _, p in row]).tobytes()
    return pb.DraftDistributions(sparse=pb.SparseDistributions(
        offsets=offsets, token_ids=ids, probs=pb.Tensor(dtype=pb.D_TYPE_FLOAT32, shape=[len(ids)], data=probs),
        vocab_size=wire.vocab_size))


def test_q_must_be_distributions(wire):
    opened = wire.open(PROMPT_A, **SAMPLED, seed=5, max_new_tokens=30)
    sid, vocab = opened.session_id, wire.vocab_size
    draft = [opened.first_token_id, 9]
    try:
        for total in (1e-6, 4.9e7):
            q = _dense(wire, [[total / vocab] * vocab] * 2)
            assert_code(INVALID_ARGUMENT, lambda q=q: wire.verify(sid, draft, distributions=q))
        duplicate = _sparse(wire, [[(draft[0], 0.5), (draft[0], 0.5)], [(9, 1.0)]])
        assert_code(INVALID_ARGUMENT, lambda: wire.verify(sid, draft, distributions=duplicate))
        # the failures left the session as it was: proper q's are rounds 0 and 1
        uniform = _dense(wire, [[1.0 / vocab] * vocab] * 2)
        assert wire.verify(sid, draft, distributions=uniform, round_index=0).round_index == 0
        sparse = _sparse(wire, [[(7, 0.5), (8, 0.5)], [(9, 0.25), (10, 0.75)]])
        assert wire.verify(sid, [7, 10], distributions=sparse, round_index=1).round_index == 1
    finally:
        wire.close(sid)


def _undecodable_payloads(wire) -> list[bytes]:
    rng = random.Random(0)
    payloads = [b"\x0f", b"\x0a\xff\xff\xff\xff\x0f", b"\x0a\x02\xff\xfe"]  # wire type 7; truncated; bad UTF-8
    payloads += [rng.randbytes(64) for _ in range(3)]
    for payload in payloads:  # the test's own check that these cannot be VerifyRequests
        with pytest.raises(DecodeError):
            wire.pb.verify.VerifyRequest.FromString(payload)
    return payloads


def test_undecodable_request_is_invalid_argument(wire):
    with grpc.insecure_channel(wire.verify_address) as channel:
        raw = channel.unary_unary("/specmesh.v1.VerifyService/Verify", request_serializer=None,
                                  response_deserializer=None)
        for payload in _undecodable_payloads(wire):
            assert_code(INVALID_ARGUMENT, lambda payload=payload: raw(payload, timeout=DEADLINE_S))
    wire.info()  # the service is fine afterwards


REFLECTION_METHODS = {
    "v1alpha": "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    "v1": "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
}


@pytest.mark.parametrize("version", list(REFLECTION_METHODS))
@pytest.mark.parametrize("service", ["verify", "draft", "stage"])
def test_reflection_lists_the_service(wire, services, service, version):
    """Both reflection protocols (v1's wire format is v1alpha's) list the specmesh service."""
    name = {"verify": "specmesh.v1.VerifyService", "draft": "specmesh.v1.DraftService",
            "stage": "specmesh.v1.StageService"}[service]
    with grpc.insecure_channel(services[service].wait_ready()) as channel:
        if version == "v1alpha":
            call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo
        else:
            call = channel.stream_stream(REFLECTION_METHODS[version],
                                         request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                         response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        responses = list(call(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=DEADLINE_S))
    listed = [s.name for s in responses[0].list_services_response.service]
    assert name in listed
    assert "grpc.health.v1.Health" in listed
