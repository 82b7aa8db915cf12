"""VerifyService: target sessions with server-side KV; Verify calls batched across sessions.

Every engine call runs on the service's single engine thread; the servicer only converts and
delegates: to `TargetVerifier` (through the batcher), to the fused drafter, and to each session's
`SpeculationState`, which applies the one set of finish rules to every round (Verify and Step alike).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from servicekit.convert import FINISH_TO_PB, model_info_pb, sampling_from_pb, token_ids_from_pb
from servicekit.errors import FailedPrecondition, Unimplemented, rpc_method
from servicekit.metrics import ServiceMetrics
from servicekit.session_service import SessionService
from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.sampling import SamplingParams, make_generator
from specmesh.decoding.speculative import speculative_stream
from specmesh.decoding.state import SpeculationState, draft_seed
from specmesh.decoding.verifier import TargetSession, TargetVerifier, validate_prompt
from specmesh.models.engine import ContextLengthError
from specmesh.proto.v1 import verify_pb2, verify_pb2_grpc
from target_service.batcher import VerifyBatcher, VerifyResult
from target_service.convert import proposal_from_pb, stats_to_pb, verify_response
from target_service.options import VerifyOptions
from target_service.sessions import FusedDraft, VerifySession


class VerifyServicer(SessionService, verify_pb2_grpc.VerifyServiceServicer):
    def __init__(self, options: VerifyOptions, engine, model_folder: str, metrics: ServiceMetrics, fused_drafter=None):
        super().__init__("verify", options.session_ttl_s, metrics)
        self.options = options
        self.engine = engine
        self.model_folder = model_folder
        self.verifier = TargetVerifier(engine)
        self.fused_drafter = fused_drafter
        self.batcher = VerifyBatcher(self.engine_thread, self.verifier, options.batch_window_ms, options.max_batch_tokens, metrics)

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def free_session(self, session: VerifySession) -> None:
        """Engine thread: free the target KV and the fused drafter's state."""
        self.verifier.close(session.target)
        if session.fused is not None:
            self.fused_drafter.close(session.fused.state)

    async def stop_batchers(self) -> None:
        await self.batcher.close()

    def _new_session(self, target: TargetSession, num_prompt_tokens: int, seed: int) -> VerifySession:
        """A session whose rounds count from `num_prompt_tokens`; its first token is already emitted."""
        state = SpeculationState(target.params, num_prompt_tokens=num_prompt_tokens, max_context=self.engine.max_context,
                                 eos_token_ids=self.engine.eos_token_ids, seed=seed)
        state.start(target.pending_token_id)
        return VerifySession(target, state, seed)

    @staticmethod
    def _check_open(session: VerifySession) -> None:
        if session.round.finish_reason is not None:
            raise FailedPrecondition(f"the session has finished ({session.round.finish_reason.value}); close it")

    def _check_round(self, session: VerifySession, k: int) -> None:
        self._check_open(session)
        if k > self.options.max_draft_tokens:
            raise ValueError(f"{k} draft tokens exceed this service's limit of {self.options.max_draft_tokens}")
        if k > self.verifier.max_draft_tokens(session.target):
            raise ContextLengthError(f"{k} draft tokens exceed the context window ({session.target.num_tokens} of "
                                     f"{self.engine.max_context} tokens used)")

    async def _verify(self, session_id: str, session: VerifySession, proposal: DraftProposal,
                      draft_ms: float = 0.0) -> verify_pb2.VerifyResponse:
        """One round through the batcher, recorded in the session's state; the caller holds the session."""
        self._check_round(session, proposal.num_tokens)
        result: VerifyResult = await self.batcher.verify(session.target, proposal)
        outcome = result.outcome
        event = session.round.record(proposal.num_tokens, outcome.num_accepted, outcome.token_ids, draft_ms, result.verify_ms)
        depth = proposal.num_tokens if not proposal.is_tree else max(_depths(proposal.parents), default=0)
        self.metrics.record_verification(depth, outcome.num_accepted)
        return verify_response(session_id, outcome, proposal.is_tree, result.batch_size, result.verify_ms, event.finish_reason)

    # RPCs
    @rpc_method
    async def OpenSession(self, request: verify_pb2.VerifyOpenSessionRequest, context) -> verify_pb2.VerifyOpenSessionResponse:
        prompt = validate_prompt(request.prompt_token_ids, self.engine.max_context, self.vocab_size)
        params = sampling_from_pb(request.sampling, self.vocab_size)
        if params.stop:
            raise ValueError("the Verify service works on token ids: stop strings are checked by the caller")
        generator, seed = make_generator(params.seed, self.engine.device)
        target = await self.engine_thread.run(self.verifier.open, prompt, params, generator)
        session_id = await self.add_session(self._new_session(target, len(prompt), seed), request.session_id)
        return verify_pb2.VerifyOpenSessionResponse(session_id=session_id, first_token_id=target.pending_token_id,
                                                    ttl_ms=self.sessions.ttl_ms, seed=seed)

    @rpc_method
    async def Verify(self, request: verify_pb2.VerifyRequest, context) -> verify_pb2.VerifyResponse:
        proposal = proposal_from_pb(request, self.vocab_size)
        async with self.session_call(request.session_id) as session:
            return await self._verify(request.session_id, session, proposal)

    @rpc_method
    async def VerifyBatch(self, request: verify_pb2.VerifyBatchRequest, context) -> verify_pb2.VerifyBatchResponse:
        ids = [r.session_id for r in request.requests]
        if len(set(ids)) != len(ids):
            raise ValueError("a session may appear only once in a VerifyBatch")
        for session_id in ids:
            self.sessions.get(session_id)  # NOT_FOUND before anything runs
        proposals = [proposal_from_pb(r, self.vocab_size) for r in request.requests]

        async def one(session_id: str, proposal: DraftProposal) -> verify_pb2.VerifyResponse:
            async with self.session_call(session_id) as session:
                return await self._verify(session_id, session, proposal)

        responses = await asyncio.gather(*(one(i, p) for i, p in zip(ids, proposals)))
        return verify_pb2.VerifyBatchResponse(responses=responses)

    @rpc_method
    async def Step(self, request: verify_pb2.StepRequest, context) -> verify_pb2.StepResponse:
        """One round of the session's speculation state with the hosted drafter."""
        if self.fused_drafter is None:
            raise Unimplemented("this Verify service hosts no fused drafter (--fused-drafter)")
        if request.num_draft_tokens > self.options.max_draft_tokens:
            raise ValueError(f"{request.num_draft_tokens} draft tokens exceed this service's limit of {self.options.max_draft_tokens}")
        async with self.session_call(request.session_id) as session:
            self._check_open(session)
            if session.fused is None:
                prompt = session.target.token_ids[: session.round.num_prompt_tokens]
                state = await self.engine_thread.run(self.fused_drafter.open, prompt)
                session.fused = FusedDraft(state, make_generator(draft_seed(session.seed), self.fused_drafter.device)[0])
            k = session.round.next_k(request.num_draft_tokens or None)
            start = time.perf_counter()
            proposal = await self.engine_thread.run(self.fused_drafter.propose, session.fused.state,
                                                    session.round.take_draft_input(), k, session.target.params,
                                                    session.fused.generator)
            draft_ms = (time.perf_counter() - start) * 1e3
            response = await self._verify(request.session_id, session, proposal, draft_ms)
        return verify_pb2.StepResponse(result=response, num_draft_tokens=proposal.num_tokens, draft_ms=draft_ms)

    @rpc_method
    async def Fork(self, request: verify_pb2.ForkRequest, context) -> verify_pb2.ForkResponse:
        if request.num_children < 1:
            raise ValueError("num_children must be >= 1")
        if request.child_sampling and len(request.child_sampling) != request.num_children:
            raise ValueError("child_sampling must be empty or have one entry per child")
        append = token_ids_from_pb(request.append_token_ids, self.vocab_size, "append_token_ids")
        async with self.session_call(request.session_id) as parent:
            if len(append) > self.verifier.max_draft_tokens(parent.target):
                raise ContextLengthError("append_token_ids do not fit in the context window")
            params = [sampling_from_pb(p, self.vocab_size) for p in request.child_sampling] or \
                [parent.target.params] * request.num_children
            seeds = [p.seed if request.child_sampling else (parent.seed + 1 + i) % 2**63 for i, p in enumerate(params)]
            children = await self.engine_thread.run(self._fork, parent, append, params, seeds)
        child_ids = [await self.add_session(child) for child in children]
        return verify_pb2.ForkResponse(child_session_ids=child_ids, next_token_ids=[c.target.pending_token_id for c in children])

    def _fork(self, parent: VerifySession, append: list[int], params: list[SamplingParams], seeds: list[int]) -> list[VerifySession]:
        """Engine thread: children share the parent's KV blocks; with `append`, one forward over all
        children feeds [parent's pending token, *append] and samples each child's next token. A child's
        rounds count from the fork: everything before its pending token is its prompt."""
        generators = [make_generator(seed, self.engine.device)[0] for seed in seeds]
        targets = self.verifier.fork(parent.target, params, generators, append)
        return [self._new_session(target, target.num_tokens - 1, seed) for target, seed in zip(targets, seeds)]

    @rpc_method
    async def CloseSession(self, request: verify_pb2.VerifyCloseSessionRequest, context) -> verify_pb2.VerifyCloseSessionResponse:
        return verify_pb2.VerifyCloseSessionResponse(existed=await self.close_session(request.session_id))

    @rpc_method
    async def Generate(self, request: verify_pb2.VerifyGenerateRequest, context):
        prompt = validate_prompt(request.prompt_token_ids, self.engine.max_context, self.vocab_size)
        params = sampling_from_pb(request.sampling, self.vocab_size, self.options.default_max_new_tokens)
        if params.stop:
            raise ValueError("Verify.Generate works on token ids and takes no stop strings")
        stream = speculative_stream(self.verifier, None, prompt, params)
        try:
            while True:
                event = await self.engine_thread.run(next, stream, None)
                if event is None:
                    return
                response = verify_pb2.VerifyGenerateResponse(token_ids=event.token_ids)
                if event.finish_reason is not None:
                    response.finish_reason = FINISH_TO_PB[event.finish_reason]
                    response.stats.CopyFrom(stats_to_pb(event.stats))
                yield response
                if event.finish_reason is not None:
                    return
        finally:
            await self.engine_thread.run(stream.close)  # frees the session, also on cancel

    @rpc_method
    async def GetInfo(self, request, context) -> verify_pb2.VerifyGetInfoResponse:
        return verify_pb2.VerifyGetInfoResponse(
            model=model_info_pb(self.options.model, self.model_folder, self.engine),
            fused_drafter=self.options.fused_drafter if self.fused_drafter is not None else "",
            max_batch_tokens=self.options.max_batch_tokens,
        )


def _depths(parents: Sequence[int]) -> list[int]:
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths
