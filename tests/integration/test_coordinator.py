"""The Coordinator over live Draft and Verify services (in-process, loopback, ports at run time):
exact greedy output in every mode, seeded sampling equal to the in-process run, many streams at
once batched by the Verify service, failover of a dead draft and a dead verify replica with no token
repeated or lost, UNAVAILABLE when no verify replica is left. Tiny random models."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from coordinator.options import CoordinatorOptions
from coordinator.server import create_server as create_coordinator
from draft_service.options import DraftOptions
from draft_service.server import create_server as create_draft
from servicekit.background import BackgroundServices
from servicekit.channels import open_channel as channel
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.speculative import generate
from specmesh.decoding.verifier import TargetVerifier
from specmesh.drafters.ngram import PromptLookupDrafter
from specmesh.models.load import load_engine
from specmesh.proto.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from target_service.options import VerifyOptions
from target_service.server import create_server as create_verify

TIMEOUT_S = 60
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
MODES = {"speculative": coordinator_pb2.GENERATION_MODE_SPECULATIVE, "fused": coordinator_pb2.GENERATION_MODE_FUSED,
         "autoregressive": coordinator_pb2.GENERATION_MODE_AUTOREGRESSIVE}


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return str(tiny_model_dir("llama", init_std=0.2))


@pytest.fixture(scope="module")
def tokenizer(target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target)


def _reference(target: str, tokenizer, prompt: str, params: SamplingParams, drafter=None) -> list[int]:
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    return generate(TargetVerifier(load_engine(target, dtype="float64")), drafter, ids, params).token_ids


def _request(prompt: str, mode: str, drafter: str = "", k: int = 0, **sampling) -> coordinator_pb2.GenerateRequest:
    sampling = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 40, **sampling}
    return coordinator_pb2.GenerateRequest(prompt=prompt, mode=MODES[mode], drafter=drafter, num_draft_tokens=k,
                                           sampling=common_pb2.SamplingParams(**sampling))


async def _collect(address: str, request) -> tuple[list[int], coordinator_pb2.GenerateResponse]:
    async with channel(address) as ch:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        tokens, last = [], None
        async for response in stub.Generate(request, timeout=TIMEOUT_S):
            tokens += response.token_ids
            last = response
        return tokens, last


class Cluster:
    """Verify replicas, a Draft service and a Coordinator over them, started in the test's loop thread."""

    def __init__(self, target: str, num_verify: int = 1, device: str = "cpu", fused_drafter: str = "ngram",
                 **coordinator_options):
        self.services = BackgroundServices()
        common = dict(model=target, dtype="float64", port=0, device=device)
        self.verify = [self.services.start(create_verify(VerifyOptions(**common, batch_window_ms=5.0, max_kv_tokens=16384,
                                                                       fused_drafter=fused_drafter)))
                       for _ in range(num_verify)]
        self.draft = self.services.start(create_draft(DraftOptions(model=target, dtype="float64", port=0, device=device)))
        links = dict(model=target, port=0, health_interval_s=0.2, draft_addresses=f"127.0.0.1:{self.draft.port}",
                     verify_addresses=",".join(f"127.0.0.1:{h.port}" for h in self.verify))
        self.coordinator = self.services.start(create_coordinator(CoordinatorOptions(**links, **coordinator_options)))
        self.address = f"127.0.0.1:{self.coordinator.port}"
        # a second coordinator over the same services that makes n-gram drafts itself (ngram_placement)
        here = {"ngram_placement": "coordinator", **coordinator_options}
        self.ngram_here = self.services.start(create_coordinator(CoordinatorOptions(**links, **here)))
        self.ngram_here_address = f"127.0.0.1:{self.ngram_here.port}"
        # and one that places model drafts on the Verify service, where it hosts a model drafter (model_placement)
        self.model_on_verify = self.services.start(create_coordinator(CoordinatorOptions(
            **links, **{"model_placement": "verify", **coordinator_options})))
        self.addresses = {"coordinator": self.ngram_here_address, "model-verify": f"127.0.0.1:{self.model_on_verify.port}"}

    def address_for(self, placement: str) -> str:
        return self.addresses.get(placement, self.address)

    def stop(self, handle) -> None:
        self.services.stop(handle)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.services.close()


@pytest.fixture(scope="module")
def cluster(target):
    with Cluster(target, fused_drafter="ngram,model") as c:  # the Verify service hosts both: a request picks
        yield c


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


@pytest.mark.parametrize("mode,drafter,k,placement,drafted_by,plan", [
    ("speculative", "service", 4, "verify", "draft-service", "client_rounds_plain_runs"),
    ("speculative", "service", 0, "verify", "draft-service", "client_rounds_plain_runs"),
    # the Verify service hosts the n-gram drafter: drafts there
    ("speculative", "ngram", 3, "verify", "ngram@verify", "fused_run"),
    ("speculative", "ngram", 3, "coordinator", "ngram", "client_rounds_plain_runs"),
    ("speculative", "ngram", 0, "coordinator", "ngram", "client_rounds_plain_runs"),
    ("fused", "", 3, "verify", "fused", "fused_run"), ("autoregressive", "", 0, "verify", "", "server_run"),
    # model drafts placed on the Verify service (model_placement: verify): its hosted self-draft steps the rounds
    ("speculative", "service", 4, "model-verify", "model@verify", "fused_run"),
    ("speculative", "service", 0, "model-verify", "model@verify", "fused_run"),
    ("speculative", "ngram", 3, "model-verify", "ngram@verify", "fused_run")])
def test_greedy_through_the_coordinator_equals_target_only(cluster, target, tokenizer, mode, drafter, k, placement,
                                                           drafted_by, plan):
    tokens, last = _run(_collect(cluster.address_for(placement), _request(PROMPT, mode, drafter, k)))
    assert tokens == _reference(target, tokenizer, PROMPT, SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=40))
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert last.stats.num_generated_tokens == 40 and last.stats.num_failovers == 0
    if mode != "autoregressive" and k:
        assert last.stats.num_draft_tokens > 0  # a fixed k drafts every round
    # (adaptive k drafts, withholds drafts, or, where the services' measured costs say no draft can pay, decodes
    # the request plainly in one Run: which one depends on this machine's timings; the tokens are the same)
    assert last.stats.drafter == drafted_by
    assert last.stats.plan == plan  # the plan chosen (specmesh.decoding.plan), named in the final stats


def test_the_verify_services_hosted_model_drafter_remembers_its_acceptance_across_sessions(cluster, target, tokenizer):
    """A request whose model drafts run on the Verify service (fused; its session's adaptive policy hears the
    rounds even at a fixed k) leaves the hosted drafter's acceptance behind (`AcceptanceMemory`, greedy and
    sampled apart), and the next greedy session's policy starts from it; a fused n-gram session remembers
    nothing (its acceptance is the prompt's). Tokens unchanged."""
    from specmesh.decoding.adaptive import AdaptiveK

    servicer = cluster.verify[0].servicer
    expected = _reference(target, tokenizer, PROMPT, SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=40))
    seen: list[AdaptiveK] = []
    fused_round = servicer._fused_round

    async def recording(session_id, session, *args, **kwargs):
        response = await fused_round(session_id, session, *args, **kwargs)
        policy = session.round.k_policy  # (by identity: the policies are dataclasses, equal when their fields are)
        if session.fused is not None and session.fused.name == "model" and all(policy is not p for p in seen):
            seen.append(policy)
        return response

    servicer._fused_round = recording
    try:
        for k in (4, 4):  # a fixed k drafts every round, whatever this machine's costs (the policy still hears them)
            tokens, last = _run(_collect(cluster.address_for("model-verify"), _request(PROMPT, "speculative", "service", k)))
            assert tokens == expected and last.stats.drafter == "model@verify"
        tokens, _ = _run(_collect(cluster.address_for("model-verify"), _request(PROMPT, "speculative", "ngram", 0)))
        assert tokens == expected
    finally:
        servicer._fused_round = fused_round
    memory = servicer._acceptance.get(("model", True))
    assert len(seen) == 2 and all(p.memory is memory for p in seen) and memory is not None
    assert memory.acceptance is not None and seen[1]._seeded
    assert ("ngram", True) not in servicer._acceptance
    # client rounds drafted by the Draft service keep theirs in the Coordinator, per drafter; n-gram drafts made
    # in the Coordinator none
    coordinator = cluster.ngram_here.servicer
    for drafter in ("service", "ngram"):
        tokens, last = _run(_collect(cluster.ngram_here_address, _request(PROMPT, "speculative", drafter, 0)))
        assert tokens == expected
    assert ("service", True) in coordinator.acceptance and not any(key[0] == "ngram" for key in coordinator.acceptance)


