"""A remote drafter's rounds on one `ProposeStream` per session (in-process Draft services on loopback,
a tiny random model): the proposals are those unary Propose calls give, round for round; a round the
stream loses is resent as a unary call and answered once; a round's error keeps Propose's status; a
service without the method gets unary calls; closing ends the stream."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import yaml

from draft_service.options import DraftOptions
from draft_service.server import create_server as create_draft
from servicekit.background import BackgroundServices
from servicekit.channels import open_channel as channel
from servicekit.remote import RemoteDrafter
from specmesh.decoding.sampling import SamplingParams
from specmesh.proto.v1 import draft_pb2, draft_pb2_grpc

TIMEOUT_S = 30
PROMPT = [5, 17, 33, 5, 17, 33, 5, 17, 100, 7, 250, 31]
ACCEPTED = [[33], [5, 17], [33, 5], [200], [4, 4, 99], [1], [3, 5, 17]]  # a round's accepted tokens


TOKENS = {"alice": "tok-alice-3d4e", "bob": "tok-bob-5f6a"}


@pytest.fixture(scope="module")
def drafts(tiny_model_dir, tmp_path_factory):
    model = str(tiny_model_dir("llama", init_std=0.2))
    token_file = tmp_path_factory.mktemp("auth") / "tokens.yaml"
    token_file.write_text(yaml.safe_dump(TOKENS))
    with BackgroundServices() as services:
        handles = {"model": services.start(create_draft(DraftOptions(model=model, dtype="float32", port=0))),
                   "ngram": services.start(create_draft(DraftOptions(model=model, drafter="ngram", ngram_max_n=3, port=0))),
                   "tokens": services.start(create_draft(DraftOptions(model=model, drafter="ngram", ngram_max_n=3, port=0,
                                                                      auth_token_file=str(token_file))))}
        yield {name: f"127.0.0.1:{h.port}" for name, h in handles.items()}


async def _rounds(address: str, *, stream: bool, params: SamplingParams, between=None, stub_wrapper=None):
    """Each round's proposal (tokens, q) for ACCEPTED; `between(drafter, session, i)` runs after round i."""
    async with channel(address) as ch:
        stub = draft_pb2_grpc.DraftServiceStub(ch)
        drafter = RemoteDrafter(stub_wrapper(stub) if stub_wrapper else stub, stream=stream)
        session = await drafter.open(PROMPT, params)
        out = []
        for i, accepted in enumerate(ACCEPTED):
            proposal = await drafter.propose(session, accepted, 3)
            out.append((proposal.token_ids, None if proposal.q is None else proposal.q.tolist()))
            if between is not None:
                await between(drafter, session, i)
        used_stream = drafter.stream
        await drafter.close(session)
        assert session.stream[0] is None
        return out, used_stream


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


@pytest.mark.parametrize("kind", ["model", "ngram"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_new_tokens=64),
                                    SamplingParams(temperature=0.8, seed=7, max_new_tokens=64)], ids=["greedy", "seeded"])
def test_streamed_rounds_propose_what_unary_calls_propose(drafts, kind, params):
    streamed, used = _run(_rounds(drafts[kind], stream=True, params=params))
    unary, _ = _run(_rounds(drafts[kind], stream=False, params=params))
    assert used and streamed == unary and any(tokens for tokens, _ in streamed)


def test_a_round_the_stream_loses_is_resent_as_a_unary_call_and_answered_once(drafts):
    """The stream is cut after rounds 1 and 4 (as a dropped connection would): the next round finds it
    gone, is resent as a unary Propose with its round_index, and the round after opens a new stream.
    Had the lost round been drafted twice, the model drafter's sequence (and so its proposals) would differ."""
    params = SamplingParams(temperature=0.8, seed=11, max_new_tokens=64)
    opened = []

    async def cut(drafter, session, i):
        opened.append(session.stream[0])
        if i in (1, 4):
            session.stream[0].cancel()

    cut_off, used = _run(_rounds(drafts["model"], stream=True, params=params, between=cut))
    unary, _ = _run(_rounds(drafts["model"], stream=False, params=params))
    assert used and cut_off == unary
    assert opened[2] is None and opened[5] is None  # the rounds after a cut went out as unary calls
    assert len({id(call) for call in opened if call is not None}) == 3  # the first stream, and one after each cut


def test_a_rounds_error_on_the_stream_keeps_proposes_status(drafts):
    async def bad_round(k: int, unknown: bool = False):
        async with channel(drafts["model"]) as ch:
            drafter = RemoteDrafter(draft_pb2_grpc.DraftServiceStub(ch))
            session = await drafter.open(PROMPT, SamplingParams(temperature=0.0, max_new_tokens=64))
            if unknown:
                await drafter.close(session)
            try:
                await drafter.propose(session, [5], k)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            finally:
                await drafter.close(session)
            return grpc.StatusCode.OK

    assert _run(bad_round(k=10_000)) == grpc.StatusCode.INVALID_ARGUMENT
    assert _run(bad_round(k=2, unknown=True)) == grpc.StatusCode.NOT_FOUND


class _WithoutStream:
    """A stub to a service that predates ProposeStream: the call fails UNIMPLEMENTED."""

    def __init__(self, stub):
        self._stub = stub
        self.tries = 0

    def __getattr__(self, name):
        return getattr(self._stub, name)

    def ProposeStream(self, **kwargs):  # noqa: N802 - the stub's method name
        self.tries += 1
        return _Unimplemented()


class _Unimplemented:
    async def write(self, request):
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNIMPLEMENTED, grpc.aio.Metadata(), grpc.aio.Metadata(), "no such method")

    def cancel(self) -> bool:
        return True


def test_a_service_without_the_stream_gets_unary_calls(drafts):
    params = SamplingParams(temperature=0.0, max_new_tokens=64)
    stubs = []

    def wrap(stub):
        stubs.append(_WithoutStream(stub))
        return stubs[-1]

    fallen_back, used = _run(_rounds(drafts["ngram"], stream=True, params=params, stub_wrapper=wrap))
    unary, _ = _run(_rounds(drafts["ngram"], stream=False, params=params))
    assert fallen_back == unary and not used and stubs[0].tries == 1


def test_the_stream_passes_the_edge_as_a_call_does(drafts):
    """The caller is authenticated once, for the stream; a session is its opener's on the stream too;
    an undecodable message ends the stream INVALID_ARGUMENT."""
    params = SamplingParams(temperature=0.0, max_new_tokens=64)

    async def main():
        async with channel(drafts["tokens"], token=TOKENS["alice"]) as alice_ch, \
                channel(drafts["tokens"], token=TOKENS["bob"]) as bob_ch, channel(drafts["tokens"]) as anonymous_ch:
            alice = RemoteDrafter(draft_pb2_grpc.DraftServiceStub(alice_ch))
            session = await alice.open(PROMPT, params)
            assert (await alice.propose(session, [33], 3)).token_ids and session.stream[0] is not None
            codes = []
            for ch in (bob_ch, anonymous_ch):
                call = draft_pb2_grpc.DraftServiceStub(ch).ProposeStream()
                await call.write(draft_pb2.ProposeStreamRequest(round=draft_pb2.ProposeRequest(
                    session_id=session.session_id, accepted_token_ids=[5], num_draft_tokens=2, round_index=1)))
                try:
                    await call.read()
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code())
            raw = alice_ch.stream_stream("/specmesh.v1.DraftService/ProposeStream", request_serializer=None,
                                         response_deserializer=None)()
            await raw.write(b"\x0f" + bytes(40))  # wire type 7: never a valid message
            try:
                await raw.read()
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code())
            assert (await alice.propose(session, [5], 3)).token_ids  # alice's stream and session go on
            await alice.close(session)
            return codes

    assert _run(main()) == [grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT]
