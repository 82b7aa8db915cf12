"""Draft and Verify services in-process (port 0, loopback): exactness over the wire, batching, errors,
TTL, cancellation, health and reflection. Tiny random models; the in-process loop is the reference."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from service_helpers import wait_for

from draft_service.options import DraftOptions
from draft_service.server import create_server as create_draft
from servicekit.background import BackgroundServices
from servicekit.channels import open_channel as channel
from servicekit.convert import distributions_to_pb
from servicekit.remote import RemoteVerifier, outcome_from_pb
from servicekit.wire_loop import wire_generation
from specmesh.decoding.adaptive import AdaptiveK, FixedK, ForwardCost
from specmesh.decoding.async_driver import _prior_costs
from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.sampling import AcceptanceRule, SamplingParams
from specmesh.decoding.speculative import generate
from specmesh.decoding.state import SpeculationState
from specmesh.decoding.verifier import TargetVerifier
from specmesh.drafters.model import ModelDrafter
from specmesh.drafters.ngram import PromptLookupDrafter
from specmesh.drafters.wire_q import RoundQ
from specmesh.models.load import load_engine
from specmesh.proto.v1 import common_pb2, draft_pb2, draft_pb2_grpc, verify_pb2, verify_pb2_grpc
from target_service.options import VerifyOptions
from target_service.server import create_server as create_verify

PROMPTS = [[5, 17, 33, 5, 17, 33, 5, 17], [100, 7, 250, 31, 9, 60, 12, 200, 4, 4, 99, 1, 3]]
GREEDY = dict(temperature=0.0, ignore_eos=True, max_new_tokens=40)
SAMPLED = dict(temperature=1.3, top_k=0, ignore_eos=True, max_new_tokens=40)
TIMEOUT_S = 30


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    return {"target": str(tiny_model_dir("llama", init_std=0.2)), "other": str(tiny_model_dir("qwen2", init_std=0.2))}


@pytest.fixture(scope="module")
def cluster(models):
    with BackgroundServices() as services:
        verify_opts = dict(model=models["target"], dtype="float64", port=0, batch_window_ms=5.0)
        handles = {
            "verify": services.start(create_verify(VerifyOptions(**verify_opts, max_kv_tokens=8192))),
            "draft_self": services.start(create_draft(DraftOptions(model=models["target"], dtype="float32", port=0))),
            "draft_other": services.start(create_draft(DraftOptions(model=models["other"], dtype="float64", port=0))),
            "draft_ngram": services.start(create_draft(DraftOptions(model=models["target"], drafter="ngram",
                                                                    ngram_max_n=3, port=0))),
            # short TTL, slow batcher (cancellation), small KV pool (RESOURCE_EXHAUSTED)
            "aux": services.start(create_verify(VerifyOptions(**{**verify_opts, "batch_window_ms": 300.0},
                                                              session_ttl_s=1.5, reaper_interval_s=0.2, max_kv_tokens=4096))),
            "tiny_kv": services.start(create_verify(VerifyOptions(**verify_opts, max_kv_tokens=64))),
        }
        yield {name: (h, f"127.0.0.1:{h.port}") for name, h in handles.items()}


def _reference(models, drafter_kind, prompt, params, k, q_dtype=None):
    verifier = TargetVerifier(load_engine(models["target"], dtype="float64"))
    if drafter_kind == "ngram":
        drafter = PromptLookupDrafter(min_n=1, max_n=3)
    elif drafter_kind == "self":
        drafter = ModelDrafter(load_engine(models["target"], dtype="float32"))
    elif drafter_kind == "other-rounded":
        drafter = ModelDrafter(load_engine(models["other"], dtype="float64"), q_transform=RoundQ(q_dtype))
    else:
        drafter = ModelDrafter(load_engine(models["other"], dtype="float64"))
    return generate(verifier, drafter, prompt, params, k_policy=FixedK(k))


def _wire(cluster, draft_name, prompt, params, k, **kwargs):
    return asyncio.run(asyncio.wait_for(
        wire_generation(cluster[draft_name][1], cluster["verify"][1], prompt, params, k, **kwargs), TIMEOUT_S))


@pytest.mark.parametrize("drafter_kind", ["self", "ngram"])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_over_the_wire_equals_in_process(cluster, models, drafter_kind, k):
    for prompt in PROMPTS:
        params = SamplingParams(**GREEDY)
        wire = _wire(cluster, f"draft_{drafter_kind}", prompt, params, k)
        ref = _reference(models, drafter_kind, prompt, params, k)
        assert wire.token_ids == ref.token_ids
        assert wire.finish_reason is ref.finish_reason
        assert wire.stats.num_target_forwards == ref.stats.num_target_forwards


@pytest.mark.parametrize("q_dtype,sparse", [("float32", False), ("float32", True), ("float16", False), ("bfloat16", True)])
def test_sampled_over_the_wire_equals_in_process_with_the_same_seed(cluster, models, q_dtype, sparse):
    """q travels as the values the drafter sampled from (the standard rule: the coupled one sends none).
    fp32 is the drafter's own q (compared with the plain ModelDrafter); rounded dtypes are compared with
    a ModelDrafter whose q transform rounds the same way (`specmesh.drafters.wire_q`)."""
    for seed in (1, 2):
        prompt = PROMPTS[1]
        params = SamplingParams(seed=seed, acceptance_rule=AcceptanceRule.STANDARD, **SAMPLED)
        wire = _wire(cluster, "draft_other", prompt, params, 4, q_dtype=q_dtype, sparse_q=sparse)
        if q_dtype == "float32":
            ref = _reference(models, "other", prompt, params, 4)
        else:
            ref = _reference(models, "other-rounded", prompt, params, 4, q_dtype=getattr(torch, q_dtype))
        assert wire.token_ids == ref.token_ids
        assert 0 < wire.stats.num_accepted_tokens < wire.stats.num_draft_tokens  # both accept and reject paths ran


def test_concurrent_verify_calls_share_forwards_and_match_sequential(cluster):
    handle, address = cluster["verify"]
    engine = handle.servicer.engine
    num_sessions, num_rounds, k = 8, 10, 3
    prompts = [[(7 * s + i) % 200 + 1 for i in range(12)] * 2 for s in range(num_sessions)]

    async def session_loop(stub, prompt):
        opened = await stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(
            prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(temperature=0)), timeout=TIMEOUT_S)
        drafter = PromptLookupDrafter(1, 3)
        state, new, out = drafter.open(prompt), [opened.first_token_id], [opened.first_token_id]
        ready.append(1)
        while len(ready) < num_sessions:  # start verifying together
            await asyncio.sleep(0.01)
        for _ in range(num_rounds):
            proposal = drafter.propose(state, new, k, SamplingParams(temperature=0), None)
            response = await stub.Verify(verify_pb2.VerifyRequest(session_id=opened.session_id,
                                                                  draft_token_ids=proposal.token_ids), timeout=TIMEOUT_S)
            new = list(response.accepted_token_ids)
            out += new
        await stub.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=opened.session_id))
        return out

    async def run(concurrent: bool):
        async with channel(address) as ch:
            stub = verify_pb2_grpc.VerifyServiceStub(ch)
            if concurrent:
                return await asyncio.gather(*(session_loop(stub, p) for p in prompts))
            results = []
            for p in prompts:
                ready.clear()
                ready.extend([1] * (num_sessions - 1))
                results.append(await session_loop(stub, p))
            return results

    ready: list[int] = []
    sequential = asyncio.run(run(False))
    ready = []
    before = engine.stats.num_forwards
    concurrent = asyncio.run(run(True))
    num_forwards = engine.stats.num_forwards - before - num_sessions  # minus the prefills
    assert concurrent == sequential
    assert num_forwards <= 30, f"{num_sessions * num_rounds} verify calls took {num_forwards} forwards"


def test_verify_reports_the_fitted_forward_cost_once_draft_lengths_vary(cluster):
    """The service fits forward ms = fixed + per_token x tokens; a client reads it into its adaptive k."""
    _, address = cluster["verify"]
    prompt = [(3 * i) % 200 + 1 for i in range(16)]

    async def run():
        async with channel(address) as ch:
            stub = verify_pb2_grpc.VerifyServiceStub(ch)
            opened = await stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(
                prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(temperature=0, ignore_eos=True,
                                                                            max_new_tokens=400)), timeout=TIMEOUT_S)
            responses = []
            for k in [0, 6, 1, 5, 2, 4] * 3:
                draft = DraftProposal(token_ids=[(11 * i) % 200 + 1 for i in range(k)])
                response = await stub.Verify(verify_pb2.VerifyRequest(session_id=opened.session_id,
                                                                      draft_token_ids=draft.token_ids), timeout=TIMEOUT_S)
                responses.append((k, draft, response))
            await stub.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=opened.session_id))
            return responses

    responses = asyncio.run(run())
    assert all(r.batch_tokens == 1 + k and r.batch_size == 1 for k, _, r in responses)
    k, draft, last = responses[-1]
    assert last.HasField("forward_fixed_ms") and last.HasField("forward_ms_per_token")
    assert last.forward_fixed_ms >= 0 and last.forward_ms_per_token >= 0
    assert outcome_from_pb(last, draft).cost == ForwardCost(last.forward_fixed_ms, last.forward_ms_per_token, 1)

    async def open_again():  # a later session hears the fit when it opens: its k policy's prior beta
        async with channel(address) as ch:
            remote = RemoteVerifier(verify_pb2_grpc.VerifyServiceStub(ch))
            session_id, _ = await remote.open(prompt, SamplingParams(temperature=0.0, max_new_tokens=8))
            cost = remote.opened_forward_cost(session_id)
            policy = AdaptiveK()
            state = SpeculationState(SamplingParams(temperature=0.0, max_new_tokens=8), num_prompt_tokens=len(prompt),
                                     max_context=512, eos_token_ids=(), k_policy=policy, has_drafter=True, seed=1)
            _prior_costs(state, remote, session_id, CostsOf(draft_ms=1.0), None)
            await remote.close(session_id)
            return cost, policy

    cost, policy = asyncio.run(open_again())
    assert cost is not None and cost.batch_size == 1 and cost.fixed_ms >= 0 and cost.ms_per_token >= 0
    assert policy.beta == cost.beta()  # not the prior 0.1


@dataclasses.dataclass
class CostsOf:
    """A drafter that only reports its cost (`CostReporter`)."""

    draft_ms: float

    def opened_ms_per_token(self, session) -> float:
        return self.draft_ms


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def test_errors_map_to_status_codes_and_the_services_keep_serving(cluster):
    verify_ch, draft_ch = grpc.insecure_channel(cluster["verify"][1]), grpc.insecure_channel(cluster["draft_self"][1])
    tiny_ch = grpc.insecure_channel(cluster["tiny_kv"][1])
    verify, draft = verify_pb2_grpc.VerifyServiceStub(verify_ch), draft_pb2_grpc.DraftServiceStub(draft_ch)
    vocab = verify.GetInfo(verify_pb2.VerifyGetInfoRequest()).model.vocab_size
    greedy = common_pb2.SamplingParams(temperature=0, ignore_eos=True)  # rounds past EOS are refused
    session = verify.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=[1, 2, 3], sampling=greedy)).session_id
    draft_session = draft.OpenSession(draft_pb2.DraftOpenSessionRequest(prompt_token_ids=[1, 2, 3], sampling=greedy)).session_id
    bad_q = common_pb2.DraftDistributions(dense=common_pb2.Tensor(dtype=common_pb2.D_TYPE_FLOAT32, shape=[1, vocab], data=b"\0" * 7))
    good_q = distributions_to_pb(torch.full((1, vocab), 1.0 / vocab), torch.float32, False, vocab)
    wrong_shape_q = distributions_to_pb(torch.full((2, vocab), 1.0 / vocab), torch.float32, False, vocab)
    INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
    cases = [
        ("out-of-vocab prompt id", lambda: verify.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=[1, vocab + 5])), INVALID),
        ("out-of-vocab draft id", lambda: verify.Verify(verify_pb2.VerifyRequest(session_id=session, draft_token_ids=[vocab])), INVALID),
        ("out-of-vocab accepted id", lambda: draft.Propose(draft_pb2.ProposeRequest(session_id=draft_session, accepted_token_ids=[vocab], num_draft_tokens=2)), INVALID),
        ("k too large (propose)", lambda: draft.Propose(draft_pb2.ProposeRequest(session_id=draft_session, accepted_token_ids=[4], num_draft_tokens=10_000)), INVALID),
        ("k too large (verify)", lambda: verify.Verify(verify_pb2.VerifyRequest(session_id=session, draft_token_ids=[1] * 500)), INVALID),
        ("empty prompt (verify)", lambda: verify.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=[])), INVALID),
        ("empty prompt (draft)", lambda: draft.OpenSession(draft_pb2.DraftOpenSessionRequest(prompt_token_ids=[])), INVALID),
        ("prompt over the context", lambda: verify.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=[1] * 5000)), INVALID),
        ("bad sampling params", lambda: verify.OpenSession(verify_pb2.VerifyOpenSessionRequest(
            prompt_token_ids=[1], sampling=common_pb2.SamplingParams(temperature=-1))), INVALID),
        ("unknown session (verify)", lambda: verify.Verify(verify_pb2.VerifyRequest(session_id="nope", draft_token_ids=[1])), NOT_FOUND),
        ("unknown session (draft)", lambda: draft.Propose(draft_pb2.ProposeRequest(session_id="nope", num_draft_tokens=1)), NOT_FOUND),
        ("unknown session (fork)", lambda: verify.Fork(verify_pb2.ForkRequest(session_id="nope", num_children=2)), NOT_FOUND),
        ("malformed Tensor bytes", lambda: verify.Verify(verify_pb2.VerifyRequest(session_id=session, draft_token_ids=[1], distributions=bad_q)), INVALID),
        ("q of the wrong shape", lambda: verify.Verify(verify_pb2.VerifyRequest(session_id=session, draft_token_ids=[1], distributions=wrong_shape_q)), INVALID),
        ("bad tree parents", lambda: verify.Verify(verify_pb2.VerifyRequest(session_id=session, draft_token_ids=[1, 2], tree_parents=[1, 0])), INVALID),
        ("KV pool full", lambda: verify_pb2_grpc.VerifyServiceStub(tiny_ch).OpenSession(
            verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=[1] * 100, sampling=greedy)), grpc.StatusCode.RESOURCE_EXHAUSTED),
    ]
    for name, call, expected in cases:
        assert _code(call) == expected, name
    # still serving: the session survived the rejected calls and verifies normally
    response = verify.Verify(verify_pb2.VerifyRequest(session_id=session, draft_token_ids=[4], distributions=good_q))
    assert len(response.accepted_token_ids) >= 1
    assert len(draft.Propose(draft_pb2.ProposeRequest(session_id=draft_session, accepted_token_ids=[4], num_draft_tokens=2)).draft_token_ids) == 2
    for ch in (verify_ch, draft_ch, tiny_ch):
        ch.close()


def _wait_for(predicate, timeout_s: float = 15.0) -> bool:
    return wait_for(predicate, timeout_s)


def test_ttl_reclaims_abandoned_sessions(cluster):
    handle, address = cluster["aux"]
    engine = handle.servicer.engine
    free_before = engine.num_free_blocks
    with grpc.insecure_channel(address) as ch:
        stub = verify_pb2_grpc.VerifyServiceStub(ch)
        ids = [stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(
            prompt_token_ids=[(i + j) % 50 + 1 for j in range(20)], sampling=common_pb2.SamplingParams(temperature=0))).session_id
            for i in range(100)]
        assert engine.num_free_blocks < free_before
        assert _wait_for(lambda: engine.num_free_blocks == free_before and len(handle.servicer.sessions) == 0)
        assert _code(lambda: stub.Verify(verify_pb2.VerifyRequest(session_id=ids[0]))) == grpc.StatusCode.NOT_FOUND


def test_a_cancelled_call_frees_its_session(cluster):
    handle, address = cluster["aux"]
    engine = handle.servicer.engine
    free_before = engine.num_free_blocks
    with grpc.insecure_channel(address) as ch:
        stub = verify_pb2_grpc.VerifyServiceStub(ch)
        session = stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=list(range(1, 40)))).session_id
        idle = stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=[1, 2])).session_id
        # with another session open, the batcher holds calls for 300 ms: a 50 ms deadline cancels the call while it waits
        code = _code(lambda: stub.Verify(verify_pb2.VerifyRequest(session_id=session, draft_token_ids=[1, 2]), timeout=0.05))
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        stub.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=idle))
        assert _wait_for(lambda: engine.num_free_blocks == free_before, 5.0)
        assert _code(lambda: stub.Verify(verify_pb2.VerifyRequest(session_id=session))) == grpc.StatusCode.NOT_FOUND
        # a cancelled Generate stream frees its sequence too
        stream = stub.Generate(verify_pb2.VerifyGenerateRequest(prompt_token_ids=[1, 2, 3], sampling=common_pb2.SamplingParams(
            temperature=0, max_new_tokens=400, ignore_eos=True)))
        next(stream)
        stream.cancel()
        assert _wait_for(lambda: engine.num_free_blocks == free_before, 5.0)


def test_health_serving_and_reflection_lists_the_services(cluster):
    for name, expected in (("verify", "specmesh.v1.VerifyService"), ("draft_self", "specmesh.v1.DraftService")):
        with grpc.insecure_channel(cluster[name][1]) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for service in ("", expected):
                assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == health_pb2.HealthCheckResponse.SERVING
            reflection = reflection_pb2_grpc.ServerReflectionStub(ch)
            responses = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            names = {s.name for r in responses for s in r.list_services_response.service}
            assert {expected, "grpc.health.v1.Health"} <= names


def test_step_generate_and_fork(cluster, models):
    prompt, params = PROMPTS[0], SamplingParams(**GREEDY)
    plain = generate(TargetVerifier(load_engine(models["target"], dtype="float64")), None, prompt, params)
    with grpc.insecure_channel(cluster["verify"][1]) as ch:
        stub = verify_pb2_grpc.VerifyServiceStub(ch)
        streamed = [t for r in stub.Generate(verify_pb2.VerifyGenerateRequest(prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(
            temperature=0, max_new_tokens=40, ignore_eos=True))) for t in r.token_ids]
        assert streamed == plain.token_ids
        opened = stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(temperature=0)))
        tokens = [opened.first_token_id]
        for _ in range(40):
            step = stub.Step(verify_pb2.StepRequest(session_id=opened.session_id))  # adaptive k, fused n-gram drafter
            tokens += step.result.accepted_token_ids
            if len(tokens) >= 40:
                break
        assert tokens[:40] == plain.token_ids
        forked = stub.Fork(verify_pb2.ForkRequest(session_id=opened.session_id, num_children=2))
        assert list(forked.next_token_ids) == [tokens[-1]] * 2
        first_child = forked.child_session_ids[0]
        after_pending = stub.Verify(verify_pb2.VerifyRequest(session_id=first_child)).accepted_token_ids[0]
        after_that = stub.Verify(verify_pb2.VerifyRequest(session_id=first_child)).accepted_token_ids[0]
        appended = stub.Fork(verify_pb2.ForkRequest(session_id=opened.session_id, num_children=1, append_token_ids=[after_pending]))
        child = appended.child_session_ids[0]
        assert appended.next_token_ids[0] == after_that  # a forced append == decoding the same token
        for session_id in (opened.session_id, child, *forked.child_session_ids):
            assert stub.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=session_id)).existed


def test_run_streams_the_sessions_rounds_and_a_cancel_frees_it(cluster, models):
    """Server-driven rounds: target-only, fused with the session's adaptive k, and fused with a fixed
    k each stream exactly the target-only tokens, round by round, ending at the finish; bad requests
    get clear codes; cancelling the stream closes the session and frees its KV blocks."""
    prompt, params = PROMPTS[0], SamplingParams(**GREEDY)
    plain = generate(TargetVerifier(load_engine(models["target"], dtype="float64")), None, prompt, params).token_ids
    handle, address = cluster["verify"]
    engine = handle.servicer.engine
    free_before = engine.num_free_blocks
    with grpc.insecure_channel(address) as ch:
        stub = verify_pb2_grpc.VerifyServiceStub(ch)

        def open_session() -> tuple[str, int]:
            opened = stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(
                temperature=0, max_new_tokens=40, ignore_eos=True)))
            return opened.session_id, opened.first_token_id

        for draft, k in ((False, 0), (True, 0), (True, 3)):
            session_id, first = open_session()
            responses = list(stub.Run(verify_pb2.RunRequest(session_id=session_id, draft=draft, num_draft_tokens=k), timeout=TIMEOUT_S))
            tokens = [first] + [t for r in responses for t in r.result.accepted_token_ids]
            assert tokens == plain, (draft, k)
            assert [r.result.round_index for r in responses] == list(range(len(responses)))
            assert responses[-1].result.finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert all(r.result.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for r in responses[:-1])
            if not draft:
                assert all(r.num_draft_tokens == 0 for r in responses) and len(responses) == len(plain) - 1
            elif k:  # a fixed k drafts every round, up to k
                assert sum(r.num_draft_tokens for r in responses) > 0
                assert max(r.num_draft_tokens for r in responses) <= k
            # an adaptive k drafts what its costs say pays: the service's fitted forward cost (earlier tests' rounds
            # on this module's services) prices the first draft, so on these tiny models it may draft nothing
            # the session has finished: no more rounds, by Run or Step
            again = verify_pb2.RunRequest(session_id=session_id)
            assert _code(lambda: list(stub.Run(again))) == grpc.StatusCode.FAILED_PRECONDITION  # noqa: B023
            assert stub.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=session_id)).existed

        # max_rounds: a bounded stretch of rounds; the session stays open for the caller's next round
        session_id, first = open_session()
        stretch = list(stub.Run(verify_pb2.RunRequest(session_id=session_id, round_index=0, max_rounds=3), timeout=TIMEOUT_S))
        assert [r.result.round_index for r in stretch] == [0, 1, 2]
        one = stub.Verify(verify_pb2.VerifyRequest(session_id=session_id, round_index=3))
        rest = list(stub.Run(verify_pb2.RunRequest(session_id=session_id, round_index=4), timeout=TIMEOUT_S))
        tokens = [first, *(t for r in stretch for t in r.result.accepted_token_ids), *one.accepted_token_ids,
                  *(t for r in rest for t in r.result.accepted_token_ids)]
        assert tokens == plain and rest[-1].result.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert stub.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=session_id)).existed

        session_id, _ = open_session()
        assert _code(lambda: list(stub.Run(verify_pb2.RunRequest(session_id=session_id, num_draft_tokens=2)))) == \
            grpc.StatusCode.INVALID_ARGUMENT  # a k without drafting
        assert _code(lambda: list(stub.Run(verify_pb2.RunRequest(session_id=session_id, round_index=3)))) == \
            grpc.StatusCode.FAILED_PRECONDITION  # the session has done 0 rounds
        assert _code(lambda: list(stub.Run(verify_pb2.RunRequest(session_id="0" * 32)))) == grpc.StatusCode.NOT_FOUND
        stream = stub.Run(verify_pb2.RunRequest(session_id=session_id, round_index=0))
        next(stream)
        stream.cancel()
        assert _wait_for(lambda: engine.num_free_blocks == free_before, 5.0)
        assert _code(lambda: stub.Verify(verify_pb2.VerifyRequest(session_id=session_id))) == grpc.StatusCode.NOT_FOUND


def test_an_ngram_draft_carries_its_acceptance_estimate_over_the_wire(cluster):
    """The n-gram Draft service reports its first token's estimated acceptance, which the adapter
    hands to the loop's gate (SpeculationState.gate); a model drafter reports none."""
    from servicekit.remote import RemoteDrafter

    async def propose(name: str):
        async with channel(cluster[name][1]) as ch:
            drafter = RemoteDrafter(draft_pb2_grpc.DraftServiceStub(ch))
            session = await drafter.open(PROMPTS[0], SamplingParams(**GREEDY))
            proposal = await drafter.propose(session, [5], 3)
            await drafter.close(session)
            return proposal

    ngram = asyncio.run(propose("draft_ngram"))
    assert ngram.token_ids and ngram.acceptance is not None and 0.0 < ngram.acceptance < 1.0
    assert asyncio.run(propose("draft_self")).acceptance is None


