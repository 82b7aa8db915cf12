"""Encoder-decoder models (T5, BART) over the wire: Draft and Verify services in-process (port 0,
loopback), sessions opened with encoder_input_ids. Outputs equal the in-process loop's (greedy:
target-only decoding; sampled: the same seed), fused Step and Verify.Generate too; the errors of a
session or a pair that cannot work are clear. Tiny random models built in a temp dir."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from draft_service.options import DraftOptions
from draft_service.server import create_server as create_draft
from servicekit.background import BackgroundServices
from servicekit.remote import RemoteDrafter, RemoteVerifier
from specmesh.decoding.adaptive import FixedK
from specmesh.decoding.async_driver import generate_async
from specmesh.decoding.plan import Plan
from specmesh.decoding.sampling import SamplingParams, make_generator
from specmesh.decoding.speculative import generate
from specmesh.decoding.verifier import TargetVerifier
from specmesh.drafters.model import ModelDrafter
from specmesh.models.load import load_engine
from specmesh.models.pairing import IncompatibleDraftError
from specmesh.models.tiny_encdec import make_tiny_encdec, perturbed_copy
from specmesh.proto.v1 import common_pb2, draft_pb2, draft_pb2_grpc, verify_pb2, verify_pb2_grpc
from target_service.options import VerifyOptions
from target_service.server import build_fused_drafter
from target_service.server import create_server as create_verify

ENCODER_INPUTS = [[5, 17, 33, 80, 120, 7, 2], [200, 9, 9, 41, 300, 12, 60, 61, 2]]
GREEDY = dict(temperature=0.0, ignore_eos=True, max_new_tokens=24)
SAMPLED = dict(temperature=1.0, top_k=0, ignore_eos=True, max_new_tokens=24)
INIT_STD = {"t5": 0.1, "bart": 0.15}
TIMEOUT_S = 30


@pytest.fixture(scope="module", params=["t5", "bart"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def models(tmp_path_factory, family):
    target = make_tiny_encdec(family, tmp_path_factory.mktemp(family), init_std=INIT_STD[family])
    draft = perturbed_copy(target, tmp_path_factory.mktemp(f"{family}-draft"), noise_std=0.3)
    return {"target": str(target), "draft": str(draft)}


@pytest.fixture(scope="module")
def cluster(models, tiny_model_dir):
    with BackgroundServices() as services:
        handles = {
            "verify": services.start(create_verify(VerifyOptions(
                model=models["target"], port=0, batch_window_ms=2.0, fused_drafter="model",
                fused_drafter_model=models["draft"], fused_drafter_dtype="float32"))),
            "draft": services.start(create_draft(DraftOptions(model=models["draft"], port=0))),
            "draft_decoder_only": services.start(create_draft(DraftOptions(model=str(tiny_model_dir("gpt2")), port=0))),
        }
        yield {name: f"127.0.0.1:{h.port}" for name, h in handles.items()}


def _reference(models, encoder_ids, params, k):
    """In-process: the same models, the same loop (k = 0: target-only decoding)."""
    target = load_engine(models["target"])
    verifier = TargetVerifier(target.bind(encoder_ids))
    drafter = ModelDrafter(load_engine(models["draft"]).bind(encoder_ids)) if k else None
    return generate(verifier, drafter, target.decoder_prompt_ids, params, k_policy=FixedK(k) if k else None)


async def _wire(cluster, encoder_ids, prompt, params, k, fused=False):
    async with grpc.aio.insecure_channel(cluster["verify"]) as verify, grpc.aio.insecure_channel(cluster["draft"]) as draft:
        verifier = RemoteVerifier(verify_pb2_grpc.VerifyServiceStub(verify), encoder_input_ids=encoder_ids)
        drafter = None if fused or not k else RemoteDrafter(draft_pb2_grpc.DraftServiceStub(draft), encoder_input_ids=encoder_ids)
        events = await generate_async(verifier, drafter, prompt, params, k_policy=FixedK(k) if k else None,
                                      plan=Plan.FUSED_STEP if fused else None)
    return [t for e in events for t in e.token_ids], events[-1].stats


def _run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, TIMEOUT_S))


def test_info_says_encoder_decoder(cluster, models):
    with grpc.insecure_channel(cluster["verify"]) as channel:
        info = verify_pb2_grpc.VerifyServiceStub(channel).GetInfo(verify_pb2.VerifyGetInfoRequest())
        assert info.is_encoder_decoder and list(info.decoder_prompt_ids) == list(load_engine(models["target"]).decoder_prompt_ids)
    with grpc.insecure_channel(cluster["draft"]) as channel:
        assert draft_pb2_grpc.DraftServiceStub(channel).GetInfo(draft_pb2.DraftGetInfoRequest()).is_encoder_decoder
    with grpc.insecure_channel(cluster["draft_decoder_only"]) as channel:
        assert not draft_pb2_grpc.DraftServiceStub(channel).GetInfo(draft_pb2.DraftGetInfoRequest()).is_encoder_decoder


def test_greedy_over_the_wire_equals_target_only_decoding(cluster, models):
    prompt = list(load_engine(models["target"]).decoder_prompt_ids)
    num_drafted = num_accepted = 0
    for encoder_ids in ENCODER_INPUTS:
        params = SamplingParams(**GREEDY)
        plain = _reference(models, encoder_ids, params, k=0)
        for k in (2, 4):
            tokens, stats = _run(_wire(cluster, encoder_ids, prompt, params, k))
            assert tokens == plain.token_ids, (encoder_ids, k)
            num_drafted += stats.num_draft_tokens
            num_accepted += stats.num_accepted_tokens
        fused_tokens, _ = _run(_wire(cluster, encoder_ids, prompt, params, 3, fused=True))  # Step: the hosted drafter
        assert fused_tokens == plain.token_ids
        assert _run(_wire(cluster, encoder_ids, prompt, params, 0))[0] == plain.token_ids  # plain rounds over Verify
    assert 0 < num_accepted < num_drafted  # the services rolled back rejected drafts


def test_sampled_over_the_wire_equals_in_process_with_the_same_seed(cluster, models):
    prompt = list(load_engine(models["target"]).decoder_prompt_ids)
    for seed in (1, 2):
        params = SamplingParams(seed=seed, **SAMPLED)
        tokens, _ = _run(_wire(cluster, ENCODER_INPUTS[1], prompt, params, 3))
        assert tokens == _reference(models, ENCODER_INPUTS[1], params, 3).token_ids
        assert tokens == _reference(models, ENCODER_INPUTS[1], params, 0).token_ids  # coupled: target-only's


def test_verify_generate_takes_the_encoder_input(cluster, models):
    prompt = list(load_engine(models["target"]).decoder_prompt_ids)
    plain = _reference(models, ENCODER_INPUTS[0], SamplingParams(**GREEDY), k=0)
    with grpc.insecure_channel(cluster["verify"]) as channel:
        stream = verify_pb2_grpc.VerifyServiceStub(channel).Generate(verify_pb2.VerifyGenerateRequest(
            prompt_token_ids=prompt, encoder_input_ids=ENCODER_INPUTS[0],
            sampling=common_pb2.SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=GREEDY["max_new_tokens"])),
            timeout=TIMEOUT_S)
        assert [t for message in stream for t in message.token_ids] == plain.token_ids


def test_fork_children_keep_the_encoder_input(cluster, models):
    """Children share the parent's encoder output: each continues as a session opened on the parent's
    tokens + its appended ones would."""
    target = load_engine(models["target"])
    prompt, append = list(target.decoder_prompt_ids), [40, 41]
    with grpc.insecure_channel(cluster["verify"]) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        opened = stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(
            prompt_token_ids=prompt, encoder_input_ids=ENCODER_INPUTS[1], sampling=common_pb2.SamplingParams(temperature=0)))
        forked = stub.Fork(verify_pb2.ForkRequest(session_id=opened.session_id, num_children=2, append_token_ids=append))
    reference = TargetVerifier(target.bind(ENCODER_INPUTS[1])).open([*prompt, opened.first_token_id, *append],
                                                                    SamplingParams(temperature=0), make_generator(0)[0])
    assert list(forked.next_token_ids) == [reference.pending_token_id] * 2


def test_sessions_without_a_fitting_encoder_input_are_refused(cluster, models):
    prompt = list(load_engine(models["target"]).decoder_prompt_ids)
    sampling = common_pb2.SamplingParams(temperature=0)
    with grpc.insecure_channel(cluster["verify"]) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        with pytest.raises(grpc.RpcError) as missing:
            stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=prompt, sampling=sampling))
        assert missing.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "encoder-decoder model: send encoder_input_ids" in missing.value.details()
        with pytest.raises(grpc.RpcError) as bad:
            stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=prompt, sampling=sampling,
                                                                 encoder_input_ids=[5, 10**6]))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside the vocabulary" in bad.value.details()
    with grpc.insecure_channel(cluster["draft_decoder_only"]) as channel:
        with pytest.raises(grpc.RpcError) as decoder_only:
            draft_pb2_grpc.DraftServiceStub(channel).OpenSession(draft_pb2.DraftOpenSessionRequest(
                prompt_token_ids=prompt, sampling=sampling, encoder_input_ids=ENCODER_INPUTS[0]))
        assert decoder_only.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "decoder-only: it cannot draft for an encoder-decoder target" in decoder_only.value.details()


def test_a_fused_drafter_of_another_kind_or_vocabulary_fails_at_load(models, tiny_model_dir, tmp_path):
    target = load_engine(models["target"])
    decoder_only = VerifyOptions(model=models["target"], fused_drafter="model", fused_drafter_model=str(tiny_model_dir("gpt2")))
    with pytest.raises(IncompatibleDraftError, match="the draft is a decoder-only model"):
        build_fused_drafter(decoder_only, target, models["target"])
    other_vocab = make_tiny_encdec("t5", tmp_path / "other-vocab", vocab_size=320)
    mismatched = VerifyOptions(model=models["target"], fused_drafter="model", fused_drafter_model=str(other_vocab))
    with pytest.raises(IncompatibleDraftError, match="vocabulary has 320 tokens"):
        build_fused_drafter(mismatched, target, models["target"])


def test_the_coordinator_serves_an_encoder_decoder_pair_exactly(cluster, models):
    """Through the Coordinator: the prompt text is the encoder's input; speculative (Draft service) and
    autoregressive greedy streams equal target-only decoding in-process; skeleton and cascade are refused."""
    from transformers import AutoTokenizer

    from coordinator.options import CoordinatorOptions
    from coordinator.server import create_server as create_coordinator
    from servicekit.channels import open_channel as channel
    from specmesh.proto.v1 import coordinator_pb2, coordinator_pb2_grpc

    text = "the quick brown fox"
    encoder_ids = list(AutoTokenizer.from_pretrained(models["target"])(text).input_ids)
    expected = _reference(models, encoder_ids, SamplingParams(**GREEDY), 0).token_ids
    with BackgroundServices() as services:
        coordinator = services.start(create_coordinator(CoordinatorOptions(
            model=models["target"], port=0, verify_addresses=cluster["verify"], draft_addresses=cluster["draft"])))

        async def run(mode, **extra):
            request = coordinator_pb2.GenerateRequest(prompt=text, mode=mode, sampling=common_pb2.SamplingParams(**GREEDY),
                                                      **extra)
            async with channel(f"127.0.0.1:{coordinator.port}") as ch:
                tokens, last = [], None
                async for response in coordinator_pb2_grpc.CoordinatorServiceStub(ch).Generate(request, timeout=TIMEOUT_S):
                    tokens += response.token_ids
                    last = response
                return tokens, last.stats

        tokens, stats = _run(run(coordinator_pb2.GENERATION_MODE_SPECULATIVE, drafter="service", num_draft_tokens=3))
        assert tokens == expected and stats.drafter == "draft-service" and stats.num_draft_tokens > 0
        assert _run(run(coordinator_pb2.GENERATION_MODE_AUTOREGRESSIVE))[0] == expected
        for mode, extra in ((coordinator_pb2.GENERATION_MODE_SKELETON, {}),
                            (coordinator_pb2.GENERATION_MODE_SPECULATIVE, {"cascade": "127.0.0.1:1"})):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                _run(run(mode, **extra))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