def test_a_verify_service_hosting_two_drafters_drafts_with_the_one_named(cluster, tokenizer):
    """GetInfo lists both hosted drafters; a Step names one (a session keeps it: another name is
    FAILED_PRECONDITION); a name not hosted is INVALID_ARGUMENT."""
    from specmesh.proto.v1 import verify_pb2, verify_pb2_grpc

    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    greedy = common_pb2.SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=16)

    async def main():
        async with channel(f"127.0.0.1:{cluster.verify[0].port}") as ch:
            stub = verify_pb2_grpc.VerifyServiceStub(ch)
            hosted = (await stub.GetInfo(verify_pb2.VerifyGetInfoRequest(), timeout=TIMEOUT_S)).fused_drafter
            opened = await stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=prompt, sampling=greedy),
                                            timeout=TIMEOUT_S)
            step = await stub.Step(verify_pb2.StepRequest(session_id=opened.session_id, num_draft_tokens=3,
                                                          fused_drafter="model"), timeout=TIMEOUT_S)
            codes = []
            for name, session_id in (("ngram", opened.session_id), ("bogus", opened.session_id)):
                try:
                    await stub.Step(verify_pb2.StepRequest(session_id=session_id, num_draft_tokens=3, fused_drafter=name),
                                    timeout=TIMEOUT_S)
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code())
            await stub.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=opened.session_id), timeout=TIMEOUT_S)
            return hosted, step, codes

    hosted, step, codes = _run(main())
    assert hosted == "ngram,model"
    assert step.num_draft_tokens == 3  # a model drafter always drafts k (an n-gram lookup may find nothing)
    assert codes == [grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT]


def test_a_hosted_model_draft_is_priced_by_the_sessions_drafting_with_forwards(cluster, tokenizer):
    """Fused model drafts are not batched across sessions (the engine thread runs each session's in turn),
    so a draft token costs a session's rounds its forward's time times the sessions drafting so; n-gram
    drafts cost nothing there and count for nothing."""
    from specmesh.proto.v1 import verify_pb2, verify_pb2_grpc

    servicer = cluster.verify[0].servicer
    model, ngram = servicer.fused_drafters["model"], servicer.fused_drafters["ngram"]
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    greedy = common_pb2.SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=16)

    async def main():
        async with channel(f"127.0.0.1:{cluster.verify[0].port}") as ch:
            stub = verify_pb2_grpc.VerifyServiceStub(ch)
            opened = [await stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=prompt, sampling=greedy),
                                             timeout=TIMEOUT_S) for _ in range(3)]
            priced = []
            for session, name in zip(opened, ("model", "model", "ngram")):
                await stub.Step(verify_pb2.StepRequest(session_id=session.session_id, num_draft_tokens=2, fused_drafter=name),
                                timeout=TIMEOUT_S)
                priced.append(servicer._fused_ms_per_token(model) / model.ms_per_token)
            await stub.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=opened[0].session_id), timeout=TIMEOUT_S)
            priced.append(servicer._fused_ms_per_token(model) / model.ms_per_token)
            for session in opened[1:]:
                await stub.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=session.session_id), timeout=TIMEOUT_S)
            return priced

    assert _run(main()) == pytest.approx([1.0, 2.0, 2.0, 1.0])
    assert servicer._fused_ms_per_token(ngram) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_services_on_a_cuda_device_give_the_cpu_tokens(target, tokenizer):
    """Draft and Verify services on CUDA (every mode, 8 streams at once, batched): the CPU engine's
    greedy tokens, so no tensor is left on the wrong device along the services' paths."""
    params = SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=40)
    prompts = [f"{PROMPT} {i}" for i in range(8)]
    with Cluster(target, device="cuda") as c:
        cases = [("speculative", "service", 4, "verify"), ("speculative", "service", 0, "verify"),
                 ("speculative", "ngram", 0, "verify"), ("speculative", "ngram", 3, "coordinator"),
                 ("fused", "", 0, "verify"), ("autoregressive", "", 0, "verify")]
        for mode, drafter, k, placement in cases:
            tokens, last = _run(_collect(c.address_for(placement), _request(PROMPT, mode, drafter, k)))
            assert tokens == _reference(target, tokenizer, PROMPT, params), (mode, drafter, k, placement)
            assert last.stats.num_failovers == 0
        engine = c.verify[0].servicer.engine
        forwards, sessions = engine.stats.num_forwards, engine.stats.num_sequences_forwarded

        async def many():
            return await asyncio.gather(*(_collect(c.address, _request(p, "speculative", "service", 0)) for p in prompts))

        for prompt, (tokens, _) in zip(prompts, _run(many())):
            assert tokens == _reference(target, tokenizer, prompt, params)
        assert (engine.stats.num_sequences_forwarded - sessions) / (engine.stats.num_forwards - forwards) > 1.5


