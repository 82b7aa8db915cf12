"""No client can fail, read or starve another's session: regressions for the defects an outside tester
measured (draft batch poisoning, VerifyBatch applying then failing, Verify racing CloseSession, Fork
past its bound, KV pressure closing sessions, contract holes). Services in-process on loopback, tiny
random models, every call with a deadline."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from draft_service.options import DraftOptions
from draft_service.server import create_server as create_draft
from servicekit.auth import _principal
from servicekit.background import BackgroundServices
from servicekit.channels import open_channel as channel
from servicekit.convert import distributions_to_pb
from servicekit.errors import QuotaExceeded, SessionNotFound
from servicekit.quotas import QuotaOptions
from servicekit.sessions import SessionTable
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.speculative import generate
from specmesh.decoding.verifier import TargetVerifier
from specmesh.models.load import load_engine
from specmesh.proto.v1 import common_pb2, draft_pb2, draft_pb2_grpc, verify_pb2, verify_pb2_grpc
from target_service.options import VerifyOptions
from target_service.server import create_server as create_verify

TIMEOUT_S = 30
GREEDY = common_pb2.SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=200)
PROMPT = [5, 17, 33, 5, 17, 33, 5, 17]


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return str(tiny_model_dir("llama", init_std=0.2))


@pytest.fixture(scope="module")
def services(target):
    with BackgroundServices() as background:
        common = dict(model=target, dtype="float64", port=0)
        handles = {
            "verify": background.start(create_verify(VerifyOptions(**common, batch_window_ms=20.0, max_kv_tokens=8192,
                                                                   max_fork_children=8, session_ttl_s=1.0,
                                                                   reaper_interval_s=0.1))),
            # a long window: concurrent Propose calls land in one batched draft forward
            "draft": background.start(create_draft(DraftOptions(model=target, dtype="float32", port=0, batch_window_ms=150.0))),
            "small_kv": background.start(create_verify(VerifyOptions(**common, max_kv_tokens=64, batch_window_ms=50.0))),
        }
        yield {name: (h, f"127.0.0.1:{h.port}") for name, h in handles.items()}


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


def _reference(target: str, prompt: list[int], n: int) -> list[int]:
    verifier = TargetVerifier(load_engine(target, dtype="float64"))
    return generate(verifier, None, prompt, SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=n)).token_ids


async def _greedy_tokens(stub, session_id: str, first: int, n: int) -> list[int]:
    """Continue a greedy session with k = 0 rounds to n tokens (first token included)."""
    out = [first]
    while len(out) < n:
        out += (await stub.Verify(verify_pb2.VerifyRequest(session_id=session_id), timeout=TIMEOUT_S)).accepted_token_ids
    return out[:n]


def test_a_bad_propose_fails_alone_not_the_batch(services):
    async def main():
        async with channel(services["draft"][1]) as ch:
            stub = draft_pb2_grpc.DraftServiceStub(ch)
            ids = [(await stub.OpenSession(draft_pb2.DraftOpenSessionRequest(prompt_token_ids=PROMPT, sampling=GREEDY),
                                           timeout=TIMEOUT_S)).session_id for _ in range(4)]
            for session_id in ids:  # a first draft each: from now on a Propose must bring accepted tokens
                await stub.Propose(draft_pb2.ProposeRequest(session_id=session_id, num_draft_tokens=3), timeout=TIMEOUT_S)
            bad = stub.Propose(draft_pb2.ProposeRequest(session_id=ids[0], num_draft_tokens=3), timeout=TIMEOUT_S)
            good = [stub.Propose(draft_pb2.ProposeRequest(session_id=i, accepted_token_ids=[7], num_draft_tokens=3),
                                 timeout=TIMEOUT_S) for i in ids[1:]]
            results = await asyncio.gather(bad, *good, return_exceptions=True)
            assert isinstance(results[0], grpc.aio.AioRpcError)
            assert results[0].code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "accepted_token_ids" in results[0].details()
            assert all(len(r.draft_token_ids) == 3 for r in results[1:])
            # the bad caller's session was left as it was: a correct call now works
            fixed = await stub.Propose(draft_pb2.ProposeRequest(session_id=ids[0], accepted_token_ids=[7], num_draft_tokens=3),
                                       timeout=TIMEOUT_S)
            assert len(fixed.draft_token_ids) == 3

    _run(main())


def test_verify_batch_validates_everything_before_applying(services, target):
    async def main():
        async with channel(services["verify"][1]) as ch:
            stub = verify_pb2_grpc.VerifyServiceStub(ch)
            a = await stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=PROMPT, sampling=GREEDY), timeout=TIMEOUT_S)
            b = await stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=PROMPT, sampling=GREEDY), timeout=TIMEOUT_S)
            batch = verify_pb2.VerifyBatchRequest(requests=[
                verify_pb2.VerifyRequest(session_id=a.session_id, draft_token_ids=[1, 2]),
                verify_pb2.VerifyRequest(session_id=b.session_id, draft_token_ids=[1] * 65)])
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.VerifyBatch(batch, timeout=TIMEOUT_S)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # A was not advanced: its output continues exactly from where it was
            return await _greedy_tokens(stub, a.session_id, a.first_token_id, 12)

    assert _run(main()) == _reference(target, PROMPT, 12)


def test_verify_batch_answers_a_failing_item_in_its_own_status(services, target):
    """KV pool of 64 tokens (4 blocks of 16): A (8 tokens) fits, B (40 tokens) + 20 draft tokens does not."""
    async def main():
        async with channel(services["small_kv"][1]) as ch:
            stub = verify_pb2_grpc.VerifyServiceStub(ch)
            a = await stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=PROMPT, sampling=GREEDY), timeout=TIMEOUT_S)
            b = await stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=list(range(1, 41)), sampling=GREEDY),
                                       timeout=TIMEOUT_S)
            response = await stub.VerifyBatch(verify_pb2.VerifyBatchRequest(requests=[
                verify_pb2.VerifyRequest(session_id=a.session_id),
                verify_pb2.VerifyRequest(session_id=b.session_id, draft_token_ids=[3] * 20)]), timeout=TIMEOUT_S)
            ok, failed = response.responses
            assert ok.status_code == 0 and len(ok.accepted_token_ids) == 1
            assert failed.status_code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and "KV" in failed.status_message
            # KV pressure does not kill the session: B goes on with a smaller round
            again = await stub.Verify(verify_pb2.VerifyRequest(session_id=b.session_id), timeout=TIMEOUT_S)
            rest = await _greedy_tokens(stub, a.session_id, ok.accepted_token_ids[0], 5)
            for session in (a, b):
                assert (await stub.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=session.session_id))).existed
            return [a.first_token_id, *rest], again

    tokens, again = _run(main())
    assert tokens == _reference(target, PROMPT, 6)
    assert len(again.accepted_token_ids) == 1


def test_a_full_kv_pool_keeps_the_session_open(services):
    async def main():
        async with channel(services["small_kv"][1]) as ch:
            stub = verify_pb2_grpc.VerifyServiceStub(ch)
            s = await stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=list(range(1, 41)), sampling=GREEDY),
                                       timeout=TIMEOUT_S)
            blocker = await stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=PROMPT, sampling=GREEDY),
                                             timeout=TIMEOUT_S)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Verify(verify_pb2.VerifyRequest(session_id=s.session_id, draft_token_ids=[3] * 20), timeout=TIMEOUT_S)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            await stub.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=blocker.session_id))
            retried = await stub.Verify(verify_pb2.VerifyRequest(session_id=s.session_id, draft_token_ids=[3] * 20), timeout=TIMEOUT_S)
            assert (await stub.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=s.session_id))).existed
            return retried

    assert len(_run(main()).accepted_token_ids) >= 1


def test_verify_racing_close_is_not_found_never_internal(services):
    async def main():
        codes = []
        async with channel(services["verify"][1]) as ch:
            stub = verify_pb2_grpc.VerifyServiceStub(ch)
            for _ in range(30):
                s = await stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=PROMPT, sampling=GREEDY),
                                           timeout=TIMEOUT_S)
                verify = stub.Verify(verify_pb2.VerifyRequest(session_id=s.session_id, draft_token_ids=[1, 2]), timeout=TIMEOUT_S)
                close = stub.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=s.session_id), timeout=TIMEOUT_S)
                result, closed = await asyncio.gather(verify, close, return_exceptions=True)
                assert not isinstance(closed, BaseException) and closed.existed
                codes.append(result.code() if isinstance(result, grpc.aio.AioRpcError) else grpc.StatusCode.OK)
        return codes

    codes = _run(main())
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND}, codes


def test_fork_is_bounded_and_all_or_nothing(services):
    handle, address = services["verify"]

    async def main():
        # the tests before may leave sessions whose close is still under way (one racing a Verify ends after it):
        # they would leave the counts below while a Fork is checked for adding none (bounded wait)
        for _ in range(200):
            if not handle.servicer.num_sessions:
                break
            await asyncio.sleep(0.05)
        async with channel(address) as ch:
            stub = verify_pb2_grpc.VerifyServiceStub(ch)
            s = await stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=PROMPT, sampling=GREEDY), timeout=TIMEOUT_S)
            sessions, free = handle.servicer.num_sessions, handle.servicer.engine.num_free_blocks
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Fork(verify_pb2.ForkRequest(session_id=s.session_id, num_children=40_000), timeout=TIMEOUT_S)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "[1, 8]" in info.value.details()
            assert (handle.servicer.num_sessions, handle.servicer.engine.num_free_blocks) == (sessions, free)
            forked = await stub.Fork(verify_pb2.ForkRequest(session_id=s.session_id, num_children=8), timeout=TIMEOUT_S)
            assert handle.servicer.num_sessions == sessions + 8
            for session_id in (s.session_id, *forked.child_session_ids):
                await stub.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=session_id), timeout=TIMEOUT_S)

    _run(main())


def test_contract_holes_are_closed(services):
    handle, address = services["verify"]

    async def main():
        async with channel(address) as ch:
            stub = verify_pb2_grpc.VerifyServiceStub(ch)
            info = await stub.GetInfo(verify_pb2.VerifyGetInfoRequest(), timeout=TIMEOUT_S)
            vocab = info.model.vocab_size
            sampled = common_pb2.SamplingParams(temperature=1.0, seed=3, acceptance_rule=common_pb2.ACCEPTANCE_RULE_STANDARD)
            s = await stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=PROMPT, sampling=sampled), timeout=TIMEOUT_S)
            assert len(s.session_id) == 32 and int(s.session_id, 16) >= 0  # 128 bits, server-made

            async def code(request) -> grpc.StatusCode:
                try:
                    await stub.Verify(request, timeout=TIMEOUT_S)
                except grpc.aio.AioRpcError as exc:
                    return exc.code()
                return grpc.StatusCode.OK

            def dense(scale: float) -> common_pb2.DraftDistributions:
                return distributions_to_pb(torch.full((1, vocab), scale / vocab), torch.float32, False, vocab)

            duplicate = common_pb2.DraftDistributions(sparse=common_pb2.SparseDistributions(
                offsets=[0, 2], token_ids=[4, 4], vocab_size=vocab,
                probs=common_pb2.Tensor(dtype=common_pb2.D_TYPE_FLOAT32, shape=[2], data=torch.tensor([0.5, 0.5]).numpy().tobytes())))
            invalid = grpc.StatusCode.INVALID_ARGUMENT
            assert await code(verify_pb2.VerifyRequest(session_id=s.session_id, draft_token_ids=[4], distributions=dense(1e-6))) == invalid
            assert await code(verify_pb2.VerifyRequest(session_id=s.session_id, draft_token_ids=[4], distributions=dense(4.9e7))) == invalid
            assert await code(verify_pb2.VerifyRequest(session_id=s.session_id, draft_token_ids=[4], distributions=duplicate)) == invalid
            # a sampled session's draft without q must say it is deterministic (the standard rule reads q)
            assert await code(verify_pb2.VerifyRequest(session_id=s.session_id, draft_token_ids=[4])) == invalid
            assert await code(verify_pb2.VerifyRequest(session_id="x" * 10_000)) == invalid
            assert await code(verify_pb2.VerifyRequest(session_id=s.session_id, draft_token_ids=[4], deterministic_draft=True)) \
                == grpc.StatusCode.OK
            assert await code(verify_pb2.VerifyRequest(session_id=s.session_id, draft_token_ids=[4], distributions=dense(1.0))) \
                == grpc.StatusCode.OK
            kv = (await stub.GetInfo(verify_pb2.VerifyGetInfoRequest(), timeout=TIMEOUT_S)).kv
            assert kv.block_size == 16 and 0 < kv.free_blocks < kv.total_blocks == 8192 // 16
            # the reaper (TTL 1 s) expires the idle session and counts it
            for _ in range(100):
                await asyncio.sleep(0.05)
                if handle.servicer.metrics.expired_sessions._value.get() >= 1:
                    break

    _run(main())
    registry = handle.servicer.metrics.registry
    assert registry.get_sample_value("specmesh_expired_sessions_total") >= 1
    assert registry.get_sample_value("specmesh_kv_blocks_total") == 8192 // 16
    assert registry.get_sample_value("specmesh_kv_blocks_free") <= 8192 // 16


def test_retried_rounds_never_advance_twice(services, target):
    async def main():
        async with channel(services["verify"][1]) as ch:
            stub = verify_pb2_grpc.VerifyServiceStub(ch)
            s = await stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=PROMPT, sampling=GREEDY), timeout=TIMEOUT_S)
            first = verify_pb2.VerifyRequest(session_id=s.session_id, draft_token_ids=[9, 9], round_index=0)
            answer = await stub.Verify(first, timeout=TIMEOUT_S)
            assert await stub.Verify(first, timeout=TIMEOUT_S) == answer  # a resend: the same answer, no advance
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Verify(verify_pb2.VerifyRequest(session_id=s.session_id, round_index=5), timeout=TIMEOUT_S)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            out = [s.first_token_id, *answer.accepted_token_ids]
            return out + await _greedy_tokens(stub, s.session_id, -1, 12 - len(out) + 1)

    tokens = _run(main())
    tokens.remove(-1)
    assert tokens == _reference(target, PROMPT, 12)


def test_sessions_belong_to_their_principal():
    """Unit level (the wire level, with tokens, is in test_server_edge): another principal's id is
    'not found', like a made-up one."""
    async def main():
        async def free(value):
            pass

        table = SessionTable(60.0, free)
        session_id = table.add("state", owner="alice")
        assert table.get(session_id, "alice").value == "state"
        with pytest.raises(SessionNotFound):
            table.get(session_id, "bob")
        assert not await table.close(session_id, owner="bob")
        assert await table.close(session_id, owner="alice")

    _run(main())


def test_quotas_are_per_principal(services):
    servicer = services["verify"][0].servicer

    async def main():
        servicer.quotas.options = QuotaOptions(quota_sessions=1, quota_kv_tokens=1000)
        try:
            token = _principal.set("alice")
            async with servicer.admission(10):
                with pytest.raises(QuotaExceeded, match="open sessions 2 > 1 .*--quota-sessions"):
                    async with servicer.admission(10):
                        pass
                _principal.set("bob")  # another principal is not affected by alice's use
                async with servicer.admission(10):
                    with pytest.raises(QuotaExceeded, match="KV tokens"):
                        servicer.check_kv_quota(2000)
            _principal.reset(token)
        finally:
            servicer.quotas.options = QuotaOptions()

    _run(main())


def test_quotas_over_the_wire_name_the_limit_and_spare_other_principals(target, tmp_path):
    """Tokens for alice, bob and a trusted coordinator; one session each: alice's second is refused,
    bob's first is not, and behind the coordinator each end user has a quota of their own."""
    import yaml

    from servicekit.channels import open_channel

    tokens = {"alice": "a-secret", "bob": "b-secret", "coordinator": "c-secret"}
    token_file = tmp_path / "tokens.yaml"
    token_file.write_text(yaml.safe_dump(tokens))
    options = VerifyOptions(model=target, dtype="float32", port=0, auth_token_file=str(token_file),
                            trusted_callers="coordinator", quota_sessions=1, quota_max_new_tokens=100)
    with BackgroundServices() as background:
        address = f"127.0.0.1:{background.start(create_verify(options)).port}"

        def open_as(token: str, end_user: str = "", **sampling) -> grpc.StatusCode | str:
            with open_channel(address, token=token, end_user=end_user, aio=False) as ch:
                try:
                    return verify_pb2_grpc.VerifyServiceStub(ch).OpenSession(verify_pb2.VerifyOpenSessionRequest(
                        prompt_token_ids=PROMPT, sampling=common_pb2.SamplingParams(temperature=0, **sampling)),
                        timeout=TIMEOUT_S).session_id
                except grpc.RpcError as exc:
                    assert "quota exceeded" in exc.details() and "--quota-" in exc.details()
                    return exc.code()

        exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
        assert isinstance(open_as(tokens["alice"]), str)
        assert open_as(tokens["alice"]) == exhausted  # names --quota-sessions
        assert isinstance(open_as(tokens["bob"]), str)  # alice's use does not count against bob
        assert open_as(tokens["bob"], max_new_tokens=500) == exhausted  # names --quota-max-new-tokens
        assert isinstance(open_as(tokens["coordinator"], "carol"), str)  # end users behind the coordinator ...
        assert isinstance(open_as(tokens["coordinator"], "dave"), str)  # ... each have their own quota
        assert open_as(tokens["coordinator"], "carol") == exhausted
