"""The lossless cascade over the wire: Draft service -> Stage service(s) -> Verify service, on loopback
ports picked at run time, driven by the async driver through `AsyncCascadeDrafter` and
`RemoteStage`. Greedy: identical to target-only decoding. Sampled: the same tokens as the same
cascade in-process for the same seed (the stage's q crosses the wire bit for bit), with the coupled
rule the target-only tokens of the seed, and a stage that goes away mid-request is skipped without
changing the output."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from draft_service.options import DraftOptions
from draft_service.server import create_server as create_draft
from servicekit.background import BackgroundServices
from servicekit.remote import RemoteDrafter, RemoteVerifier
from servicekit.remote_stage import RemoteStage
from specmesh.cascade.pipeline import AsyncCascadeDrafter, CascadeDrafter
from specmesh.cascade.plan import StageSpec
from specmesh.cascade.stage_model import StageModel
from specmesh.decoding.adaptive import FixedK
from specmesh.decoding.async_driver import speculative_stream_async
from specmesh.decoding.sampling import AcceptanceRule, SamplingParams
from specmesh.decoding.speculative import generate
from specmesh.decoding.verifier import TargetVerifier
from specmesh.drafters.model import ModelDrafter
from specmesh.models.load import load_engine
from specmesh.proto.v1 import draft_pb2_grpc, stage_pb2_grpc, verify_pb2_grpc
from stage_service.options import StageOptions
from stage_service.server import create_server as create_stage
from target_service.options import VerifyOptions
from target_service.server import create_server as create_verify

PROMPT = [5, 17, 33, 5, 17, 33, 5, 17]
SPECS = [StageSpec(), StageSpec(num_extend_tokens=2)]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    folders = {name: str(tiny_model_dir("llama", seed=1, init_std=std))
               for name, std in (("target", 0.2), ("stage", 0.15), ("stage_low", 0.12), ("draft", 0.1))}
    with BackgroundServices() as services:
        ports = {
            "draft": services.start(create_draft(DraftOptions(model=folders["draft"], dtype="float64", port=0))).port,
            "stage_low": services.start(create_stage(StageOptions(model=folders["stage_low"], dtype="float64", port=0))).port,
            "stage": services.start(create_stage(StageOptions(model=folders["stage"], dtype="float64", port=0))).port,
            "verify": services.start(create_verify(VerifyOptions(model=folders["target"], dtype="float64", port=0))).port,
        }
        yield folders, ports, services


def _over_the_wire(ports, params, stage_names=("stage_low", "stage"), dead_port=None, on_event=None, specs=SPECS):
    """(tokens, stats, failed stage indices). `dead_port`: a third stage in the middle whose service is
    gone (every call: UNAVAILABLE). `on_event(i)` runs after the i-th event."""
    async def run():
        channels = {name: grpc.aio.insecure_channel(f"127.0.0.1:{port}") for name, port in ports.items()}
        try:
            stages = [RemoteStage(stage_pb2_grpc.StageServiceStub(channels[name]), timeout_s=30) for name in stage_names]
            stage_specs = list(specs[:len(stages)])
            if dead_port is not None:
                channels["dead"] = grpc.aio.insecure_channel(f"127.0.0.1:{dead_port}")
                info = await stages[0].info()
                stages.insert(1, RemoteStage(stage_pb2_grpc.StageServiceStub(channels["dead"]), timeout_s=5, info=info))
                stage_specs.insert(1, StageSpec())
            failed = []

            def stage_failed(index, exc):
                failed.append(index)
                return isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE

            drafter = AsyncCascadeDrafter(RemoteDrafter(draft_pb2_grpc.DraftServiceStub(channels["draft"])), stages, stage_specs,
                                          is_stage_failure=stage_failed)
            verifier = RemoteVerifier(verify_pb2_grpc.VerifyServiceStub(channels["verify"]))
            events = []
            async for event in speculative_stream_async(verifier, drafter, PROMPT, params, k_policy=FixedK(4)):
                events.append(event)
                if on_event is not None:
                    on_event(len(events) - 1)
            return [t for e in events for t in e.token_ids], events[-1].stats, failed
        finally:
            for channel in channels.values():
                await channel.close()
    return asyncio.run(run())


def _in_process(folders, params, specs=SPECS):
    target = TargetVerifier(load_engine(folders["target"], dtype="float64"))
    drafter = CascadeDrafter(ModelDrafter(load_engine(folders["draft"], dtype="float64")),
                             [StageModel(load_engine(folders[name], dtype="float64")) for name in ("stage_low", "stage")], specs)
    return generate(target, drafter, PROMPT, params, k_policy=FixedK(4)).token_ids


def test_greedy_cascade_over_the_wire_equals_target(cluster):
    folders, ports, _ = cluster
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    plain = generate(TargetVerifier(load_engine(folders["target"], dtype="float64")), None, PROMPT, params).token_ids
    tokens, stats, failed = _over_the_wire(ports, params)
    assert tokens == plain and not failed
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # the target rejected part of the stages' work


@pytest.mark.parametrize("seed", [3, 11])
def test_sampled_cascade_over_the_wire_equals_in_process(cluster, seed):
    folders, ports, _ = cluster
    params = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=30, ignore_eos=True, seed=seed,
                            acceptance_rule=AcceptanceRule.STANDARD)  # q goes up each level
    tokens, _, failed = _over_the_wire(ports, params)
    assert tokens == _in_process(folders, params) and not failed


def test_a_filling_cascade_over_the_wire_equals_target_and_in_process(cluster):
    """The top stage fills the target's k (`StageSpec.fill`): greedy gives the target-only tokens; sampled
    (q up each level) the in-process cascade's, seed for seed."""
    folders, ports, _ = cluster
    specs = [StageSpec(), StageSpec(fill=True)]
    greedy = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    tokens, stats, failed = _over_the_wire(ports, greedy, specs=specs)
    assert tokens == generate(TargetVerifier(load_engine(folders["target"], dtype="float64")), None, PROMPT, greedy).token_ids
    assert not failed and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    sampled = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=30, ignore_eos=True, seed=7,
                             acceptance_rule=AcceptanceRule.STANDARD)
    tokens, _, failed = _over_the_wire(ports, sampled, specs=specs)
    assert tokens == _in_process(folders, sampled, specs) and not failed


