"""Chunked prefill in the Verify service (in-process, port 0, loopback): while one session prefills a long
prompt, other sessions' Verify rounds run between its chunks; every output stays exact; a prefill that
fails or is cancelled part-way frees its sequence. A tiny random model whose context is stretched to
4,096 tokens, so a prompt of 4,000 takes a while (about 100 chunks of 40)."""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import grpc
import pytest
from service_helpers import wait_for

from servicekit.background import BackgroundServices
from servicekit.channels import open_channel as channel
from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.sampling import SamplingParams, make_generator
from specmesh.decoding.verifier import TargetVerifier
from specmesh.models.load import load_engine
from specmesh.proto.v1 import common_pb2, verify_pb2, verify_pb2_grpc
from target_service.options import VerifyOptions
from target_service.server import create_server as create_verify

MAX_CONTEXT = 4096
LONG_PROMPT = [(7 * i) % 300 + 3 for i in range(4000)]
SHORT_PROMPTS = [[5, 17, 33, 5, 17], [100, 7, 250, 31, 9, 60], [12, 200, 4, 4, 99, 1, 3]]
SHORT_SAMPLING = [dict(temperature=0.0), dict(temperature=0.0), dict(temperature=1.0, seed=5)]
CHUNK_TOKENS = 40
NUM_LONG_TOKENS = 16
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def long_model(tiny_model_dir, tmp_path_factory):
    """The tiny llama with its context stretched (the weights do not depend on it)."""
    folder = tmp_path_factory.mktemp("long-context") / "llama"
    shutil.copytree(tiny_model_dir("llama", init_std=0.2), folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = MAX_CONTEXT
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture(scope="module")
def services(long_model):
    opts = dict(model=long_model, dtype="float64", port=0, fused_drafter="", prefill_chunk_tokens=CHUNK_TOKENS)
    with BackgroundServices() as background:
        handles = {"chunked": background.start(create_verify(VerifyOptions(**opts))),
                   # a KV pool too small for the long prompt: a chunk part-way fails
                   "small_kv": background.start(create_verify(VerifyOptions(**opts, max_kv_tokens=1024)))}
        yield {name: (h, f"127.0.0.1:{h.port}") for name, h in handles.items()}


def _reference(model: str, prompt: list[int], params: SamplingParams, seed: int, num_tokens: int) -> list[int]:
    """The first `num_tokens` tokens in-process: unchunked open, then plain decoding."""
    verifier = TargetVerifier(load_engine(model, dtype="float64"))
    session = verifier.open(prompt, params, make_generator(seed)[0])
    while session.num_tokens - len(prompt) < num_tokens:
        verifier.verify(session, DraftProposal(token_ids=[]))
    return session.token_ids[len(prompt):len(prompt) + num_tokens]


async def _open(stub, prompt: list[int], **sampling) -> verify_pb2.VerifyOpenSessionResponse:
    return await stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(
        prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(ignore_eos=True, max_new_tokens=2000, **sampling)))


async def _decode(stub, session_id: str, num_rounds: int) -> list[int]:
    tokens: list[int] = []
    for _ in range(num_rounds):
        tokens += (await stub.Verify(verify_pb2.VerifyRequest(session_id=session_id))).accepted_token_ids
    return tokens


async def _interleaved(address: str) -> tuple[list[int], list[list[int]], list[int], list[int]]:
    """Short sessions decode in a loop while the long one opens. Returns the long session's tokens, each
    short session's tokens, and the rounds each short session completed while the long prefill ran."""
    async with channel(address) as ch:
        stub = verify_pb2_grpc.VerifyServiceStub(ch)
        opened = [await _open(stub, p, **s) for p, s in zip(SHORT_PROMPTS, SHORT_SAMPLING)]
        short_tokens = [[o.first_token_id] for o in opened]
        rounds_during = [0] * len(opened)
        long_open: asyncio.Task | None = None

        async def loop(i: int) -> None:
            while long_open is None or not long_open.done():
                short_tokens[i] += await _decode(stub, opened[i].session_id, 1)
                if long_open is not None and not long_open.done():
                    rounds_during[i] += 1

        loops = [asyncio.create_task(loop(i)) for i in range(len(opened))]
        await asyncio.sleep(0.2)  # the loops are running
        long_open = asyncio.create_task(_open(stub, LONG_PROMPT, temperature=0.0))
        long = await long_open
        await asyncio.gather(*loops)
        long_tokens = [long.first_token_id, *await _decode(stub, long.session_id, NUM_LONG_TOKENS - 1)]
        for session_id in [long.session_id, *(o.session_id for o in opened)]:
            await stub.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=session_id))
        return long_tokens, short_tokens, rounds_during, [o.seed for o in opened]


def test_other_sessions_verify_between_the_chunks_of_a_long_prefill(services, long_model):
    long_tokens, short_tokens, rounds_during, seeds = asyncio.run(
        asyncio.wait_for(_interleaved(services["chunked"][1]), TIMEOUT_S))
    # about one round per chunk (100 chunks); unchunked, the prefill would be one engine job and none could run
    assert min(rounds_during) >= 5, rounds_during
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    assert long_tokens == _reference(long_model, LONG_PROMPT, greedy, 0, NUM_LONG_TOKENS)
    for prompt, sampling, seed, tokens in zip(SHORT_PROMPTS, SHORT_SAMPLING, seeds, short_tokens):
        params = SamplingParams(**{**sampling, "seed": seed}, ignore_eos=True)
        assert tokens == _reference(long_model, prompt, params, seed, len(tokens))


def _wait_for(predicate, timeout_s: float = 10.0) -> bool:
    return wait_for(predicate, timeout_s)


def test_a_failed_chunk_frees_the_sequence(services):
    handle, address = services["small_kv"]
    engine = handle.servicer.engine
    free_before = engine.num_free_blocks
    with grpc.insecure_channel(address) as ch:
        stub = verify_pb2_grpc.VerifyServiceStub(ch)
        with pytest.raises(grpc.RpcError) as failure:
            stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=LONG_PROMPT[:2000]), timeout=TIMEOUT_S)
        assert failure.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert engine.num_free_blocks == free_before and len(handle.servicer.sessions) == 0
        # the pool is whole again: a prompt that fits opens
        assert stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=LONG_PROMPT[:900]),
                                timeout=TIMEOUT_S).session_id


def test_a_cancelled_prefill_frees_the_sequence(services):
    handle, address = services["chunked"]
    engine = handle.servicer.engine
    free_before = engine.num_free_blocks
    forwards_before = engine.stats.num_forwards
    with grpc.insecure_channel(address) as ch:
        stub = verify_pb2_grpc.VerifyServiceStub(ch)
        with pytest.raises(grpc.RpcError) as failure:
            stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=LONG_PROMPT), timeout=0.05)
        assert failure.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert _wait_for(lambda: engine.num_free_blocks == free_before)
    assert len(handle.servicer.sessions) == 0
    # the prefill stopped at the cancel, short of its 100 forwards
    time.sleep(0.5)
    assert engine.stats.num_forwards - forwards_before < 0.75 * len(LONG_PROMPT) / CHUNK_TOKENS
