"""Stage service: greedy verify-and-extend driven to completion equals target-only greedy decoding
of the stage's model, with quality features per proposal token."""

from __future__ import annotations

import math

import grpc
import pytest

from servicekit.background import BackgroundServices
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.speculative import generate
from specmesh.decoding.verifier import TargetVerifier
from specmesh.models.load import load_engine
from specmesh.proto.v1 import common_pb2, stage_pb2, stage_pb2_grpc
from stage_service.options import StageOptions
from stage_service.server import create_server


def test_stage_greedy_cascade_matches_the_stage_model(tiny_model_dir):
    folder = str(tiny_model_dir("llama", init_std=0.2))
    prompt = [5, 17, 33, 5, 17, 33, 5, 17]
    plain = generate(TargetVerifier(load_engine(folder, dtype="float64")), None, prompt,
                     SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)).token_ids
    with BackgroundServices() as services:
        handle = services.start(create_server(StageOptions(model=folder, dtype="float64", port=0)))
        with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as ch:
            stub = stage_pb2_grpc.StageServiceStub(ch)
            session = stub.OpenSession(stage_pb2.StageOpenSessionRequest(
                prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(temperature=0))).session_id
            # the stage is its own top: it confirms its whole proposal each round; a fixed, partly wrong
            # lower-stage draft exercises rejection
            out, accepted = [], []
            while len(out) < 30:
                r = stub.VerifyAndExtend(stage_pb2.VerifyAndExtendRequest(
                    session_id=session, accepted_token_ids=accepted, draft_token_ids=plain[len(out):len(out) + 2] + [1],
                    num_extend_tokens=3, return_distributions=True))
                assert len(r.features) == len(r.proposal_token_ids) == r.num_accepted_tokens + 3
                assert all(f.entropy_nats >= 0 and 0 < f.top1_prob <= 1 and math.isfinite(f.token_logprob) for f in r.features)
                assert list(r.distributions.dense.shape) == [len(r.proposal_token_ids), handle.servicer.engine.vocab_size]
                accepted = list(r.proposal_token_ids)
                out += accepted
            assert out[:30] == plain
            assert stub.CloseSession(stage_pb2.StageCloseSessionRequest(session_id=session)).existed


def test_a_filling_stage_over_the_wire_and_its_cost(tiny_model_dir):
    """fill_to_tokens: the stage drafts its own tokens until the proposal holds that many; its one-token
    cost comes with the session and with every answer (a cascade's prior, `cost_floor`); a fill past
    the service's limit is refused."""
    folder = str(tiny_model_dir("llama", init_std=0.2))
    prompt = [5, 17, 33, 5, 17, 33, 5, 17]
    plain = generate(TargetVerifier(load_engine(folder, dtype="float64")), None, prompt,
                     SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)).token_ids
    with BackgroundServices() as services:
        handle = services.start(create_server(StageOptions(model=folder, dtype="float64", port=0, max_extend_tokens=8)))
        with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as ch:
            stub = stage_pb2_grpc.StageServiceStub(ch)
            opened = stub.OpenSession(stage_pb2.StageOpenSessionRequest(
                prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(temperature=0)))
            assert opened.HasField("ms_per_token") and opened.ms_per_token > 0
            r = stub.VerifyAndExtend(stage_pb2.VerifyAndExtendRequest(
                session_id=opened.session_id, draft_token_ids=[plain[0], plain[1] + 1], num_extend_tokens=1,
                fill_to_tokens=6))
            assert (r.num_accepted_tokens, list(r.proposal_token_ids)) == (1, plain[:6])
            assert r.HasField("ms_per_token") and r.ms_per_token > 0
            with pytest.raises(grpc.RpcError) as refused:
                stub.VerifyAndExtend(stage_pb2.VerifyAndExtendRequest(
                    session_id=opened.session_id, accepted_token_ids=plain[:6], num_extend_tokens=1, fill_to_tokens=9))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "fill_to_tokens" in refused.value.details()
