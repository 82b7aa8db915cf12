"""DraftService: drafter sessions; concurrent Propose calls share one batched draft forward.

The session's generator is seeded with `draft_seed(request seed)`, as in the in-process loop, so a
seeded run over the wire equals `specmesh.decoding.speculative.generate`. q travels in the dtype a
Propose asks for: the drafter for that dtype rounds q first and samples from the rounded values
(`specmesh.drafters.wire_q`), so what travels is exactly what was sampled from. A model drafter on an
encoder-decoder model opens a session on its encoder input through a view of the engine bound to
it (`specmesh.models.encdec`); its Propose calls then batch with every other session's.

Drafting ahead (`DraftOptions.draft_ahead`, model drafters on decoder-only models). After a Propose,
the session is queued for `ModelDrafter.draft_ahead_step`: one batched forward at a time on the engine
thread, only while no Propose waits or runs (`WindowBatcher.wait_idle`), until each session has drafted
as many tokens ahead as its last Propose asked for. A Propose that finds the verdict it guessed is
answered from those drafts; proposals are the same as without drafting ahead. A forward that would
still run when the session's next Propose is due (the time from an answer to the next call, measured
per session, against the measured time of a forward ahead) would delay that call on a miss, and on a
hit save the part of it done before: it is started only where the session's guesses usually hold
(`specmesh.decoding.ahead.forward_pays` weighs the two with the session's measured hit rate).
A session that drafts ahead also takes in its prompt at OpenSession (`ModelDrafter.prefill`): the
Coordinator opens it beside the Verify session, so the two prefills overlap, and its first Propose
feeds the target's first token, as later ones feed their verdicts. Only while most sessions here draft
(a moving average over the closed ones): under a load where no draft pays (16 clients on a CPU), a
session is never asked for a draft, and its prompt would be prefilled for nothing beside the target's
forwards.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from draft_service.convert import propose_response
from draft_service.options import DraftOptions
from servicekit.ahead import AheadQueue
from servicekit.auth import current_principal
from servicekit.batching import WindowBatcher
from servicekit.convert import (
    DEFAULT_MAX_NEW_TOKENS,
    kv_region_from_pb,
    kv_usage_pb,
    model_info_pb,
    q_dtype_from_pb,
    sampling_from_pb,
    token_ids_from_pb,
)
from servicekit.engine_thread import EngineThread
from servicekit.errors import Unimplemented, rpc_method
from servicekit.metrics import ServiceMetrics
from servicekit.process import process_info_pb
from servicekit.rounds import RoundLog
from servicekit.session_service import SessionService
from specmesh.decoding.ahead import AheadClock, moving_average, prefill_at_open
from specmesh.decoding.proposal import Drafter, DraftProposal
from specmesh.decoding.sampling import SamplingParams, make_generator
from specmesh.decoding.state import draft_seed
from specmesh.decoding.verifier import validate_prompt
from specmesh.drafters.model import ModelDrafter
from specmesh.drafters.wire_q import RoundQ, q_transform_for
from specmesh.kv.shared import AttachedKV, attach
from specmesh.models.encdec import is_encoder_decoder, validate_encoder_input
from specmesh.models.native_engine import NativeEngine
from specmesh.proto.v1 import common_pb2, draft_pb2, draft_pb2_grpc

log = logging.getLogger(__name__)
DrafterFactory = Callable[[RoundQ | None], Drafter]  # q transform -> a drafter on the service's model


MAX_KV_SOURCES = 8  # Verify services' shared caches kept mapped (`_target_kv`)

@dataclass
class DraftSession:
    state: Any  # the drafter's per-session state (shared by the drafters of every q dtype)
    params: SamplingParams
    generator: torch.Generator
    seed: int
    num_tokens: int  # the prompt (+ encoder input) and every accepted token appended since (quota accounting)
    rounds: RoundLog = field(default_factory=RoundLog)  # Propose calls answered (safe resends)
    ahead_depth: int = 0  # tokens to draft ahead: the last Propose's k
    ahead_q_dtype: torch.dtype = torch.float32  # the last Propose's q dtype (its drafter drafts ahead)
    draft_ahead: bool = True  # False: an encoder-decoder session (drafted on a bound view of the engine)
    closed: bool = False  # set on the engine thread when its state is freed
    clock: AheadClock = field(default_factory=AheadClock)  # its Propose calls' timing and guesses (forward_pays)
    drafted: bool = False  # a Propose asked it for draft tokens


@dataclass
class SharedTable:
    """A Propose's target_kv, vouched for: the mapped cache, the session's blocks there, their epochs, its length."""

    source: AttachedKV
    blocks: list[int]
    epochs: list[int]
    length: int


@dataclass
class ProposeCall:
    session: DraftSession
    accepted: list[int]
    k: int
    q_dtype: torch.dtype
    target_kv: SharedTable | None = None  # where the target's shared cache holds the session's context


@dataclass
class ProposeResult:
    proposal: DraftProposal
    draft_ms: float
    batch_size: int


class DraftServicer(SessionService, draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, options: DraftOptions, make_drafter: DrafterFactory, engine, vocab_size: int, max_context: int,
                 model_folder: str, metrics: ServiceMetrics, engine_thread: EngineThread | None = None):
        super().__init__("draft", options.session_ttl_s, metrics, options, engine_thread)
        self.options = options
        self.make_drafter = make_drafter
        self.drafter = make_drafter(None)  # opens and closes sessions; q unrounded
        self._drafters: dict[torch.dtype, Drafter] = {torch.float32: self.drafter}
        self.engine = engine  # None for the n-gram drafters
        if engine is not None:
            metrics.watch_kv(engine.kv_usage)
            metrics.watch_kv_taken(lambda: sum(getattr(d, "kv_taken", 0) for d in list(self._drafters.values())))
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.model_folder = model_folder
        self.draft_ahead = options.draft_ahead and isinstance(self.drafter, ModelDrafter)
        self._ahead_forward_ms: float | None = None  # a forward ahead (moving average)
        self._sessions_drafting: float | None = None  # share of the closed sessions that drafted (moving average)
        self._kv_sources: dict[tuple, AttachedKV | None] = {}  # a Verify service's shared cache, mapped (None: refused)
        if self.draft_ahead:
            metrics.watch_ahead(lambda: sum(getattr(d, "ahead_served", 0) for d in list(self._drafters.values())),
                                lambda: sum(getattr(d, "ahead_dropped", 0) for d in list(self._drafters.values())))
        self.batcher = WindowBatcher(
            self.engine_thread, self._run_batch, options.batch_window_ms, options.max_batch_sessions,
            on_batch=lambda calls: metrics.batch_size.observe(len(calls)),
            on_queue_depth=metrics.queue_depth.set, expected_callers=lambda: self.num_sessions,
        )
        # sessions with drafting ahead to do (module docstring), after the Propose calls
        self.ahead = AheadQueue(self.engine_thread, self._ahead_step, self.batcher.wait_idle, "drafting ahead")

    def drafter_for(self, q_dtype: torch.dtype) -> Drafter:
        if q_dtype not in self._drafters:
            self._drafters[q_dtype] = self.make_drafter(q_transform_for(q_dtype))
        return self._drafters[q_dtype]

    def free_session(self, session: DraftSession) -> None:
        session.closed = True
        source = getattr(session.state, "kv_source", None)
        if isinstance(source, AttachedKV):
            source.forget(session.state.kv_from)
        self.drafter.close(session.state)
        self._sessions_drafting = moving_average(self._sessions_drafting, float(session.drafted))

    def session_tokens(self, session: DraftSession) -> int:
        return session.num_tokens

    async def stop_batchers(self) -> None:
        await self.ahead.close()
        await self.batcher.close()

    # drafting ahead (module docstring)
    def _want_ahead(self, session: DraftSession, k: int, q_dtype: torch.dtype) -> None:
        if not (self.draft_ahead and session.draft_ahead and k > 0):
            return
        session.ahead_depth, session.ahead_q_dtype = k, q_dtype
        self.ahead.add(id(session), session)

    def _ahead_step(self, sessions: Sequence[DraftSession]) -> None:
        """Engine thread: one forward per q dtype for the sessions with drafting ahead left to do; the
        others leave the queue (here, so a Propose that queues one again comes after)."""
        live, now = [], time.perf_counter()
        for session in sessions:
            drafter = self.drafter_for(session.ahead_q_dtype)
            if session.closed or not drafter.wants_ahead(session.state, session.ahead_depth) or self._due(session, now):
                self.ahead.discard(id(session))
            else:
                live.append(session)
        live.sort(key=lambda session: str(session.ahead_q_dtype))
        for q_dtype, group in itertools.groupby(live, key=lambda session: session.ahead_q_dtype):
            members = list(group)
            drafter = self.drafter_for(q_dtype)
            try:
                drafter.draft_ahead_step([m.state for m in members], [m.ahead_depth for m in members],
                                         [m.params for m in members], [m.generator for m in members])
            except Exception:  # noqa: BLE001 - e.g. the KV pool is full: these sessions draft on demand
                for member in members:
                    drafter.drop_ahead(member.state, member.generator)
                    self.ahead.discard(id(member))
        if live:
            self._ahead_forward_ms = moving_average(self._ahead_forward_ms, (time.perf_counter() - now) * 1e3 / len(
                {str(session.ahead_q_dtype) for session in live}))

    def _due(self, session: DraftSession, now: float) -> bool:
        """Whether one more forward ahead would still run when the session's next Propose is expected."""
        guessed = getattr(session.state, "ahead", None) is not None  # else the next forward is the guess: on its own it
        # saves nothing (a Propose that finds no draft ahead feeds the last draft again), so only if it ends in time
        return session.clock.due(now, self._ahead_forward_ms, guessed)

    # engine-thread work
    def _run_batch(self, calls: Sequence[ProposeCall]) -> list:
        """One batched draft per q dtype among the calls (usually one)."""
        start = time.perf_counter()
        proposals: dict[int, DraftProposal] = {}
        for call in calls:
            if call.target_kv is not None:
                self._share_kv(call.session, call.target_kv)
        try:
            by_dtype = itertools.groupby(sorted(range(len(calls)), key=lambda i: str(calls[i].q_dtype)),
                                         key=lambda i: calls[i].q_dtype)
            for q_dtype, group in by_dtype:
                indices = list(group)
                group_calls = [calls[i] for i in indices]
                drafted = self.drafter_for(q_dtype).propose_many(
                    [c.session.state for c in group_calls], [c.accepted for c in group_calls], [c.k for c in group_calls],
                    [c.session.params for c in group_calls], [c.session.generator for c in group_calls])
                proposals.update(zip(indices, drafted))
        except Exception as exc:  # noqa: BLE001 - every session of a failed batch is unusable
            return [exc] * len(calls)
        draft_ms = (time.perf_counter() - start) * 1e3
        self.metrics.forwards.inc()
        return [ProposeResult(proposals[i], draft_ms, len(calls)) for i in range(len(calls))]

    def _share_kv(self, session: DraftSession, table: SharedTable) -> None:
        """Engine thread: the session's target context lies at `table` (its first `length` positions final);
        the next proposal copies from there what it was not fed (`ModelDrafter.share_kv`)."""
        state, source = session.state, table.source
        key = state.seq_id
        source.set(key, table.blocks, table.length, table.epochs)  # (checked by `vouch`)
        if state.kv_source is not source:
            if isinstance(state.kv_source, AttachedKV):  # the target session failed over to another replica
                state.kv_source.forget(key)
            self.drafter.share_kv(state, key, source)

    def _target_kv(self, session: DraftSession, pb: common_pb2.TargetKv) -> SharedTable | None:
        """A Propose's target_kv, where this service can take KV from it: a model drafter on a native engine, a
        decoder-only session, a cache this process could map (`specmesh.kv.shared.attach`, once per region),
        a table its writer tagged for this caller and whose blocks are still the session's."""
        if not (session.draft_ahead and isinstance(self.drafter, ModelDrafter) and isinstance(self.engine, NativeEngine)):
            return None
        region = kv_region_from_pb(pb.region)
        if region.key not in self._kv_sources:
            for known, mapped in list(self._kv_sources.items()):  # a new region: a Verify replica (re)started, so
                if mapped is not None and not mapped.writer_alive():  # unmap those whose writer exited (each keeps
                    del self._kv_sources[known]  # a whole cache's memory alive; a session taking from one holds it)
            if len(self._kv_sources) >= MAX_KV_SOURCES:
                self._kv_sources.pop(next(iter(self._kv_sources)))
            self._kv_sources[region.key] = attach(region, self.model_folder, self.engine.cache.k.shape)
        source, blocks = self._kv_sources[region.key], list(pb.blocks)
        if source is None:
            return None
        try:
            epochs = source.vouch(current_principal(), blocks, pb.length, pb.tag)
        except ValueError as exc:
            log.warning("ignoring a malformed target_kv: %s", exc)
            return None
        if epochs is None:
            log.warning("ignoring a target_kv its Verify service did not tag for this caller, or whose blocks it has "
                        "released since; the session feeds its context")
            return None
        return SharedTable(source, blocks, epochs, pb.length)

    def _encoder_input(self, encoder_input_ids: Sequence[int]) -> list[int]:
        """A request's encoder input, validated: required by a model drafter on an encoder-decoder model,
        refused by one on a decoder-only model, ignored by n-gram drafters (draft.proto says why)."""
        if self.engine is None:
            return []
        if not is_encoder_decoder(self.engine):
            if encoder_input_ids:
                raise ValueError("encoder_input_ids were given but this Draft service's model is decoder-only: it cannot "
                                 "draft for an encoder-decoder target (serve an encoder-decoder draft of the target's vocabulary)")
            return []
        if not encoder_input_ids:
            raise ValueError("this Draft service's model is an encoder-decoder model: send encoder_input_ids "
                             "(prompt_token_ids are the decoder's prompt)")
        return validate_encoder_input(encoder_input_ids, self.engine.max_encoder_tokens, self.vocab_size)

    def _open(self, prompt: list[int], encoder_input_ids: list[int]):
        """Engine thread: a drafter state (on the engine bound to the encoder input, if one is given). Drafting
        ahead, the prompt is prefilled now, beside the target's prefill, while sessions here draft (module
        docstring)."""
        if encoder_input_ids:
            return ModelDrafter(self.engine.bind(encoder_input_ids)).open(prompt)
        state = self.drafter.open(prompt)
        if self.draft_ahead and prefill_at_open(self._sessions_drafting):
            self.drafter.prefill([state])
        return state

    # RPCs
    @rpc_method
    async def OpenSession(self, request: draft_pb2.DraftOpenSessionRequest, context) -> draft_pb2.DraftOpenSessionResponse:
        prompt = validate_prompt(request.prompt_token_ids, self.max_context, self.vocab_size)
        encoder_input = self._encoder_input(request.encoder_input_ids)
        params = sampling_from_pb(request.sampling, self.vocab_size, self.quotas.default_max_new_tokens(DEFAULT_MAX_NEW_TOKENS))
        self.quotas.check_prompt(len(prompt) + len(encoder_input))
        self.quotas.check_max_new_tokens(params.max_new_tokens)
        generator, _ = make_generator(draft_seed(params.seed), self.drafter.device)
        async with self.admission(len(prompt) + len(encoder_input)):
            state = await self.engine_thread.run(self._open, prompt, encoder_input)
            session_id = await self.add_session(DraftSession(state, params, generator, params.seed,
                                                             len(prompt) + len(encoder_input),
                                                             draft_ahead=not encoder_input))
        return draft_pb2.DraftOpenSessionResponse(session_id=session_id, ttl_ms=self.sessions.ttl_ms, seed=params.seed,
                                                  ms_per_token=self._ms_per_token(),
                                                  drafts_ahead=self.draft_ahead and not encoder_input)

    def _ms_per_token(self) -> float | None:
        """A draft token's cost, the callers' k policy prior: the engine's one-token forwards (recent
        average, those ahead included). With a core board, those of the jobs a session gets now: on the
        lent threads while it is alone here (a lone session's Propose and Verify take turns, each
        lending its cores to the other), on this process's own when others share the service."""
        if self.engine_thread.kept_apart:
            return self.engine_thread.per_token_ms(lent=self.num_sessions <= 1)
        return getattr(self.drafter, "ms_per_token", None)

    @rpc_method
    async def Propose(self, request: draft_pb2.ProposeRequest, context) -> draft_pb2.ProposeResponse:
        accepted = token_ids_from_pb(request.accepted_token_ids, self.vocab_size, "accepted_token_ids")
        k = request.num_draft_tokens
        if k > self.options.max_draft_tokens:
            raise ValueError(f"num_draft_tokens {k} exceeds this service's limit {self.options.max_draft_tokens}")
        if request.num_rewind_tokens:
            raise Unimplemented("num_rewind_tokens is not supported; send the accepted tokens instead")
        self.quotas.check_propose(len(accepted))
        q_dtype = q_dtype_from_pb(request.distributions_dtype)
        async with self.session_call(request.session_id) as session:
            replay = session.rounds.replay(request)
            if replay is not None:
                return replay
            session.clock.called(time.perf_counter())
            self.drafter.check_call(session.state, accepted, k)  # a bad call fails alone, before the batch
            session.drafted = session.drafted or k > 0
            self.check_kv_quota(len(accepted) + k)
            target_kv = self._target_kv(session, request.target_kv) if request.HasField("target_kv") else None
            result: ProposeResult = await self.batcher.submit(ProposeCall(session, accepted, k, q_dtype, target_kv))
            session.num_tokens += len(accepted)
            session.clock.judged(getattr(session.state, "guess_held", None))
            response = propose_response(result.proposal, request, self.vocab_size, result.draft_ms)
            # the engine's one-token forwards (recent average, those ahead included)
            ms_per_token = self._ms_per_token()
            if ms_per_token is not None:  # what an OpenSession would report now: the caller's next prior
                response.ms_per_token = ms_per_token
            if self.draft_ahead and session.draft_ahead:  # that, or under load a batch's
                forward_ms = ms_per_token if self.num_sessions <= 1 else None
                forward_ms = forward_ms or self._ahead_forward_ms
                if forward_ms is not None:
                    response.ahead_forward_ms = forward_ms
            session.rounds.remember(request, response)
            session.clock.answered(time.perf_counter())
            self._want_ahead(session, result.proposal.num_tokens, q_dtype)
        self.metrics.draft_tokens.inc(result.proposal.num_tokens)
        return response

    @rpc_method
    async def CloseSession(self, request: draft_pb2.DraftCloseSessionRequest, context) -> draft_pb2.DraftCloseSessionResponse:
        return draft_pb2.DraftCloseSessionResponse(existed=await self.close_session(request.session_id))

    @rpc_method
    async def GetInfo(self, request, context) -> draft_pb2.DraftGetInfoResponse:
        if self.engine is None:
            info = common_pb2.ModelInfo(model=self.options.model, vocab_size=self.vocab_size, max_context_tokens=self.max_context)
            return draft_pb2.DraftGetInfoResponse(model=info, drafter=self.options.drafter, process=process_info_pb(self.settling))
        return draft_pb2.DraftGetInfoResponse(model=model_info_pb(self.options.model, self.model_folder, self.engine),
                                              drafter=self.options.drafter, kv=kv_usage_pb(self.engine.kv_usage()),
                                              is_encoder_decoder=is_encoder_decoder(self.engine), process=process_info_pb(self.settling))