def test_a_stage_extending_ahead_changes_no_token(cluster):
    """A Stage service with `draft_ahead` runs its own tokens on while the target verifies, and answers calls
    from them: greedy, the target-only tokens, with some calls answered from tokens ahead; sampled (no
    extending ahead there), the in-process cascade's tokens, seed for seed."""
    folders, ports, services = cluster
    handle = services.start(create_stage(StageOptions(model=folders["stage"], dtype="float64", port=0, draft_ahead=True)))
    ports, ahead = {**ports, "stage_ahead": handle.port}, handle.servicer
    specs = [StageSpec(), StageSpec(fill=True)]
    greedy = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    served = ahead.stage.ahead_served
    tokens, stats, failed = _over_the_wire(ports, greedy, stage_names=("stage_low", "stage_ahead"), specs=specs)
    assert tokens == generate(TargetVerifier(load_engine(folders["target"], dtype="float64")), None, PROMPT, greedy).token_ids
    assert not failed and ahead.stage.ahead_served > served and ahead.stage.ahead_dropped > 0
    sampled = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=30, ignore_eos=True, seed=7,
                             acceptance_rule=AcceptanceRule.STANDARD)
    tokens, _, failed = _over_the_wire(ports, sampled, stage_names=("stage_low", "stage_ahead"), specs=specs)
    assert tokens == _in_process(folders, sampled, specs) and not failed
    assert asyncio.run(_says_it_extends_ahead(ports)) == [(True, True, True), (False, False, False), (False, False, False)]
    services.stop(handle)