def test_rounds_driven_by_the_coordinator_give_the_same_tokens(target, tokenizer):
    """server_rounds off: fused and target-only rounds are one Step / Verify call each, as before Run."""
    params = SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=40)
    reference = _reference(target, tokenizer, PROMPT, params)
    with Cluster(target, server_rounds=False) as c:
        for mode in ("fused", "autoregressive"):
            tokens, last = _run(_collect(c.address, _request(PROMPT, mode)))
            assert tokens == reference, mode
            assert last.stats.plan == ("plain_rounds" if mode == "autoregressive" else "fused_step")
            if mode == "autoregressive":
                assert last.stats.num_target_forwards == len(tokens) and last.stats.num_draft_tokens == 0
            else:
                assert last.stats.num_draft_tokens > 0


def test_plain_stretches_of_a_speculative_request_run_on_the_verify_service(cluster, target, tokenizer):
    """Adaptive k with the coordinator's n-gram drafter on text it rarely predicts: the rounds where
    drafting does not pay come in growing plain stretches, each one Verify.Run call (max_rounds)
    instead of a Verify call per round; the tokens are target-only greedy's."""
    registry = cluster.verify[0].servicer.metrics.registry

    def calls(method: str) -> float:
        return registry.get_sample_value("specmesh_requests_total", {"method": method, "code": "OK"}) or 0.0

    before = calls("Run"), calls("Verify")
    tokens, last = _run(_collect(cluster.ngram_here_address, _request(PROMPT, "speculative", "ngram", 0, max_new_tokens=80)))
    assert tokens == _reference(target, tokenizer, PROMPT, SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=80))
    stretches, single_rounds = calls("Run") - before[0], calls("Verify") - before[1]
    assert stretches >= 3  # 1, 2, 4, 8 ... rounds each
    rounds = last.stats.num_target_forwards - 1  # after the prefill
    assert single_rounds < rounds / 2  # most rounds ran inside stretches


@pytest.mark.parametrize("placement", ["verify", "coordinator"])
def test_seeded_sampling_equals_the_in_process_run(cluster, target, tokenizer, placement):
    params = SamplingParams(temperature=1.2, seed=7, ignore_eos=True, max_new_tokens=30)
    tokens, _ = _run(_collect(cluster.address_for(placement), _request(PROMPT, "speculative", "ngram", 3, temperature=1.2,
                                                                       seed=7, max_new_tokens=30)))
    # n-gram drafts are deterministic: the seeded speculative run equals plain sampling (rejection.py)
    assert tokens == _reference(target, tokenizer, PROMPT, params)
    assert tokens == _reference(target, tokenizer, PROMPT, params, PromptLookupDrafter(min_n=1, max_n=4))


