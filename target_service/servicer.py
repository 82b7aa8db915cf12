"""VerifyService: target sessions with server-side KV; Verify calls batched across sessions.

Every engine call runs on the service's single engine thread; the servicer only converts and
delegates to `TargetVerifier` (through the batcher), the fused drafter, and `speculative_stream`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Sequence

from servicekit.convert import model_info_pb, sampling_from_pb, token_ids_from_pb
from servicekit.engine_thread import EngineThread
from servicekit.errors import Unimplemented, rpc_method
from servicekit.metrics import ServiceMetrics
from servicekit.sessions import SessionTable
from specmesh.decoding.sampling import SamplingParams, make_generator
from specmesh.decoding.speculative import FinishReason, draft_seed, speculative_stream
from specmesh.decoding.verifier import TargetSession, TargetVerifier
from specmesh.drafters.base import DraftProposal
from specmesh.models.engine import ContextLengthError
from specmesh.proto.v1 import verify_pb2, verify_pb2_grpc
from target_service.batcher import VerifyBatcher, VerifyResult
from target_service.convert import FINISH_TO_PB, proposal_from_pb, stats_to_pb, verify_response
from target_service.options import VerifyOptions
from target_service.sessions import FusedDraft, VerifySession


class VerifyServicer(verify_pb2_grpc.VerifyServiceServicer):
    def __init__(self, options: VerifyOptions, engine, model_folder: str, metrics: ServiceMetrics, fused_drafter=None):
        self.options = options
        self.engine = engine
        self.model_folder = model_folder
        self.metrics = metrics
        self.verifier = TargetVerifier(engine)
        self.fused_drafter = fused_drafter
        self.engine_thread = EngineThread("verify-engine")
        self.sessions = SessionTable(options.session_ttl_s, self._free_session)
        self.batcher = VerifyBatcher(self.engine_thread, self.verifier, options.batch_window_ms, options.max_batch_tokens, metrics)
        self._background: set[asyncio.Task] = set()

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    # helpers
    def _check_prompt(self, prompt: list[int]) -> None:
        if not prompt:
            raise ValueError("prompt_token_ids must not be empty")
        if len(prompt) >= self.engine.max_context:
            raise ContextLengthError(f"prompt of {len(prompt)} tokens leaves no room in the {self.engine.max_context}-token context")

    def _check_num_draft_tokens(self, session: TargetSession, k: int) -> None:
        if k > self.options.max_draft_tokens:
            raise ValueError(f"{k} draft tokens exceed this service's limit of {self.options.max_draft_tokens}")
        if k > self.verifier.max_draft_tokens(session):
            raise ContextLengthError(f"{k} draft tokens exceed the context window ({session.num_tokens} of "
                                     f"{self.engine.max_context} tokens used)")

    def _finish(self, session: VerifySession, new_tokens: Sequence[int]) -> FinishReason | None:
        if not session.target.params.ignore_eos and any(t in self.engine.eos_token_ids for t in new_tokens):
            return FinishReason.EOS
        if self.verifier.max_draft_tokens(session.target) == 0:
            return FinishReason.CONTEXT
        return None

    def _free_engine_state(self, session: VerifySession) -> None:
        """Engine thread: free the target KV and the fused drafter's state."""
        self.verifier.close(session.target)
        if session.fused is not None:
            self.fused_drafter.close(session.fused.state)

    async def _free_session(self, session: VerifySession) -> None:
        await self.engine_thread.run(self._free_engine_state, session)
        self.metrics.sessions.set(len(self.sessions))

    def _close_later(self, session_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self.sessions.close(session_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _add_session(self, session: VerifySession, session_id: str = "") -> str:
        session_id = self.sessions.add(session, session_id)
        self.metrics.sessions.set(len(self.sessions))
        return session_id

    async def _verify(self, session_id: str, session: VerifySession, proposal: DraftProposal) -> verify_pb2.VerifyResponse:
        """Verify through the batcher; the caller holds the session lock. A call cancelled or failed
        after it was queued closes its session (its KV state is then unknown to the client)."""
        self._check_num_draft_tokens(session.target, proposal.num_tokens)
        try:
            result: VerifyResult = await self.batcher.verify(session.target, proposal)
        except BaseException:
            self._close_later(session_id)
            raise
        outcome = result.outcome
        session.token_ids.extend(outcome.token_ids)
        depth = proposal.num_tokens if not proposal.is_tree else max((_depths(proposal.parents) or [0]))
        self.metrics.record_verification(depth, outcome.num_accepted)
        return verify_response(session_id, outcome, proposal.is_tree, result.batch_size, result.verify_ms,
                               self._finish(session, outcome.token_ids))

    # RPCs
    @rpc_method
    async def OpenSession(self, request: verify_pb2.VerifyOpenSessionRequest, context) -> verify_pb2.VerifyOpenSessionResponse:
        prompt = token_ids_from_pb(request.prompt_token_ids, self.vocab_size, "prompt_token_ids")
        self._check_prompt(prompt)
        params = sampling_from_pb(request.sampling, self.vocab_size)
        generator, seed = make_generator(params.seed, self.engine.device)
        target = await self.engine_thread.run(self.verifier.open, prompt, params, generator)
        session = VerifySession(target, [*prompt, target.pending_token_id], len(prompt), seed)
        try:
            session_id = self._add_session(session, request.session_id)
        except ValueError:
            await self.engine_thread.run(self.verifier.close, target)
            raise
        return verify_pb2.VerifyOpenSessionResponse(session_id=session_id, first_token_id=target.pending_token_id,
                                                    ttl_ms=self.sessions.ttl_ms, seed=seed)

    @rpc_method
    async def Verify(self, request: verify_pb2.VerifyRequest, context) -> verify_pb2.VerifyResponse:
        entry = self.sessions.get(request.session_id)
        proposal = proposal_from_pb(request, self.vocab_size)
        async with entry.lock:
            return await self._verify(request.session_id, entry.value, proposal)

    @rpc_method
    async def VerifyBatch(self, request: verify_pb2.VerifyBatchRequest, context) -> verify_pb2.VerifyBatchResponse:
        ids = [r.session_id for r in request.requests]
        if len(set(ids)) != len(ids):
            raise ValueError("a session may appear only once in a VerifyBatch")
        entries = [self.sessions.get(i) for i in ids]
        proposals = [proposal_from_pb(r, self.vocab_size) for r in request.requests]

        async def one(entry, proposal):
            async with entry.lock:
                return await self._verify(entry.session_id, entry.value, proposal)

        responses = await asyncio.gather(*(one(e, p) for e, p in zip(entries, proposals)))
        return verify_pb2.VerifyBatchResponse(responses=responses)

    @rpc_method
    async def Step(self, request: verify_pb2.StepRequest, context) -> verify_pb2.StepResponse:
        if self.fused_drafter is None:
            raise Unimplemented("this Verify service hosts no fused drafter (--fused-drafter)")
        entry = self.sessions.get(request.session_id)
        if request.num_draft_tokens > self.options.max_draft_tokens:
            raise ValueError(f"{request.num_draft_tokens} draft tokens exceed this service's limit of {self.options.max_draft_tokens}")
        async with entry.lock:
            session: VerifySession = entry.value
            if session.fused is None:
                state = await self.engine_thread.run(self.fused_drafter.open, session.token_ids[: session.num_prompt_tokens])
                device = getattr(getattr(self.fused_drafter, "engine", None), "device", "cpu")
                session.fused = FusedDraft(state, make_generator(draft_seed(session.seed), device)[0], session.num_prompt_tokens)
            fused = session.fused
            k = request.num_draft_tokens or fused.k_policy.next_k()
            k = max(0, min(k, self.verifier.max_draft_tokens(session.target), self.options.max_draft_tokens))
            since_last = session.token_ids[fused.num_fed_tokens:]
            start = time.perf_counter()
            proposal = await self.engine_thread.run(self.fused_drafter.propose, fused.state, since_last, k,
                                                    session.target.params, fused.generator)
            draft_ms = (time.perf_counter() - start) * 1e3
            fused.num_fed_tokens = len(session.token_ids)
            response = await self._verify(request.session_id, session, proposal)
            fused.k_policy.update(proposal.num_tokens, response.num_accepted_tokens, draft_ms, response.verify_ms)
        return verify_pb2.StepResponse(result=response, num_draft_tokens=proposal.num_tokens, draft_ms=draft_ms)

    @rpc_method
    async def Fork(self, request: verify_pb2.ForkRequest, context) -> verify_pb2.ForkResponse:
        entry = self.sessions.get(request.session_id)
        if request.num_children < 1:
            raise ValueError("num_children must be >= 1")
        if request.child_sampling and len(request.child_sampling) != request.num_children:
            raise ValueError("child_sampling must be empty or have one entry per child")
        append = token_ids_from_pb(request.append_token_ids, self.vocab_size, "append_token_ids")
        async with entry.lock:
            parent: VerifySession = entry.value
            if len(append) > self.verifier.max_draft_tokens(parent.target):
                raise ContextLengthError("append_token_ids do not fit in the context window")
            params = [sampling_from_pb(p, self.vocab_size) for p in request.child_sampling] or \
                [parent.target.params] * request.num_children
            seeds = [p.seed if request.child_sampling else (parent.seed + 1 + i) % 2**63 for i, p in enumerate(params)]
            children = await self.engine_thread.run(self._fork, parent, append, params, seeds)
        child_ids = [self._add_session(child) for child in children]
        return verify_pb2.ForkResponse(child_session_ids=child_ids, next_token_ids=[c.target.pending_token_id for c in children])

    def _fork(self, parent: VerifySession, append: list[int], params: list[SamplingParams], seeds: list[int]) -> list[VerifySession]:
        """Engine thread: children share the parent's KV blocks; with `append`, one forward over all
        children feeds [parent's pending token, *append] and samples each child's next token."""
        generators = [make_generator(seed, self.engine.device)[0] for seed in seeds]
        targets = self.verifier.fork(parent.target, params, generators, append)
        children = []
        for target, seed in zip(targets, seeds):
            appended = [*append, target.pending_token_id] if append else []
            children.append(VerifySession(target, list(parent.token_ids) + appended, parent.num_prompt_tokens, seed))
        return children

    @rpc_method
    async def CloseSession(self, request: verify_pb2.VerifyCloseSessionRequest, context) -> verify_pb2.VerifyCloseSessionResponse:
        return verify_pb2.VerifyCloseSessionResponse(existed=await self.sessions.close(request.session_id))

    @rpc_method
    async def Generate(self, request: verify_pb2.VerifyGenerateRequest, context):
        prompt = token_ids_from_pb(request.prompt_token_ids, self.vocab_size, "prompt_token_ids")
        self._check_prompt(prompt)
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

    async def shutdown(self) -> None:
        await self.batcher.close()
        await self.sessions.stop()
        self.engine_thread.shutdown()


def _depths(parents: Sequence[int]) -> list[int]:
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths
