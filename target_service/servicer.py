"""VerifyService: target sessions with server-side KV; Verify calls batched across sessions.

Every engine call runs on the service's single engine thread; the servicer only converts and
delegates: to `TargetVerifier` (through the batcher), to the fused drafter, and to each session's
`SpeculationState`, which applies the one set of finish rules to every round (Verify and Step alike).
A session opened with a `SkeletonConstraint` has its rows masked by the plan grammar
(`target_service.grammars`) in every round, Verify and Step alike. On an encoder-decoder target
(`specmesh.models.encdec`) a session is opened on its encoder input, through a view of the engine
bound to it; its rounds then run on the shared verifier like any other session's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from servicekit.auth import current_principal
from servicekit.convert import (
    FINISH_TO_PB,
    check_draft_has_q,
    kv_region_pb,
    kv_usage_pb,
    model_info_pb,
    sampling_from_pb,
    stats_to_pb,
    token_ids_from_pb,
)
from servicekit.engine_thread import EngineThread, run_aside
from servicekit.errors import FailedPrecondition, Unimplemented, message_for, rpc_method, status_for
from servicekit.metrics import ServiceMetrics
from servicekit.process import process_info_pb
from servicekit.session_service import STATE_PRESERVING_ERRORS, SessionService
from servicekit.streams import check_stream_interval, read_ahead
from specmesh.decoding.adaptive import AcceptanceMemories, AdaptiveK
from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.sampling import SamplingParams, make_generator
from specmesh.decoding.state import SpeculationState, draft_seed
from specmesh.decoding.verifier import TargetSession, TargetVerifier, validate_prompt
from specmesh.drafters.model import ModelDrafter
from specmesh.kv.shared import SharedCache
from specmesh.models.encdec import bind_encoder_input, is_encoder_decoder, validate_encoder_input
from specmesh.models.engine import ContextLengthError
from specmesh.proto.v1 import common_pb2, verify_pb2, verify_pb2_grpc
from target_service.batcher import VerifyBatcher, VerifyCall, VerifyResult, run_verify_batch
from target_service.convert import proposal_from_pb, skeleton_format_from_pb, verify_response
from target_service.grammars import GrammarConstraint, SkeletonGrammars
from target_service.options import VerifyOptions
from target_service.sessions import FusedDraft, VerifySession

log = logging.getLogger("specmesh.verify")
T = TypeVar("T")
RUN_AHEAD_ROUNDS = 4  # rounds a Run stream may finish before the caller reads them
SOLO_ROUNDS = 16  # rounds a lone stream (Generate, target-only Run) runs per engine-thread job


def _drafts_forward(drafter) -> bool:
    """The hosted drafter runs model forwards on the engine thread (an n-gram lookup does not)."""
    return bool(getattr(drafter, "uses_engine", True))


class VerifyServicer(SessionService, verify_pb2_grpc.VerifyServiceServicer):
    def __init__(self, options: VerifyOptions, engine, model_folder: str, metrics: ServiceMetrics,
                 fused_drafters: dict[str, Any] | None = None, engine_thread: EngineThread | None = None,
                 shared_kv: SharedCache | None = None):
        super().__init__("verify", options.session_ttl_s, metrics, options, engine_thread)
        self.options = options
        self.engine = engine
        self.model_folder = model_folder
        self.verifier = TargetVerifier(engine)
        metrics.watch_kv(engine.kv_usage)
        metrics.watch_engine(lambda: engine.stats)
        self.fused_drafters = dict(fused_drafters or {})  # hosted for Step / Run, by name
        self.default_fused = next(iter(self.fused_drafters), "")  # the first: what a Step naming none drafts with
        # a hosted model drafter's acceptance over the sessions' rounds, greedy and sampled apart (AcceptanceMemory)
        self._acceptance = AcceptanceMemories()
        # sessions whose fused drafts run forwards on the engine thread: opened (event loop) and freed (engine
        # thread), each counted by one thread; their drafts are not batched across sessions (_fused_ms_per_token)
        self._forward_drafts_opened = self._forward_drafts_freed = 0
        self.shared_kv = shared_kv  # the KV in shared memory (server.share_kv), and where it lies (answers name it)
        self.kv_region = kv_region_pb(shared_kv.region) if shared_kv is not None else None
        self._generating = 0  # Generate streams in progress: callers of the batcher without a session id
        self._running = 0  # sessions inside a Run stream (their rounds stepped here, no client drafting for them)
        if options.borrow_threads > 0 or self.engine_thread.core_share is not None:
            self.engine_thread.threads_for_job = self._threads_for_job
        self.num_solo_rounds = 0  # rounds of a lone stream run back to back (_back_to_back)
        self.solo_rounds = _spare_core(engine, self.engine_thread, options.borrow_threads)  # (measured: on a 2-core CPU
        # with a 2-thread engine the event loop's writes then stall the engine's OpenMP team: 0.90x against 0.92x per round)
        self.batcher = VerifyBatcher(self.engine_thread, self.verifier, options.batch_window_ms, options.max_batch_tokens, metrics,
                                     expected_callers=lambda: self.num_sessions + self._generating)
        self.grammars = SkeletonGrammars(model_folder, engine.vocab_size, engine.eos_token_ids, options.skeleton_grammars)

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def free_session(self, session: VerifySession) -> None:
        """Engine thread: free the target KV and the fused drafter's state."""
        self.verifier.close(session.target)
        if session.fused is not None:
            session.fused.drafter.close(session.fused.state)
            self._forward_drafts_freed += _drafts_forward(session.fused.drafter)

    async def stop_batchers(self) -> None:
        await self.batcher.close()

    def _sampling(self, pb) -> SamplingParams:
        """A request's sampling params, validated, within this principal's max_new_tokens quota."""
        params = sampling_from_pb(pb, self.vocab_size, self.quotas.default_max_new_tokens(self.options.default_max_new_tokens))
        self.quotas.check_max_new_tokens(params.max_new_tokens)
        return params

    def _new_session(self, target: TargetSession, num_prompt_tokens: int, seed: int,
                     encoder_input_ids: Sequence[int] = ()) -> VerifySession:
        """A session whose rounds count from `num_prompt_tokens`; its first token is already emitted."""
        state = SpeculationState(target.params, num_prompt_tokens=num_prompt_tokens, max_context=self.engine.max_context,
                                 eos_token_ids=self.engine.eos_token_ids, seed=seed)
        if self.fused_drafters:  # fused rounds: what drafting costs here (the default drafter's; a Step naming
            self._price_fused(state, self.fused_drafters[self.default_fused])  # another prices it at its first round)
        state.start(target.pending_token_id)
        return VerifySession(target, state, seed, encoder_input_ids=list(encoder_input_ids), principal=current_principal())

    def _encoder_input(self, encoder_input_ids: Sequence[int]) -> list[int]:
        """A request's encoder input, validated: required by an encoder-decoder target, refused by a
        decoder-only one (both INVALID_ARGUMENT)."""
        if not is_encoder_decoder(self.engine):
            if encoder_input_ids:
                raise ValueError("encoder_input_ids were given but this Verify service's model is decoder-only")
            return []
        if not encoder_input_ids:
            raise ValueError("this Verify service's model is an encoder-decoder model: send encoder_input_ids "
                             "(prompt_token_ids are the decoder's prompt)")
        return validate_encoder_input(encoder_input_ids, self.engine.max_encoder_tokens, self.vocab_size)

    def _opener(self, encoder_input_ids: list[int]) -> TargetVerifier:
        """The verifier that opens a session: the shared one, or one on the engine bound to the encoder
        input (same engine and sequences; the shared verifier runs the session's rounds)."""
        return TargetVerifier(self.engine.bind(encoder_input_ids)) if encoder_input_ids else self.verifier

    def _shares_kv(self, drafter) -> bool:
        """`drafter` is a self-draft that takes the context's KV from this target (`self_draft`)."""
        return getattr(drafter, "kv_source", None) is self.engine

    def _price_fused(self, state: SpeculationState, drafter) -> None:
        """The k policy's prior for rounds drafted by the hosted `drafter`."""
        state.prior_costs(self._fused_ms_per_token(drafter), self.engine.stats.step_ms,
                          0.0 if self._shares_kv(drafter) else None, forward_cost=self.verifier.forward_cost())

    def _fused_ms_per_token(self, drafter) -> float | None:
        """What a draft token of the hosted `drafter` costs a session's rounds: its forward's time, times the
        sessions drafting with forwards here. Verify forwards are batched across sessions, these are not: the
        engine thread runs each session's in turn, so a round waits for the others' drafts as well (measured,
        16 clients priced at one session's figure: 0.88-0.98x autoregressive, where the same self-draft on the
        Draft service, priced at its load, drafted nothing and kept 0.97-1.04x)."""
        ms = getattr(drafter, "ms_per_token", None)
        if ms is None or not _drafts_forward(drafter):
            return ms
        return ms * max(1, self._forward_drafts_opened - self._forward_drafts_freed)

    def _fused_drafter(self, name: str) -> str:
        """The hosted drafter's name `name` stands for ("" = the default); Unimplemented when none is
        hosted, ValueError for a name not hosted."""
        if not self.fused_drafters:
            raise Unimplemented("this Verify service hosts no fused drafter (--fused-drafter)")
        if name and name not in self.fused_drafters:
            raise ValueError(f"fused_drafter {name!r} is not hosted here (hosted: {', '.join(self.fused_drafters)})")
        return name or self.default_fused

    def _open_fused(self, drafter, prompt: list[int], encoder_input_ids: list[int], target_seq_id: int):
        """Engine thread: `drafter`'s state for a session (a model drafter on an encoder-decoder
        model opens it through a view bound to the encoder input; n-gram drafters ignore the input); a
        self-draft's is tied to the session's target sequence, whose KV it takes (drafters/model.py)."""
        if encoder_input_ids and isinstance(drafter, ModelDrafter) and is_encoder_decoder(drafter.engine):
            return ModelDrafter(bind_encoder_input(drafter.engine, encoder_input_ids)).open(prompt)
        state = drafter.open(prompt)
        if self._shares_kv(drafter):
            drafter.share_kv(state, target_seq_id)
        return state

    async def _prefill(self, prompt: list[int], params: SamplingParams, generator,
                       constraint: GrammarConstraint | None = None, encoder_input_ids: Sequence[int] = ()) -> TargetSession:
        """A new session's target sequence, prefilled, with its first token sampled. With
        `prefill_chunk_tokens`, each chunk is its own engine job: the engine thread runs jobs first in,
        first out, so the batches of other sessions' rounds queued meanwhile run between the chunks and
        a long prompt delays them by about one chunk each. A failed or cancelled prefill frees its sequence.
        With an encoder input the encoder runs in `begin` (one engine job)."""
        chunk_tokens = self.options.prefill_chunk_tokens
        begun: list[TargetSession] = []  # filled on the engine thread: freed even if this call is cancelled during begin

        def begin() -> TargetSession:
            begun.append(self._opener(list(encoder_input_ids)).begin(prompt, params, generator))
            begun[0].constraint = constraint
            return begun[0]

        def free() -> None:
            for target in begun:
                self.verifier.close(target)

        try:
            target = await self.engine_thread.run(begin)
            while 0 < chunk_tokens < target.num_uncached:
                await self.engine_thread.run(self.verifier.prefill_chunk, target, chunk_tokens)
            # the last forward feeds the rest of the prompt (at most one chunk) and samples the first token
            await self.engine_thread.run(self.verifier.verify, target, DraftProposal(token_ids=[]))
        except BaseException:
            await asyncio.shield(self.engine_thread.run(free))  # queued after the job in flight, if any
            raise
        return target

    def session_tokens(self, session: VerifySession) -> int:
        return session.target.num_tokens + len(session.encoder_input_ids)  # decoder + encoder (cross-attention) KV

    @staticmethod
    def _check_open(session: VerifySession) -> None:
        if session.round.finish_reason is not None:
            raise FailedPrecondition(f"the session has finished ({session.round.finish_reason.value}); close it")

    def _prepare(self, session: VerifySession, proposal: DraftProposal, deterministic: bool,
                 forced: Sequence[int] = ()) -> tuple[DraftProposal, list[int], list[int]]:
        """Validate a round against the session before anything runs; cap the draft at what
        max_new_tokens and the context leave after the forced tokens (the proposal, the kept tokens'
        indices, the forced tokens)."""
        self._check_open(session)
        if proposal.num_tokens > self.options.max_draft_tokens:
            raise ValueError(f"{proposal.num_tokens} draft tokens exceed this service's limit of {self.options.max_draft_tokens}")
        check_draft_has_q(proposal.num_tokens, proposal.q is not None, deterministic, session.target.params)
        forced = list(forced)
        if forced:
            self._check_forced(session, forced)
        capped, kept = proposal.capped(session.round.max_draft_tokens - len(forced))
        self.check_kv_quota(1 + len(forced) + capped.num_tokens)
        return capped, kept, forced

    @staticmethod
    def _check_forced(session: VerifySession, forced: list[int]) -> None:
        """Forced tokens (lossy, opt-in) must leave the session open: the caller emitted them and goes on."""
        if session.target.constraint is not None:
            raise ValueError("forced_token_ids: a constrained (skeleton) session takes no unverified tokens")
        if len(forced) > session.round.max_draft_tokens or len(forced) >= session.round.context_left:
            raise ValueError(f"forced_token_ids: {len(forced)} tokens exceed what this round may add "
                             f"({session.round.max_draft_tokens}, with room for the target's own token)")
        stops = [t for t in forced if t in session.round.stop_token_ids]
        if stops:
            raise ValueError(f"forced_token_ids: stop token {stops[0]} would end the session; the caller knows it has ended")

    async def _apply(self, session_id: str, session: VerifySession, proposal: DraftProposal, kept: list[int],
                     forced: Sequence[int] = (), draft_ms: float = 0.0) -> verify_pb2.VerifyResponse:
        """One prepared round through the batcher, recorded in the session's state; forced tokens are
        appended first (fed by this round's forward), and taken back if the round fails."""
        num_tokens_before = session.target.num_tokens
        self.verifier.append_unverified(session.target, forced)
        try:
            result: VerifyResult = await self.batcher.verify(session.target, proposal)
        except BaseException:
            if forced and session.target.num_tokens == num_tokens_before + len(forced):
                del session.target.token_ids[num_tokens_before:]
            raise
        if forced:
            session.round.record_unverified(forced)
        return self._recorded(session_id, session, proposal, kept, result, draft_ms)

    def _recorded(self, session_id: str, session: VerifySession, proposal: DraftProposal, kept: list[int],
                  result: VerifyResult, draft_ms: float = 0.0) -> verify_pb2.VerifyResponse:
        """A verified round into the session's state and the metrics: its response."""
        outcome = result.outcome
        event = session.round.record(proposal.num_tokens, outcome.num_accepted, outcome.token_ids, draft_ms, result.verify_ms,
                                     result.cost)
        depth = proposal.num_tokens if not proposal.is_tree else max(_depths(proposal.tree_parents()), default=0)
        self.metrics.record_verification(depth, outcome.num_accepted)
        response = verify_response(session_id, outcome, proposal.is_tree, result, event.finish_reason)
        if proposal.is_tree:  # node indices of the request, not of the capped tree
            response.accepted_tree_nodes[:] = [kept[node] for node in outcome.accepted_nodes]
        self._tell_kv(session, response.target_kv)
        return response

    def _tell_kv(self, session: VerifySession, target_kv: common_pb2.TargetKv) -> None:
        """Where the session's KV lies in the shared cache, for a Draft service on this host (its next Propose):
        only a session with a sequence of its own (not a skeleton's shared layout) in a shared cache."""
        target = session.target
        if self.shared_kv is None or self.kv_region is None or target.group is not None or session.encoder_input_ids:
            return
        size = self.engine.cache.block_size
        blocks = self.engine.cache.blocks.block_table(target.seq_id)[: -(-target.num_cached // size)]
        target_kv.region.CopyFrom(self.kv_region)
        target_kv.blocks[:] = blocks
        target_kv.length = target.num_cached
        target_kv.tag = self.shared_kv.tag(session.principal, blocks, target.num_cached)

    # RPCs
    @rpc_method
    async def OpenSession(self, request: verify_pb2.VerifyOpenSessionRequest, context) -> verify_pb2.VerifyOpenSessionResponse:
        prompt = validate_prompt(request.prompt_token_ids, self.engine.max_context, self.vocab_size)
        encoder_input = self._encoder_input(request.encoder_input_ids)
        params = self._sampling(request.sampling)
        if params.stop:
            raise ValueError("the Verify service works on token ids: stop strings are checked by the caller")
        self.quotas.check_prompt(len(prompt) + len(encoder_input))
        constraint = await self._constraint(request.skeleton, prompt) if request.HasField("skeleton") else None
        generator, seed = make_generator(params.seed, self.engine.device)
        async with self.admission(len(prompt) + 1 + len(encoder_input)):
            target = await self._prefill(prompt, params, generator, constraint, encoder_input)
            session = self._new_session(target, len(prompt), seed, encoder_input)
            session_id = await self.add_session(session)
        response = verify_pb2.VerifyOpenSessionResponse(session_id=session_id, first_token_id=target.pending_token_id,
                                                        ttl_ms=self.sessions.ttl_ms, seed=seed,
                                                        finish_reason=FINISH_TO_PB[session.round.finish_reason],
                                                        step_ms=self.engine.stats.step_ms)
        self._tell_kv(session, response.target_kv)
        batch_size = max(1, round(self.batcher.recent_batch_size))
        cost = self.verifier.forward_cost(batch_size)
        if cost is not None:  # the caller's prior beta (its k policy), at the batch this session will likely share
            response.forward_fixed_ms, response.forward_ms_per_token, response.batch_size = cost.fixed_ms, cost.ms_per_token, batch_size
        return response

    async def _constraint(self, pb: verify_pb2.SkeletonConstraint, prompt: list[int]) -> GrammarConstraint:
        """The plan grammar for a new session, its state after the prompt's forced tokens."""
        fmt = skeleton_format_from_pb(pb, self.options.skeleton_max_points, self.options.skeleton_max_title_bytes,
                                      self.options.skeleton_max_direct_bytes)
        if pb.num_forced_tokens > len(prompt):
            raise ValueError(f"num_forced_tokens {pb.num_forced_tokens} exceeds the prompt's {len(prompt)} tokens")
        grammar = await run_aside(self.grammars.get, fmt)
        forced = prompt[len(prompt) - pb.num_forced_tokens:]
        state = grammar.walk(grammar.initial_state(), forced)[-1]
        if grammar.is_dead(state):
            raise ValueError(f"the prompt's last {len(forced)} tokens are not the start of a plan in the skeleton format")
        return GrammarConstraint(grammar, state)

    @rpc_method
    async def Verify(self, request: verify_pb2.VerifyRequest, context) -> verify_pb2.VerifyResponse:
        proposal = proposal_from_pb(request, self.vocab_size)
        forced = token_ids_from_pb(request.forced_token_ids, self.vocab_size, "forced_token_ids")
        async with self.session_call(request.session_id) as session:
            replay = session.rounds.replay(request)
            if replay is not None:
                return replay
            response = await self._apply(request.session_id, session,
                                         *self._prepare(session, proposal, request.deterministic_draft, forced))
            session.rounds.remember(request, response)
            return response

    @rpc_method
    async def VerifyBatch(self, request: verify_pb2.VerifyBatchRequest, context) -> verify_pb2.VerifyBatchResponse:
        """All items are validated before any is applied; an item failing while applied is answered
        in its own status (its session unchanged, or closed if its state became unknown)."""
        ids = [r.session_id for r in request.requests]
        if len(set(ids)) != len(ids):
            raise ValueError("a session may appear only once in a VerifyBatch")
        proposals = [proposal_from_pb(r, self.vocab_size) for r in request.requests]
        async with self.session_calls(ids) as sessions:
            replays = [s.rounds.replay(r) for s, r in zip(sessions, request.requests)]
            prepared = {i: self._prepare(s, p, r.deterministic_draft,
                                         token_ids_from_pb(r.forced_token_ids, self.vocab_size, "forced_token_ids"))
                        for i, (s, p, r, replay) in enumerate(zip(sessions, proposals, request.requests, replays)) if replay is None}
            applied = await asyncio.gather(*(self._apply(ids[i], sessions[i], *prepared[i]) for i in prepared),
                                           return_exceptions=True)
            responses = list(replays)
            for i, outcome in zip(prepared, applied):
                if isinstance(outcome, BaseException):
                    if not isinstance(outcome, Exception):
                        raise outcome
                    responses[i] = self._item_failure(ids[i], outcome)
                else:
                    sessions[i].rounds.remember(request.requests[i], outcome)
                    responses[i] = outcome
        return verify_pb2.VerifyBatchResponse(responses=responses)

    def _item_failure(self, session_id: str, exc: Exception) -> verify_pb2.VerifyResponse:
        code = status_for(exc)
        if not isinstance(exc, STATE_PRESERVING_ERRORS):
            log.error("VerifyBatch item failed; closing session", exc_info=exc)
            self.close_later(session_id)
        return verify_pb2.VerifyResponse(session_id=session_id, status_code=code.value[0], status_message=message_for(exc, code))

    @rpc_method
    async def Step(self, request: verify_pb2.StepRequest, context) -> verify_pb2.StepResponse:
        """One round of the session's speculation state with the hosted drafter."""
        self._check_fused(request.fused_drafter, request.num_draft_tokens)
        async with self.session_call(request.session_id) as session:
            replay = session.rounds.replay(request)
            if replay is not None:
                return replay
            self._check_open(session)
            response = await self._fused_round(request.session_id, session, request.num_draft_tokens, request.fused_drafter)
            session.rounds.remember(request, response)
        return response

    @rpc_method
    async def Run(self, request: verify_pb2.RunRequest, context):
        """The session's rounds, stepped here one after the other and streamed (the proto says how)."""
        if request.draft:
            self._check_fused(request.fused_drafter, request.num_draft_tokens)
        elif request.num_draft_tokens or request.fused_drafter:
            raise ValueError("num_draft_tokens and fused_drafter need draft (target-only rounds draft nothing)")
        check_stream_interval(request.stream_interval_ms)
        async with self.session_call(request.session_id) as session:
            if request.HasField("round_index") and request.round_index != session.rounds.rounds_done:
                raise FailedPrecondition(f"round_index {request.round_index} does not match the session, which has "
                                         f"completed {session.rounds.rounds_done} rounds")
            self._check_open(session)

            done = 0

            def rounds_left() -> bool:
                return session.round.finish_reason is None and (not request.max_rounds or done < request.max_rounds)

            def target_only_round() -> verify_pb2.RunResponse | None:
                """Engine thread (or the event loop between batched rounds' awaits, never both): one
                target-only round of this session, alone in its forward; None once the stream is done."""
                nonlocal done
                if not rounds_left():
                    return None
                done += 1
                proposal, kept, _ = self._prepare(session, DraftProposal(token_ids=[]), deterministic=True)
                # this Run's next round, if any, is target-only too: its forward may be launched ahead
                plain_next = session.round.max_draft_tokens > 0 and (not request.max_rounds or done < request.max_rounds)
                response = verify_pb2.RunResponse(result=self._recorded(
                    request.session_id, session, proposal, kept, self._verify_alone(session.target, plain_next)))
                session.rounds.remember(request, response)
                return response

            async def rounds():
                nonlocal done
                while rounds_left():
                    if not request.draft and self._alone(session_running=True):  # rounds back to back on the engine thread
                        async for response in self._back_to_back(target_only_round, lambda: self._alone(session_running=True)):
                            yield response
                        continue
                    done += 1
                    if request.draft:
                        step = await self._fused_round(request.session_id, session, request.num_draft_tokens,
                                                       request.fused_drafter)
                        response = verify_pb2.RunResponse(result=step.result, num_draft_tokens=step.num_draft_tokens,
                                                          draft_ms=step.draft_ms)
                    else:
                        prepared = self._prepare(session, DraftProposal(token_ids=[]), deterministic=True)
                        response = verify_pb2.RunResponse(result=await self._apply(request.session_id, session, *prepared))
                    session.rounds.remember(request, response)
                    yield response

            # the next round is submitted before this one is written to the caller
            self._running += 1
            try:
                joined = bool(request.stream_interval_ms)  # (a caller that does not ask may not read later_rounds)
                async for response in read_ahead(rounds(), RUN_AHEAD_ROUNDS, merge=_join_run_responses if joined else None,
                                                 interval_s=request.stream_interval_ms / 1e3, urgent=_finishes):
                    yield response
            finally:
                self._running -= 1

    def _threads_for_job(self, lent: int | None) -> int:
        """Engine thread, before each job: this process's own threads, and the borrowed ones. With a core
        board (`lent` not None) those it lends now: its lenders are idle (`servicekit.core_share`).
        Without one, `borrow_threads` while every open session is in a Run (a Generate stream has no
        session): none is in a client round then, whose drafts a Draft service on the lent cores may be
        making. The verifier's cost fit (reported to the callers' k policies) takes in the forwards of
        one kind only, those a lone session's client rounds run with: a one-token step on more threads
        beside verify forwards on fewer read as a dear token (beta near 1). With a board that is the
        borrowed kind (a lone session's Propose and Verify take turns, each lending its cores to the
        other); without, its own threads alone."""
        own = self.engine_thread.num_threads
        if lent is not None:
            self.verifier.fit_round_costs = lent > 0 or not self.options.borrow_threads
            return own + lent
        borrowing = self._running >= self.num_sessions
        self.verifier.fit_round_costs = not borrowing  # the fit prices client rounds, which run on `own` alone
        return own + self.options.borrow_threads if borrowing else own

    def _check_fused(self, name: str, k: int) -> None:
        self._fused_drafter(name)
        if k > self.options.max_draft_tokens:
            raise ValueError(f"{k} draft tokens exceed this service's limit of {self.options.max_draft_tokens}")

    async def _fused_round(self, session_id: str, session: VerifySession, requested_k: int,
                           name: str = "") -> verify_pb2.StepResponse:
        """Draft with the hosted drafter `name` ("": the default; a session keeps the one it began with;
        k: `requested_k`, or the session's policy when 0), then verify."""
        name = self._fused_drafter(name)
        drafter = self.fused_drafters[name]
        if session.fused is None:
            prompt = session.target.token_ids[: session.round.num_prompt_tokens]
            state = await self.engine_thread.run(self._open_fused, drafter, prompt, session.encoder_input_ids,
                                                 session.target.seq_id)
            session.fused = FusedDraft(state, make_generator(draft_seed(session.seed), drafter.device)[0], name, drafter)
            self._forward_drafts_opened += _drafts_forward(drafter)
            if isinstance(session.round.k_policy, AdaptiveK) and _drafts_forward(drafter):  # a model drafter's k starts
                session.round.k_policy = self._acceptance.policy(name, session.target.params.is_greedy)  # from the
                # acceptance of earlier sessions' rounds
                self._price_fused(session.round, drafter)
            elif name != self.default_fused:  # priced as the default at open
                self._price_fused(session.round, drafter)
        elif name != session.fused.name:
            raise FailedPrecondition(f"this session drafts with fused drafter {session.fused.name!r}, not {name!r}")
        k = session.round.next_k(requested_k or None)
        self.check_kv_quota(1 + k)  # before the drafter's state moves
        start = time.perf_counter()
        proposal = DraftProposal(token_ids=[])
        # the session's adaptive k may withhold a draft unlikely to pay; a caller's fixed k is kept
        step = session.round.draft_step(k, fixed_k=bool(requested_k))
        if step.asks:
            propose_args = (session.fused.state, step.new_tokens, k, session.target.params, session.fused.generator)
            if _drafts_forward(drafter):
                drafted = await self.engine_thread.run(drafter.propose, *propose_args)
            else:  # an n-gram lookup takes microseconds: a hop to the engine thread and back costs more
                drafted = drafter.propose(*propose_args)
            proposal = step.take(drafted, self._fused_ms_per_token(drafter))  # its figure after these forwards
        draft_ms = (time.perf_counter() - start) * 1e3
        prepared = self._prepare(session, proposal, deterministic=True)  # q travels with the proposal when sampled
        result = await self._apply(session_id, session, *prepared, draft_ms=draft_ms)
        return verify_pb2.StepResponse(result=result, num_draft_tokens=proposal.num_tokens, draft_ms=draft_ms)

    @rpc_method
    async def Fork(self, request: verify_pb2.ForkRequest, context) -> verify_pb2.ForkResponse:
        """Children of the caller's session (verify.proto says what they inherit); all or none."""
        n = request.num_children
        if not 1 <= n <= self.options.max_fork_children:
            raise ValueError(f"num_children must be in [1, {self.options.max_fork_children}], got {n}")
        self.quotas.check_fork(n)
        if request.child_sampling and len(request.child_sampling) != n:
            raise ValueError("child_sampling must be empty or have one entry per child")
        append = token_ids_from_pb(request.append_token_ids, self.vocab_size, "append_token_ids")
        child_appends = None
        if request.child_appends:  # checked whole by TargetVerifier.fork; the ids and count here, before admission
            if len(request.child_appends) != n:
                raise ValueError(f"child_appends needs one entry per child ({n}), got {len(request.child_appends)}")
            child_appends = [token_ids_from_pb(c.token_ids, self.vocab_size, "child_appends") for c in request.child_appends]
        if request.layout not in common_pb2.BranchLayout.values():
            raise ValueError(f"unknown layout {request.layout}")
        one_sequence = request.layout == common_pb2.BRANCH_LAYOUT_ONE_SEQUENCE
        child_params = [self._sampling(p) for p in request.child_sampling]
        async with self.session_call(request.session_id) as parent:
            num_prefix = request.num_prefix_tokens or parent.target.num_tokens
            if num_prefix > parent.target.num_tokens:
                raise ValueError(f"num_prefix_tokens {num_prefix} exceeds the parent's {parent.target.num_tokens} tokens")
            tails = [len(a) for a in child_appends] if child_appends is not None else [len(append)] * n
            if num_prefix < parent.target.num_tokens and not all(tails):
                raise ValueError("num_prefix_tokens shorter than the parent needs append_token_ids (or child_appends)")
            if num_prefix + max(tails) > self.engine.max_context:
                raise ContextLengthError("append_token_ids do not fit in the context window")
            params = child_params or [parent.target.params] * n
            seeds = [p.seed if child_params else (parent.seed + 1 + i) % 2**64 for i, p in enumerate(params)]
            async with self.admission(n * num_prefix + sum(tails), num_sessions=n):
                children = await self.engine_thread.run(self._fork, parent, append, params, seeds, num_prefix,
                                                        one_sequence, child_appends)
                child_ids: list[str] = []
                try:
                    for child in children:
                        child_ids.append(await self.add_session(child))
                except BaseException:  # a Fork that fails creates no child
                    await asyncio.gather(*(self.sessions.close(i) for i in child_ids))
                    await self.engine_thread.run(lambda: [self.free_session(c) for c in children[len(child_ids):]])
                    raise
        return verify_pb2.ForkResponse(child_session_ids=child_ids, next_token_ids=[c.target.pending_token_id for c in children])

    def _fork(self, parent: VerifySession, append: list[int], params: list[SamplingParams], seeds: list[int],
              num_prefix: int, one_sequence: bool = False,
              child_appends: list[list[int]] | None = None) -> list[VerifySession]:
        """Engine thread: children share the parent's KV blocks (its first `num_prefix` tokens); with
        `append` (or each child its own `child_appends` entry), one forward over all children feeds
        [their pending token, *append] and samples each child's next token. A child's rounds count from
        the fork: everything before its pending token is its prompt."""
        generators = [make_generator(seed, self.engine.device)[0] for seed in seeds]
        params = [dataclasses.replace(p, seed=seed) for p, seed in zip(params, seeds)]  # each child its own noise (coupled rule)
        targets = self.verifier.fork(parent.target, params, generators, append, num_prefix, one_sequence, child_appends)
        return [self._new_session(target, target.num_tokens - 1, seed, parent.encoder_input_ids)
                for target, seed in zip(targets, seeds)]

    @rpc_method
    async def CloseSession(self, request: verify_pb2.VerifyCloseSessionRequest, context) -> verify_pb2.VerifyCloseSessionResponse:
        return verify_pb2.VerifyCloseSessionResponse(existed=await self.close_session(request.session_id))

    @rpc_method
    async def Generate(self, request: verify_pb2.VerifyGenerateRequest, context):
        prompt = validate_prompt(request.prompt_token_ids, self.engine.max_context, self.vocab_size)
        encoder_input = self._encoder_input(request.encoder_input_ids)
        params = self._sampling(request.sampling)
        if params.stop:
            raise ValueError("Verify.Generate works on token ids and takes no stop strings")
        self.quotas.check_prompt(len(prompt) + len(encoder_input))
        kv_tokens = min(len(prompt) + params.max_new_tokens, self.engine.max_context) + len(encoder_input)  # one session's worth
        async with self.admission(kv_tokens):
            async for response in self._generate(prompt, params, encoder_input):
                yield response

    async def _generate(self, prompt: list[int], params: SamplingParams, encoder_input_ids: list[int]):
        """Run's path without a session id: OpenSession's prefill, then target-only rounds through the
        batcher (so they share forwards with other sessions' rounds), each round submitted before the one
        before it is written to the caller (`read_ahead`), the one set of finish rules in the round's
        `SpeculationState`. The sequence is freed when the stream ends, also on cancel."""
        generator, seed = make_generator(params.seed, self.engine.device)
        params = dataclasses.replace(params, seed=seed)  # the seed the generator uses, as OpenSession's session keeps it
        self._generating += 1
        begun: list[TargetSession] = []
        try:
            start = time.perf_counter()
            begun.append(await self._prefill(prompt, params, generator, encoder_input_ids=encoder_input_ids))
            target = begun[0]
            state = SpeculationState(params, num_prompt_tokens=len(prompt), max_context=self.engine.max_context,
                                     eos_token_ids=self.engine.eos_token_ids, has_drafter=False, seed=seed,
                                     vocab_size=self.vocab_size)

            def response(event) -> verify_pb2.VerifyGenerateResponse:
                pb = verify_pb2.VerifyGenerateResponse(token_ids=event.token_ids)
                if event.finish_reason is not None:
                    pb.finish_reason = FINISH_TO_PB[event.finish_reason]
                    pb.stats.CopyFrom(stats_to_pb(event.stats))
                return pb

            def generate_round():
                if state.finished:
                    return None
                state.next_k()
                return _record(state, self._verify_alone(target, plain_next=state.max_draft_tokens > 0))

            async def rounds():
                yield response(state.start(target.pending_token_id, (time.perf_counter() - start) * 1e3))
                while not state.finished:
                    if self._alone():  # the engine to itself: rounds back to back on the engine thread
                        async for event in self._back_to_back(generate_round, self._alone):
                            yield response(event)
                        continue
                    state.next_k()
                    result: VerifyResult = await self.batcher.verify(target, DraftProposal(token_ids=[]))
                    yield response(_record(state, result))

            # rounds done while a message was being written go out together (their token ids joined)
            async for pb in read_ahead(rounds(), SOLO_ROUNDS, merge=_join_generate_responses):
                yield pb
        finally:
            self._generating -= 1
            if begun:  # queued after any forward in flight that still holds the sequence
                await asyncio.shield(self.engine_thread.run(self.verifier.close, begun[0]))

    def _alone(self, session_running: bool = False) -> bool:
        """Nobody to batch with: one Generate stream and no session, or (session_running) one session's
        Run and no Generate stream; and no call waiting for the batcher."""
        if session_running:
            alone = self._generating == 0 and self.num_sessions == 1
        else:
            alone = self._generating == 1 and not self.num_sessions
        return self.solo_rounds and alone and not self.batcher.busy()

    def _verify_alone(self, target: TargetSession, plain_next: bool = False) -> VerifyResult:
        """Engine thread: a target-only round as a batch of one (the forward the batcher would run);
        `plain_next`: the stream's next round is target-only too (`TargetVerifier.verify_many`)."""
        call = VerifyCall(target, DraftProposal(token_ids=[]))
        result = run_verify_batch(self.verifier, [call], plain_next)[0]
        if isinstance(result, Exception):
            raise result
        if self.batcher.on_batch is not None:
            self.batcher.on_batch([call])
        self.num_solo_rounds += 1
        return result

    async def _back_to_back(self, one_round: Callable[[], T | None], alone: Callable[[], bool]) -> AsyncIterator[T]:
        """Rounds of a lone stream (Generate's, or a session's target-only Run) back to back in one
        engine-thread job, each round's result handed to the event loop as it is made: no hop between
        the event loop and the engine thread per token. The job ends after SOLO_ROUNDS rounds, when
        `one_round` returns None (the stream is done), when `alone` no longer holds (a call for the
        batcher, a session, another stream), or when the stream is gone."""
        loop = asyncio.get_running_loop()
        results: asyncio.Queue = asyncio.Queue()
        stop = [False]

        def steps() -> None:
            try:
                for _ in range(SOLO_ROUNDS):
                    if stop[0] or not alone():
                        return
                    result = one_round()
                    if result is None:
                        return
                    loop.call_soon_threadsafe(results.put_nowait, (result,))
            except Exception as exc:  # noqa: BLE001 - handed over after the rounds before it
                loop.call_soon_threadsafe(results.put_nowait, exc)
            finally:
                loop.call_soon_threadsafe(results.put_nowait, None)  # the job's end

        job = asyncio.ensure_future(self.engine_thread.run(steps))
        try:
            while (item := await results.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item[0]
        finally:
            stop[0] = True
            await job

    @rpc_method
    async def GetInfo(self, request, context) -> verify_pb2.VerifyGetInfoResponse:
        return verify_pb2.VerifyGetInfoResponse(
            model=model_info_pb(self.options.model, self.model_folder, self.engine),
            fused_drafter=",".join(self.fused_drafters),
            max_batch_tokens=self.options.max_batch_tokens,
            kv=kv_usage_pb(self.engine.kv_usage()),
            max_draft_tokens=self.options.max_draft_tokens,
            max_fork_children=self.options.max_fork_children,
            is_encoder_decoder=is_encoder_decoder(self.engine),
            decoder_prompt_ids=list(getattr(self.engine, "decoder_prompt_ids", ())),
            process=process_info_pb(self.settling),
        )


def _depths(parents: Sequence[int]) -> list[int]:
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def _record(state: SpeculationState, result: VerifyResult):
    """A target-only round's verdict into the state: its event."""
    outcome = result.outcome
    return state.record(0, outcome.num_accepted, outcome.token_ids, 0.0, result.verify_ms, result.cost)


def _join_run_responses(responses: list[verify_pb2.RunResponse]) -> verify_pb2.RunResponse:
    """Consecutive rounds of a Run as one message: the first, carrying the others in later_rounds."""
    joined = verify_pb2.RunResponse()
    joined.CopyFrom(responses[0])  # (a copy: the session remembers each round's own response)
    joined.later_rounds.extend(responses[1:])
    return joined


def _finishes(response: verify_pb2.RunResponse) -> bool:
    return response.result.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED


def _join_generate_responses(responses: list[verify_pb2.VerifyGenerateResponse]) -> verify_pb2.VerifyGenerateResponse:
    """Consecutive Generate messages as one: their tokens in order; the finish reason and stats are the
    last one's (only the last message of a stream carries them)."""
    joined = verify_pb2.VerifyGenerateResponse()
    for response in responses:
        joined.token_ids.extend(response.token_ids)
    last = responses[-1]
    joined.finish_reason = last.finish_reason
    if last.HasField("stats"):
        joined.stats.CopyFrom(last.stats)
    return joined


def _spare_core(engine, engine_thread: EngineThread, borrow_threads: int = 0) -> bool:
    """Whether the event loop has a core the engine's forwards do not use while they run: on a GPU the
    host thread waits on the device; on a CPU, when the engine thread's OpenMP team, borrowed threads
    included (they are borrowed in Runs, where solo rounds run), is smaller than the cores this process
    may use."""
    if engine.device.type != "cpu":
        return True
    return engine_thread.num_threads + borrow_threads < len(os.sched_getaffinity(0))