@pytest.mark.parametrize("mode", ["", "autoregressive", "fused"])
def test_text_and_chat_and_stop_strings(cluster, tokenizer, mode):
    """The default mode, and the streamed rounds of Run, which a stop string ends early."""
    request = coordinator_pb2.GenerateRequest(
        chat=coordinator_pb2.ChatMessages(messages=[coordinator_pb2.ChatMessage(role="user", content="Name a capital.")]),
        sampling=common_pb2.SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True), mode=MODES.get(mode, 0))

    async def main():
        async with channel(cluster.address) as ch:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
            return [r async for r in stub.Generate(request, timeout=TIMEOUT_S)]

    responses = _run(main())
    tokens = [t for r in responses for t in r.token_ids]
    assert "".join(r.text for r in responses) == tokenizer.decode(tokens, skip_special_tokens=True)
    text = "".join(r.text for r in responses)
    stop = text[len(text) // 2:][:3]
    if stop.strip():
        request.sampling.stop.append(stop)
        cut = _run(main())
        assert cut[-1].finish_reason == common_pb2.FINISH_REASON_STOP
        assert "".join(r.text for r in cut) == text[:text.index(stop)]  # the stop string itself is not sent


@pytest.mark.parametrize("mode,drafter,k", [("autoregressive", "", 0), ("fused", "", 3), ("speculative", "service", 2),
                                           ("speculative", "ngram", 3)])
def test_a_stream_interval_joins_the_messages_and_changes_no_token(cluster, target, tokenizer, mode, drafter, k):
    """GenerateRequest.stream_interval_ms: the first token alone at once, what comes within the
    interval (here all of it) joined with the last message, which goes at once; the tokens, text and
    finish are a stream's without it. A stop string still ends it where it did; past the bound:
    INVALID_ARGUMENT."""
    request = _request(PROMPT, mode, drafter, k)
    tokens, last = _run(_collect(cluster.address, request))
    request.stream_interval_ms = 10_000

    async def main():
        async with channel(cluster.address) as ch:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
            return [r async for r in stub.Generate(request, timeout=TIMEOUT_S)]

    joined = _run(main())
    assert [len(r.token_ids) for r in joined] == [1, len(tokens) - 1]
    assert [t for r in joined for t in r.token_ids] == tokens
    assert "".join(r.text for r in joined) == tokenizer.decode(tokens, skip_special_tokens=True)
    assert joined[-1].finish_reason == last.finish_reason and joined[-1].stats.num_generated_tokens == len(tokens)
    assert joined[-1].mode_choice.mode == MODES[mode]
    text = "".join(r.text for r in joined)
    stop = text[len(text) // 2:][:3]
    if stop.strip():
        request.sampling.stop.append(stop)
        cut = _run(main())
        assert cut[-1].finish_reason == common_pb2.FINISH_REASON_STOP and "".join(r.text for r in cut) == text[:text.index(stop)]
    request.stream_interval_ms = 10_001
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        _run(main())
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_caller_that_reads_the_whole_answer_gets_no_messages_between(cluster):
    """CoordinatorClient.collect without on_text asks for no messages between the first tokens and the last
    (`whole_answer_interval_ms`); with on_text, or with stop strings (the Verify service does not know them),
    the coordinator's interval (here each round). The tokens are the same."""
    from client.coordinator_client import CoordinatorClient

    async def main():
        async with CoordinatorClient(cluster.address) as client:
            asked, counts = [], []
            generate_ = client.generate

            async def counting(prompt, **kwargs):
                asked.append(kwargs.get("stream_interval_ms"))
                counts.append(0)
                async for chunk in generate_(prompt, **kwargs):
                    counts[-1] += 1
                    yield chunk

            client.generate = counting
            request = dict(mode="autoregressive", max_new_tokens=16, ignore_eos=True)
            whole = await client.collect(PROMPT, **request)
            streamed = await client.collect(PROMPT, on_text=lambda text: None, **request)
            stopped = await client.collect(PROMPT, stop=["never in this text"], **request)
            return whole, streamed, stopped, asked, counts

    whole, streamed, stopped, asked, counts = _run(main())
    assert whole.token_ids == streamed.token_ids == stopped.token_ids and len(whole.token_ids) == 16
    assert asked == [10_000, None, None] and counts == [2, 16, 16]


def test_concurrent_streams_are_exact_and_batched(cluster, target, tokenizer):
    prompts = [f"{PROMPT} {i}" for i in range(16)]
    engine = cluster.verify[0].servicer.engine
    forwards_before = engine.stats.num_forwards
    sessions_before = engine.stats.num_sequences_forwarded

    async def main():
        return await asyncio.gather(*(_collect(cluster.address, _request(p, "speculative", "ngram", 3, max_new_tokens=20))
                                      for p in prompts))

    results = _run(main())
    params = SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=20)
    for prompt, (tokens, _) in zip(prompts, results):
        assert tokens == _reference(target, tokenizer, prompt, params)
    forwards = engine.stats.num_forwards - forwards_before
    sessions = engine.stats.num_sequences_forwarded - sessions_before
    assert sessions / forwards > 1.5, f"{sessions} sessions in {forwards} forwards: no batching"


def test_bad_requests_get_clear_codes(cluster):
    async def code(request) -> grpc.StatusCode:
        try:
            await _collect(cluster.address, request)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    assert _run(code(coordinator_pb2.GenerateRequest())) == grpc.StatusCode.INVALID_ARGUMENT
    assert _run(code(_request(PROMPT, "speculative", "bogus"))) == grpc.StatusCode.INVALID_ARGUMENT
    assert _run(code(_request(PROMPT, "speculative", top_p=float("nan"), temperature=1.0))) == grpc.StatusCode.INVALID_ARGUMENT


def _stream_with_failure(cluster: Cluster, request, kill, after_tokens: int = 10):
    """Stream `request`; once `after_tokens` arrived, run `kill()` (in a thread: it stops a service)."""
    async def main():
        async with channel(cluster.address) as ch:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
            tokens, last, killed = [], None, False
            async for response in stub.Generate(request, timeout=TIMEOUT_S):
                tokens += response.token_ids
                last = response
                if not killed and len(tokens) >= after_tokens:
                    killed = True
                    await asyncio.to_thread(kill)
            return tokens, last

    return _run(main())


def test_a_dead_draft_service_falls_back_and_the_output_stays_exact(target, tokenizer):
    with Cluster(target) as c:
        request = _request(PROMPT, "speculative", "service", 2, max_new_tokens=60)
        tokens, last = _stream_with_failure(c, request, lambda: c.stop(c.draft))
        assert tokens == _reference(target, tokenizer, PROMPT, SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=60))
        assert last.stats.drafter == "ngram" and last.stats.num_failovers == 1
        assert last.stats.failovers[0].startswith("draft ")
        again, last = _run(_collect(c.address, request))  # later requests: no draft replica, n-gram from the start
        assert again == tokens and last.stats.drafter == "ngram"