def test_a_run_with_a_stream_interval_sends_its_rounds_joined_and_unchanged(cluster, models):
    """stream_interval_ms: the first round goes alone, the rounds made meanwhile go with the last
    (which goes at once) in later_rounds, in order; tokens and round indices are those of a Run
    without it; a bounded Run's last rounds go at its end. Past the bound: INVALID_ARGUMENT."""
    prompt, params = PROMPTS[1], SamplingParams(**GREEDY)
    plain = generate(TargetVerifier(load_engine(models["target"], dtype="float64")), None, prompt, params).token_ids
    with grpc.insecure_channel(cluster["verify"][1]) as ch:
        stub = verify_pb2_grpc.VerifyServiceStub(ch)
        opened = stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(
            temperature=0, max_new_tokens=40, ignore_eos=True)))
        # 60 s: every round after the first waits for the last (tiny rounds: all within it)
        messages = list(stub.Run(verify_pb2.RunRequest(session_id=opened.session_id, stream_interval_ms=10_000,
                                                       max_rounds=3), timeout=TIMEOUT_S))
        assert [[r.result.round_index for r in (m, *m.later_rounds)] for m in messages] == [[0], [1, 2]]
        messages += list(stub.Run(verify_pb2.RunRequest(session_id=opened.session_id, round_index=3,
                                                        stream_interval_ms=10_000), timeout=TIMEOUT_S))
        rounds = [r for m in messages for r in (m, *m.later_rounds)]
        assert len(messages) == 4 and not messages[2].later_rounds  # each Run's first round alone
        assert [r.result.round_index for r in rounds] == list(range(len(plain) - 1))
        assert [opened.first_token_id, *(t for r in rounds for t in r.result.accepted_token_ids)] == plain
        assert rounds[-1].result.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert stub.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=opened.session_id)).existed
        too_long = verify_pb2.RunRequest(session_id=opened.session_id, stream_interval_ms=10_001)
        assert _code(lambda: list(stub.Run(too_long))) == grpc.StatusCode.INVALID_ARGUMENT


def test_a_remote_verifier_with_a_stream_interval_yields_every_round(cluster, models):
    prompt, params = PROMPTS[0], SamplingParams(**GREEDY)
    plain = generate(TargetVerifier(load_engine(models["target"], dtype="float64")), None, prompt, params).token_ids

    async def main():
        async with channel(cluster["verify"][1]) as ch:
            remote = RemoteVerifier(verify_pb2_grpc.VerifyServiceStub(ch), stream_interval_ms=10_000)
            session_id, first = await remote.open(prompt, params)
            rounds = [r async for r in remote.run(session_id, draft=False)]
            await remote.close(session_id)
            return first, rounds

    first, rounds = asyncio.run(main())
    assert [first, *(t for _, outcome, _, _ in rounds for t in outcome.token_ids)] == plain
    assert [finish for *_, finish, _ in rounds].count(None) == len(rounds) - 1
