"""Every driver steps the one SpeculationState: the in-process loop and the async loop give the
same tokens, finish reason and round counts for the same models and seed (greedy and sampled,
chains and trees). The async loop here runs over in-process adapters; over gRPC it is
tests/integration/test_services.py."""

from __future__ import annotations

import asyncio

import pytest

from specmesh.decoding.adaptive import AdaptiveK, FixedK
from specmesh.decoding.async_driver import TargetInfo, generate_async
from specmesh.decoding.plan import Plan
from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.sampling import SamplingParams, make_generator
from specmesh.decoding.speculative import generate
from specmesh.decoding.state import draft_seed
from specmesh.decoding.verifier import TargetVerifier
from specmesh.drafters.model import ModelDrafter
from specmesh.drafters.ngram import NgramStoreDrafter, PromptLookupDrafter
from specmesh.models.load import load_engine

PROMPT = [5, 17, 33, 5, 17, 33, 5, 17, 8]


class InProcessVerifier:
    """AsyncVerifier over a local TargetVerifier (what a Verify service does, minus the wire)."""

    def __init__(self, verifier: TargetVerifier):
        self.verifier = verifier

    async def info(self) -> TargetInfo:
        engine = self.verifier.engine
        return TargetInfo(engine.vocab_size, engine.max_context, tuple(engine.eos_token_ids))

    async def open(self, prompt_ids, params):
        session = self.verifier.open(prompt_ids, params, make_generator(params.seed, self.verifier.engine.device)[0])
        return session, session.pending_token_id

    async def verify(self, session, proposal: DraftProposal):
        return self.verifier.verify(session, proposal), None

    async def close(self, session) -> None:
        self.verifier.close(session)


class InProcessRunner(InProcessVerifier):
    """... that also steps plain rounds itself (`AsyncRunner`, target-only), noting each run's max_rounds."""

    def __init__(self, verifier: TargetVerifier):
        super().__init__(verifier)
        self.runs: list[int] = []

    async def run(self, session, *, draft: bool, k: int = 0, max_rounds: int = 0):
        assert not draft and not k and max_rounds > 0
        self.runs.append(max_rounds)
        for _ in range(max_rounds):
            outcome = self.verifier.verify(session, DraftProposal(token_ids=[]))
            yield 0, outcome, None, 0.0


class InProcessDrafter:
    """AsyncDrafter over a local Drafter (what a Draft service does, minus the wire)."""

    def __init__(self, drafter):
        self.drafter = drafter

    async def open(self, prompt_ids, params):
        generator = make_generator(draft_seed(params.seed), self.drafter.device)[0]
        return self.drafter.open(prompt_ids), params, generator

    async def propose(self, state, accepted_since_last, max_tokens):
        draft_state, params, generator = state
        return self.drafter.propose(draft_state, accepted_since_last, max_tokens, params, generator)

    async def close(self, state) -> None:
        self.drafter.close(state[0])


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    target_dir = tiny_model_dir("llama", init_std=0.2)
    return {"target": load_engine(target_dir, dtype="float64"), "draft": load_engine(target_dir, dtype="float32")}


def _drafter(kind, engines):
    return {"model": lambda: ModelDrafter(engines["draft"]), "ngram": lambda: PromptLookupDrafter(1, 3),
            "tree": lambda: NgramStoreDrafter(1, 3, max_branching=2), "none": lambda: None}[kind]()