MOVE_TOKENS = 200


@pytest.mark.parametrize("mode,drafter,k,interval_ms", [("speculative", "ngram", 3, 0), ("autoregressive", "", 0, 0),
                                                        ("fused", "", 0, 0), ("autoregressive", "", 0, 20)])
def test_a_dead_verify_replica_moves_the_stream_with_no_token_lost(target, tokenizer, mode, drafter, k, interval_ms):
    """Per-round Verify calls, and the streamed rounds of Run (autoregressive and fused modes; also
    with a stream interval, whose rounds still held by the dead replica are lost with it)."""
    with Cluster(target, num_verify=2, ngram_placement="coordinator") as c:  # speculative: a Verify call per round
        request = _request(PROMPT, mode, drafter, k, max_new_tokens=MOVE_TOKENS)  # long enough to be mid-stream at the kill
        request.stream_interval_ms = interval_ms
        used: list = []

        def kill_the_busy_one() -> None:
            busy = next(h for h in c.verify if h.servicer.num_sessions)
            used.append(busy)
            c.stop(busy)

        tokens, last = _stream_with_failure(c, request, kill_the_busy_one)
        assert tokens == _reference(target, tokenizer, PROMPT, SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=MOVE_TOKENS))
        assert last.stats.num_failovers == 1 and last.stats.failovers[0].startswith("verify ")
        # the last one down: UNAVAILABLE, within the deadline
        c.stop(next(h for h in c.verify if h is not used[0]))

        async def code() -> grpc.StatusCode:
            try:
                await asyncio.wait_for(_collect(c.address, request), 20)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

        assert _run(code()) == grpc.StatusCode.UNAVAILABLE