async def _says_it_extends_ahead(ports) -> list[tuple[bool, bool, bool]]:
    """For (the stage extending ahead, greedy), (it, sampled), (a stage that does not, greedy): whether the
    session says it extends ahead, whether a filling cascade on it says it drafts ahead (the k policy then
    prices rounds by what that hides), and whether its proposal says what a forward ahead costs."""
    greedy = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True, seed=1)
    sampled = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True, seed=1, acceptance_rule=AcceptanceRule.STANDARD)
    said = []
    for name, params in (("stage_ahead", greedy), ("stage_ahead", sampled), ("stage", greedy)):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{ports[name]}") as channel:
            stage = RemoteStage(stage_pb2_grpc.StageServiceStub(channel), timeout_s=30)
            cascade = AsyncCascadeDrafter(None, [stage], [StageSpec(fill=True)])
            state = await cascade.open(PROMPT, params)
            proposal = await cascade.propose(state, [], 3)
            said.append((stage.drafts_ahead(state.stages[0]), cascade.opened_drafting_ahead(state),
                         proposal.ahead_forward_ms is not None))
            await cascade.close(state)
    return said


def test_a_seeded_cascade_over_the_wire_gives_the_target_only_tokens(cluster):
    """The coupled rule (the default): every level samples each position with the
    request's noise, so the cascade's tokens are target-only sampling's with that seed; no q travels."""
    folders, ports, _ = cluster
    params = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=30, ignore_eos=True, seed=5)
    assert params.is_coupled
    tokens, stats, failed = _over_the_wire(ports, params)
    assert tokens == generate(TargetVerifier(load_engine(folders["target"], dtype="float64")), None, PROMPT, params).token_ids
    assert not failed and stats.num_accepted_tokens > 0


def test_a_stage_that_is_gone_is_skipped(cluster):
    folders, ports, services = cluster
    gone = services.start(create_stage(StageOptions(model=folders["stage"], dtype="float64", port=0)))
    services.stop(gone)
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    plain = generate(TargetVerifier(load_engine(folders["target"], dtype="float64")), None, PROMPT, params).token_ids
    tokens, _, failed = _over_the_wire(ports, params, dead_port=gone.port)
    assert tokens == plain and failed == [1]  # retired when it failed to open, never called again


def test_a_stage_that_dies_mid_request_is_skipped(cluster):
    folders, ports, services = cluster
    dying = services.start(create_stage(StageOptions(model=folders["stage"], dtype="float64", port=0)))
    params = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    plain = generate(TargetVerifier(load_engine(folders["target"], dtype="float64")), None, PROMPT, params).token_ids

    def kill_after_two_rounds(index):
        if index == 2:
            services.stop(dying)

    tokens, _, failed = _over_the_wire({**ports, "stage": dying.port}, params, on_event=kill_after_two_rounds)
    assert tokens == plain and failed == [1]


def test_the_coordinator_runs_the_configured_cascade_exactly_and_reports_each_stage(cluster):
    """Coordinator -> Draft -> Stage x2 -> Verify: greedy equals target-only; per request "none" turns it
    off; a stage the coordinator was not configured with, or a cascade outside speculative mode, is refused."""
    from transformers import AutoTokenizer

    from coordinator.options import CoordinatorOptions
    from coordinator.server import create_server as create_coordinator
    from servicekit.channels import open_channel as channel
    from specmesh.proto.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

    folders, ports, services = cluster
    stages = f"127.0.0.1:{ports['stage_low']}, 127.0.0.1:{ports['stage']} extend=2"
    coordinator = services.start(create_coordinator(CoordinatorOptions(
        model=folders["target"], port=0, verify_addresses=f"127.0.0.1:{ports['verify']}",
        draft_addresses=f"127.0.0.1:{ports['draft']}", cascade_stages=stages)))
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown fox"
    ids = AutoTokenizer.from_pretrained(folders["target"]).encode(prompt, add_special_tokens=False)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=30)
    expected = generate(TargetVerifier(load_engine(folders["target"], dtype="float64")), None, ids, params).token_ids

    async def run(cascade: str, mode=coordinator_pb2.GENERATION_MODE_SPECULATIVE):
        # k fixed: the tiny models' measured costs could keep an adaptive k at 0 (plain runs), with no stage rounds
        request = coordinator_pb2.GenerateRequest(prompt=prompt, mode=mode, drafter="service", cascade=cascade,
                                                  num_draft_tokens=4, sampling=common_pb2.SamplingParams(temperature=0, ignore_eos=True,
                                                                                     max_new_tokens=30))
        async with channel(f"127.0.0.1:{coordinator.port}") as ch:
            tokens, last = [], None
            async for response in coordinator_pb2_grpc.CoordinatorServiceStub(ch).Generate(request, timeout=60):
                tokens += response.token_ids
                last = response
            return tokens, last.stats

    tokens, stats = asyncio.run(run(""))
    assert tokens == expected
    assert [s.stage for s in stats.cascade_stages] == [f"127.0.0.1:{ports['stage_low']}", f"127.0.0.1:{ports['stage']}"]
    assert all(s.num_rounds > 0 and s.num_draft_tokens > 0 and not s.retired for s in stats.cascade_stages)
    assert not stats.lossy and stats.num_draft_tokens > 0 and stats.plan == "cascade_plain_runs"
    tokens, stats = asyncio.run(run(f"127.0.0.1:{ports['stage']}"))  # one of the configured stages only
    assert tokens == expected and len(stats.cascade_stages) == 1
    tokens, stats = asyncio.run(run("none"))
    assert not stats.plan.startswith("cascade")
    assert tokens == expected and not stats.cascade_stages
    for cascade, mode in ((f"127.0.0.1:{ports['verify']}", coordinator_pb2.GENERATION_MODE_SPECULATIVE),
                          ("", coordinator_pb2.GENERATION_MODE_AUTOREGRESSIVE)):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            asyncio.run(run(cascade or stages, mode))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()