@pytest.mark.parametrize("drafter_kind", ["model", "ngram", "tree", "none"])
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, top_k=40, seed=11)])
def test_sync_and_async_drivers_give_identical_generations(engines, drafter_kind, sampling):
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, **sampling)
    verifier = TargetVerifier(engines["target"])
    sync = generate(verifier, _drafter(drafter_kind, engines), PROMPT, params, k_policy=FixedK(3))
    drafter = _drafter(drafter_kind, engines)
    events = asyncio.run(generate_async(InProcessVerifier(verifier), None if drafter is None else InProcessDrafter(drafter),
                                        PROMPT, params, k_policy=FixedK(3)))
    assert [t for e in events for t in e.token_ids] == sync.token_ids
    assert events[-1].finish_reason is sync.finish_reason
    async_stats = events[-1].stats
    assert (async_stats.num_target_forwards, async_stats.num_draft_tokens, async_stats.num_accepted_tokens) == (
        sync.stats.num_target_forwards, sync.stats.num_draft_tokens, sync.stats.num_accepted_tokens)
    if drafter_kind == "model" or (drafter_kind != "none" and params.is_greedy):  # sampled text rarely repeats
        assert sync.stats.num_draft_tokens > 0


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, top_k=40, seed=11)])
def test_plain_stretches_run_on_the_verifier_with_the_same_rounds(engines, sampling):
    """With drafts that never pay (beta so high that k = 0 and any probe's draft is withheld), the async driver hands the state's plain
    stretches to the verifier's `run` (each with the round that started it) and yields exactly the rounds and
    tokens of the in-process loop with the same stretches, which are the plain decoding's tokens."""
    params = SamplingParams(max_new_tokens=40, ignore_eos=True, **sampling)
    verifier = TargetVerifier(engines["target"])
    plain = generate(verifier, None, PROMPT, params)
    sync = generate(verifier, PromptLookupDrafter(1, 3), PROMPT, params, k_policy=AdaptiveK(beta=0.99),
                    plain_stretches=True)
    runner = InProcessRunner(verifier)
    events = asyncio.run(generate_async(runner, InProcessDrafter(PromptLookupDrafter(1, 3)), PROMPT, params,
                                        k_policy=AdaptiveK(beta=0.99), plan=Plan.CLIENT_ROUNDS_PLAIN_RUNS))
    assert [t for e in events for t in e.token_ids] == sync.token_ids == plain.token_ids
    assert events[-1].stats.num_target_forwards == sync.stats.num_target_forwards == plain.stats.num_target_forwards
    assert events[-1].stats.num_withheld_drafts == sync.stats.num_withheld_drafts
    # each run: the round whose draft was withheld (or empty), the stretch of 1, 2, 4, 8 ... it starts, and the
    # rounds after it while the policy stays at k = 0 (to its next probe, made at the round after the run when the
    # run's stretches end past it: `AdaptiveK` keeps it due): five runs at most, where stretches alone would take
    # six (2 + 3 + 5 + 9 + 17 rounds < 39)
    assert runner.runs[0] == 2 and len(runner.runs) <= 5 and sum(runner.runs) >= len(plain.token_ids) - 1


class _OpenTracking(InProcessDrafter):
    """Notes its open and close calls; `opened` is set once a session is open."""

    def __init__(self, drafter):
        super().__init__(drafter)
        self.opened, self.num_open = asyncio.Event(), 0

    async def open(self, prompt_ids, params):
        state = await super().open(prompt_ids, params)
        self.num_open += 1
        self.opened.set()
        return state

    async def close(self, state) -> None:
        self.num_open -= 1
        await super().close(state)


class _OpenAfterTheDrafter(InProcessVerifier):
    """A verifier whose open returns only once the drafter's session is open (or fails, `fail`)."""

    def __init__(self, verifier, drafter: _OpenTracking, fail: bool = False):
        super().__init__(verifier)
        self.drafter, self.fail = drafter, fail

    async def open(self, prompt_ids, params):
        await self.drafter.opened.wait()
        if self.fail:
            raise RuntimeError("the target refused the session")
        return await super().open(prompt_ids, params)


@pytest.mark.parametrize("max_new_tokens", [24, 1])
def test_the_drafters_session_opens_beside_the_verifiers(engines, max_new_tokens):
    """The async driver opens the drafter's session while the verifier's opens (a drafting-ahead Draft
    service prefills then, beside the target's prefill): a verifier that waits for it still opens, the
    tokens are the in-process loop's, and the session is closed, also when the first token ends the request."""
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, temperature=0.0)
    verifier = TargetVerifier(engines["target"])
    sync = generate(verifier, ModelDrafter(engines["draft"]), PROMPT, params, k_policy=FixedK(3))
    drafter = _OpenTracking(ModelDrafter(engines["draft"]))

    async def run():
        return await asyncio.wait_for(generate_async(_OpenAfterTheDrafter(verifier, drafter), drafter, PROMPT, params,
                                                     k_policy=FixedK(3)), timeout=60)

    events = asyncio.run(run())
    assert [t for e in events for t in e.token_ids] == sync.token_ids
    assert drafter.num_open == 0
    assert engines["draft"].kv_usage().free_blocks == engines["draft"].kv_usage().total_blocks


def test_a_failed_verifier_open_closes_the_drafters_session(engines):
    verifier = TargetVerifier(engines["target"])
    drafter = _OpenTracking(ModelDrafter(engines["draft"]))
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    with pytest.raises(RuntimeError, match="refused"):
        asyncio.run(generate_async(_OpenAfterTheDrafter(verifier, drafter, fail=True), drafter, PROMPT, params))
    assert drafter.num_open == 0
    assert engines["draft"].kv_usage().free_blocks == engines["draft"].kv_usage().total_blocks
