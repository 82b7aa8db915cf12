"""Seeds that reproduce over the live services (the coupled rule, the default): the
same seed gives the target-only tokens of that seed in every mode (speculative with the Draft
service's model drafter at a fixed and an adaptive k, n-gram drafts on the Verify service, fused
with a model drafter, autoregressive), run after run at 1 and at 16 concurrent clients, and after a
Verify replica dies mid-stream. The drafter is a different tiny model from the target, so drafts are
both accepted and rejected. Tiny random models, loopback ports picked at run time."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.options import CoordinatorOptions
from coordinator.server import create_server as create_coordinator
from draft_service.options import DraftOptions
from draft_service.server import create_server as create_draft
from servicekit.background import BackgroundServices
from servicekit.channels import open_channel as channel
from specmesh.decoding.sampling import AcceptanceRule, SamplingParams
from specmesh.decoding.speculative import generate
from specmesh.decoding.verifier import TargetVerifier
from specmesh.models.load import load_engine
from specmesh.proto.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from target_service.options import VerifyOptions
from target_service.server import create_server as create_verify

TIMEOUT_S = 60
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
SEED = 1234
SAMPLING = dict(temperature=1.0, top_p=0.95, seed=SEED, ignore_eos=True)
MODES = {"speculative": coordinator_pb2.GENERATION_MODE_SPECULATIVE, "fused": coordinator_pb2.GENERATION_MODE_FUSED,
         "autoregressive": coordinator_pb2.GENERATION_MODE_AUTOREGRESSIVE}
# (mode, drafter, k): every way the cluster can make a request's tokens
CASES = [("speculative", "service", 4), ("speculative", "service", 0), ("speculative", "ngram", 3),
         ("speculative", "ngram", 0), ("fused", "", 3), ("fused", "", 0), ("autoregressive", "", 0)]


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    return str(tiny_model_dir("llama", init_std=0.2)), str(tiny_model_dir("llama", seed=1, init_std=0.2))


@pytest.fixture(scope="module")
def tokenizer(models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models[0])


class Cluster:
    """Verify replicas (each hosting a fused model drafter on the draft model), a Draft service on the
    draft model and a Coordinator over them, started in the test's loop thread."""

    def __init__(self, target: str, draft: str, num_verify: int = 1, **coordinator_options):
        self.services = BackgroundServices()
        verify = dict(model=target, dtype="float64", port=0, batch_window_ms=5.0, max_kv_tokens=32768,
                      fused_drafter="model", fused_drafter_model=draft, fused_drafter_dtype="float64")
        self.verify = [self.services.start(create_verify(VerifyOptions(**verify))) for _ in range(num_verify)]
        self.draft = self.services.start(create_draft(DraftOptions(model=draft, dtype="float64", port=0)))
        self.coordinator = self.services.start(create_coordinator(CoordinatorOptions(
            model=target, port=0, health_interval_s=0.2, draft_addresses=f"127.0.0.1:{self.draft.port}",
            verify_addresses=",".join(f"127.0.0.1:{h.port}" for h in self.verify), **coordinator_options)))
        self.address = f"127.0.0.1:{self.coordinator.port}"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.services.close()


@pytest.fixture(scope="module")
def cluster(models):
    with Cluster(*models) as c:
        yield c


def _reference(target: str, tokenizer, max_new_tokens: int) -> list[int]:
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    params = SamplingParams(max_new_tokens=max_new_tokens, **SAMPLING)
    return generate(TargetVerifier(load_engine(target, dtype="float64")), None, ids, params).token_ids


def _request(mode: str, drafter: str, k: int, max_new_tokens: int, **sampling) -> coordinator_pb2.GenerateRequest:
    return coordinator_pb2.GenerateRequest(prompt=PROMPT, mode=MODES[mode], drafter=drafter, num_draft_tokens=k,
                                           sampling=common_pb2.SamplingParams(**{**SAMPLING, **sampling},
                                                                              max_new_tokens=max_new_tokens))