def test_the_adaptive_cascade_through_the_coordinator_is_lossy_only_when_asked(cluster):
    """A finite cascade_lambda (per request, or the default set by SetCascadeLambda) lets chunks stop at the
    stage (stats: lossy, chunks stopped); unset / inf stays exactly the target's output."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from coordinator.options import CoordinatorOptions
    from coordinator.server import create_server as create_coordinator
    from servicekit.channels import open_channel as channel
    from specmesh.proto.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

    folders, ports, services = cluster
    predictor = next((Path(__file__).parents[2] / "specmesh" / "cascade" / "data").glob("*bf16*.json"))
    coordinator = services.start(create_coordinator(CoordinatorOptions(
        model=folders["target"], port=0, verify_addresses=f"127.0.0.1:{ports['verify']}", draft_addresses="",
        cascade_stages=f"127.0.0.1:{ports['stage']} extend=3", cascade_predictor=str(predictor))))
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown fox"
    ids = AutoTokenizer.from_pretrained(folders["target"]).encode(prompt, add_special_tokens=False)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=24)
    expected = generate(TargetVerifier(load_engine(folders["target"], dtype="float64")), None, ids, params).token_ids

    async def run(lam=None, set_default=None):
        request = coordinator_pb2.GenerateRequest(prompt=prompt, mode=coordinator_pb2.GENERATION_MODE_SPECULATIVE,
                                                  drafter="none", num_draft_tokens=3,
                                                  sampling=common_pb2.SamplingParams(temperature=0, ignore_eos=True,
                                                                                     max_new_tokens=24))
        if lam is not None:
            request.cascade_lambda = lam
        async with channel(f"127.0.0.1:{coordinator.port}") as ch:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
            if set_default is not None:
                answer = await stub.SetCascadeLambda(coordinator_pb2.SetCascadeLambdaRequest(cascade_lambda=set_default))
                assert answer.cascade_lambda == set_default
            tokens, last = [], None
            async for response in stub.Generate(request, timeout=60):
                tokens += response.token_ids
                last = response
            return tokens, last.stats

    tokens, stats = asyncio.run(run())
    assert tokens == expected and not stats.lossy
    tokens, stats = asyncio.run(run(lam=0.0))  # every chunk stops at the stage: its own decoding, labelled
    assert stats.lossy and stats.cascade_stages[0].num_chunks_stopped > 0 and len(tokens) == len(expected)
    tokens, stats = asyncio.run(run(set_default=0.0))
    assert stats.lossy
    tokens, stats = asyncio.run(run(set_default=float("inf")))
    assert tokens == expected and not stats.lossy
    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(run(set_default=-1.0))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
