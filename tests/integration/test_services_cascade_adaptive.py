"""The adaptive (lossy, opt-in) cascade's wire path: Verify rounds with forced tokens.

- a forced-token round: the service appends the forced tokens unjudged and verifies the draft after
  them, exactly as `TargetVerifier.append_unverified` + `verify` in-process; they count toward
  max_new_tokens; forced tokens that would end the session, or too many, are INVALID_ARGUMENT and
  leave the session as it was;
- end to end: an adaptive cascade that stops early on some chunks and not others, its target over
  the wire (`RemoteVerifier.commit` then the next Verify carries the chunk), gives the same tokens
  as the same cascade in-process. The round loop here is the async driver's with the one branch it
  needs for an unverified proposal (commit, `record_unverified`).
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from servicekit.background import BackgroundServices
from servicekit.convert import sampling_to_pb
from servicekit.remote import RemoteVerifier
from specmesh.cascade.features import FeatureSchema
from specmesh.cascade.identity import StageIdentity
from specmesh.cascade.pipeline import CascadeDrafter
from specmesh.cascade.plan import StageSpec
from specmesh.cascade.policy import AdaptiveStopper
from specmesh.cascade.predictor import AgreementPredictor
from specmesh.cascade.shrinkage import StageShrinkage
from specmesh.cascade.stage_model import StageModel
from specmesh.decoding.adaptive import FixedK
from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.sampling import SamplingParams, make_generator
from specmesh.decoding.speculative import generate
from specmesh.decoding.state import SpeculationState, draft_seed
from specmesh.decoding.verifier import TargetVerifier
from specmesh.models.load import load_engine
from specmesh.proto.v1 import verify_pb2, verify_pb2_grpc
from target_service.options import VerifyOptions
from target_service.server import create_server as create_verify

PROMPT = [5, 17, 33, 5, 17, 33, 5, 17]


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    folders = {name: str(tiny_model_dir("llama", seed=1, init_std=std)) for name, std in (("target", 0.2), ("stage", 0.15))}
    with BackgroundServices() as services:
        port = services.start(create_verify(VerifyOptions(model=folders["target"], dtype="float64", port=0))).port
        engines = {name: load_engine(folder, dtype="float64") for name, folder in folders.items()}
        yield f"127.0.0.1:{port}", engines


def test_a_forced_token_round_equals_append_then_verify_in_process(setup):
    address, engines = setup
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    verifier = TargetVerifier(engines["target"])
    with grpc.insecure_channel(address) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        opened = stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=PROMPT, sampling=sampling_to_pb(params)))
        local = verifier.open(PROMPT, params, make_generator(0)[0])
        assert opened.first_token_id == local.pending_token_id
        forced, draft = [7, 9], [11, 13, 15]
        response = stub.Verify(verify_pb2.VerifyRequest(session_id=opened.session_id, draft_token_ids=draft,
                                                         deterministic_draft=True, forced_token_ids=forced, round_index=0))
        verifier.append_unverified(local, forced)
        outcome = verifier.verify(local, DraftProposal(draft))
        assert list(response.accepted_token_ids) == outcome.token_ids  # forced tokens are not repeated
        # generated so far: first + 2 forced + the round's tokens; max_new_tokens = 8 caps the next draft
        generated = 1 + len(forced) + len(outcome.token_ids)
        next_cap = 8 - generated - 1
        state = stub.Verify(verify_pb2.VerifyRequest(session_id=opened.session_id, draft_token_ids=[1] * 6,
                                                     deterministic_draft=True, round_index=1))
        assert len(state.accepted_token_ids) <= next_cap + 1
        verifier.close(local)
        stub.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=opened.session_id))


def test_forced_tokens_that_would_end_the_session_are_refused(setup):
    address, engines = setup
    eos = engines["target"].eos_token_ids[0]
    params = SamplingParams(temperature=0, max_new_tokens=6)
    with grpc.insecure_channel(address) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        opened = stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=PROMPT, sampling=sampling_to_pb(params)))

        def verify(forced, round_index=0):
            return stub.Verify(verify_pb2.VerifyRequest(session_id=opened.session_id, draft_token_ids=[1],
                                                        deterministic_draft=True, forced_token_ids=forced,
                                                        round_index=round_index))
        for forced in ([7, eos], [7] * 5, [10**6]):  # a stop token; more than the 6 - 1 - 1 = 4 this round may add; out of vocab
            with pytest.raises(grpc.RpcError) as info:
                verify(forced)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, forced
        assert len(verify([7, 8]).accepted_token_ids) >= 1  # the session was left as it was: round 0 still applies
        stub.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=opened.session_id))


class Alternating(AgreementPredictor):
    """P(agree) 0.9, 0.1, 0.9, ... per call: with lambda 2 the cascade stops on every other chunk."""

    def __init__(self):
        super().__init__(FeatureSchema(2), [StageIdentity("stage", "0" * 64), StageIdentity("target", "1" * 64)])
        self.calls = 0

    def predict_one(self, features):
        self.calls += 1
        return 0.9 if self.calls % 2 else 0.1


def _cascade(engines):
    stopper = AdaptiveStopper(Alternating(), [0.5, 1.0], lam=2.0,
                              shrinkage=StageShrinkage(1, shrink_strength=1e-12, predictor_weight=1.0))
    return CascadeDrafter(None, [StageModel(engines["stage"])], [StageSpec(num_extend_tokens=3)], stopper=stopper)


async def _over_the_wire(address, engines, params):
    """The async driver's round with the branch for an unverified chunk (what the Coordinator's needs)."""
    async with grpc.aio.insecure_channel(address) as channel:
        verifier = RemoteVerifier(verify_pb2_grpc.VerifyServiceStub(channel))
        info = await verifier.info()
        drafter = _cascade(engines)
        state = SpeculationState(params, num_prompt_tokens=len(PROMPT), max_context=info.max_context,
                                 eos_token_ids=info.eos_token_ids, k_policy=FixedK(3), seed=params.seed or 0)
        session, first = await verifier.open(PROMPT, params)
        tokens = list(state.start(first).token_ids)
        draft_state = drafter.open(PROMPT)
        generator, _ = make_generator(draft_seed(params.seed or 0))
        while not state.finished:
            k = state.next_k()
            proposal = drafter.propose(draft_state, state.take_draft_input(), k, params, generator)
            if proposal.unverified:
                await verifier.commit(session, proposal.token_ids)
                event = state.record_unverified(proposal.token_ids)
            else:
                outcome, _ = await verifier.verify(session, proposal)
                event = state.record(proposal.num_tokens, outcome.num_accepted, outcome.token_ids)
            tokens += event.token_ids
        await verifier.close(session)
        drafter.close(draft_state)
        return tokens, state.lossy, drafter.last_state


def test_an_adaptive_cascade_over_the_wire_equals_in_process(setup):
    address, engines = setup
    params = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True, seed=3)
    drafter = _cascade(engines)
    local = generate(TargetVerifier(engines["target"]), drafter, PROMPT, params, k_policy=FixedK(3))
    wire, lossy, state = asyncio.run(_over_the_wire(address, engines, params))
    assert wire == local.token_ids
    assert lossy and local.lossy
    stats = state.stage_stats[0]
    assert stats.num_chunks_stopped > 0 and state.num_chunks_to_target > 0  # both kinds of chunk happened
    assert local.token_ids != generate(TargetVerifier(engines["target"]), None, PROMPT, params).token_ids