async def _collect(address: str, request) -> tuple[list[int], coordinator_pb2.GenerateResponse]:
    async with channel(address) as ch:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        tokens, last = [], None
        async for response in stub.Generate(request, timeout=TIMEOUT_S):
            tokens += response.token_ids
            last = response
        return tokens, last


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 4 * TIMEOUT_S))


def test_every_mode_gives_the_target_only_tokens_of_the_seed(cluster, models, tokenizer):
    reference = _reference(models[0], tokenizer, 40)
    drafted = accepted = 0
    for mode, drafter, k in CASES:
        tokens, last = _run(_collect(cluster.address, _request(mode, drafter, k, 40)))
        assert tokens == reference, (mode, drafter, k)
        assert last.stats.seed == SEED and last.stats.num_failovers == 0
        if mode != "autoregressive" and drafter != "ngram":
            drafted += last.stats.num_draft_tokens
            accepted += last.stats.num_accepted_tokens
    assert 0 < accepted < drafted  # the draft model's tokens were judged: some kept, some not


def test_the_standard_rule_is_kept_when_asked(cluster, models, tokenizer):
    """An explicit STANDARD rule: target-only decoding over the wire equals the in-process run of it
    (its generator read token by token), and differs from the coupled tokens of the same seed."""
    request = _request("autoregressive", "", 0, 30, acceptance_rule=common_pb2.ACCEPTANCE_RULE_STANDARD)
    tokens, _ = _run(_collect(cluster.address, request))
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    params = SamplingParams(max_new_tokens=30, acceptance_rule=AcceptanceRule.STANDARD, **SAMPLING)
    assert tokens == generate(TargetVerifier(load_engine(models[0], dtype="float64")), None, ids, params).token_ids
    assert tokens != _reference(models[0], tokenizer, 30)


def test_runs_repeat_at_one_and_at_sixteen_concurrent_clients(cluster, models, tokenizer):
    """10 runs one at a time, then 10 waves of 16 concurrent clients (the modes mixed, so rounds of
    different k batch together in the Verify service): every run, the same tokens."""
    reference = _reference(models[0], tokenizer, 20)
    for run in range(10):  # the case: the Draft service, adaptive k
        assert _run(_collect(cluster.address, _request("speculative", "service", 0, 20)))[0] == reference, run

    async def wave():
        cases = [CASES[i % len(CASES)] for i in range(16)]
        return await asyncio.gather(*(_collect(cluster.address, _request(*case, 20)) for case in cases))

    engine = cluster.verify[0].servicer.engine
    forwards, sequences = engine.stats.num_forwards, engine.stats.num_sequences_forwarded
    for run in range(10):
        for i, (tokens, _) in enumerate(_run(wave())):
            assert tokens == reference, (run, i, CASES[i % len(CASES)])
    batched = (engine.stats.num_sequences_forwarded - sequences) / (engine.stats.num_forwards - forwards)
    assert batched > 1.5, f"{batched:.2f} sequences per forward: the load did not batch"


@pytest.mark.parametrize("mode,drafter,k", [("speculative", "service", 3), ("autoregressive", "", 0)])
def test_a_dead_verify_replica_changes_no_token(models, tokenizer, mode, drafter, k):
    """The stream moves to the other replica, which samples the rest with the same noise."""
    max_new_tokens = 160
    reference = _reference(models[0], tokenizer, max_new_tokens)
    with Cluster(*models, num_verify=2) as c:
        async def main():
            async with channel(c.address) as ch:
                stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
                tokens, last, killed = [], None, False
                async for response in stub.Generate(_request(mode, drafter, k, max_new_tokens), timeout=TIMEOUT_S):
                    tokens += response.token_ids
                    last = response
                    if not killed and len(tokens) >= 10:
                        killed = True
                        busy = next(h for h in c.verify if h.servicer.num_sessions)
                        await asyncio.to_thread(c.services.stop, busy)
                return tokens, last

        tokens, last = _run(main())
    assert tokens == reference
    assert last.stats.num_failovers == 1 and last.stats.failovers[0].startswith("verify ")
