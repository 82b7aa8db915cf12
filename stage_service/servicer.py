"""StageService: delegates to `specmesh.cascade.stage_model.StageModel` on the engine thread.

Extending ahead (`StageOptions.draft_ahead`, greedy sessions): after answering a VerifyAndExtend, the
session is queued for `StageModel.extend_ahead`, one forward at a time on the engine thread (the queued
sessions batched), only while no VerifyAndExtend runs or waits, until it is as many tokens past its
answer as its next call can use. The rule of when a forward ahead pays is the Draft service's
(`specmesh.decoding.ahead.forward_pays`): one that would still run when the session's next call is due
starts only where the level above usually confirms the stage's guess. Answers are the same either way
(`specmesh.cascade.stage_model`, "Extending ahead"); a call that finds its tokens ahead needs no forward.
Such a session also takes in its prompt at OpenSession (`StageModel.prefill`, while most sessions here are
called): the Coordinator opens it beside the Verify session, so the two prefills overlap, and the first
call does not stand, for the k policy, for what every round costs. The service says it extends ahead
(`drafts_ahead`, and with each answer `ahead_forward_ms`), so the caller's adaptive k prices its rounds by
what that hides.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from servicekit.ahead import AheadQueue
from servicekit.convert import (
    DEFAULT_MAX_NEW_TOKENS,
    check_draft_has_q,
    distributions_from_pb,
    kv_usage_pb,
    model_info_pb,
    sampling_from_pb,
    token_ids_from_pb,
)
from servicekit.engine_thread import EngineThread
from servicekit.errors import rpc_method
from servicekit.metrics import ServiceMetrics
from servicekit.process import process_info_pb
from servicekit.session_service import SessionService
from specmesh.cascade.stage_model import StageModel, StageSession
from specmesh.decoding.ahead import AheadClock, moving_average, prefill_at_open
from specmesh.decoding.sampling import make_generator
from specmesh.decoding.verifier import validate_prompt
from specmesh.proto.v1 import stage_pb2, stage_pb2_grpc
from stage_service.convert import verify_and_extend_response
from stage_service.options import StageOptions


class StageServicer(SessionService, stage_pb2_grpc.StageServiceServicer):
    def __init__(self, options: StageOptions, engine, model_folder: str, metrics: ServiceMetrics,
                 engine_thread: EngineThread | None = None):
        super().__init__("stage", options.session_ttl_s, metrics, options, engine_thread)
        self.options = options
        self.engine = engine
        self.model_folder = model_folder
        self.stage = StageModel(engine)
        metrics.watch_kv(engine.kv_usage)
        # extending ahead (module docstring)
        self._clocks: dict[int, AheadClock] = {}  # id -> its calls' timing and guesses
        self._ahead_forward_ms: float | None = None  # a forward ahead (moving average)
        self._sessions_called: float | None = None  # share of the closed sessions extending ahead that were called
        self._calls_running = 0  # VerifyAndExtend calls on their way to the engine thread or on it
        self._no_calls = asyncio.Event()
        self._no_calls.set()
        # id -> (session, tokens past its answer to reach), after the VerifyAndExtend calls
        self.ahead = AheadQueue(self.engine_thread, self._ahead_step, self._no_calls.wait, "extending ahead")
        if options.draft_ahead:
            metrics.watch_ahead(lambda: self.stage.ahead_served, lambda: self.stage.ahead_dropped)

    def free_session(self, session: StageSession) -> None:
        self.ahead.discard(id(session))
        self._clocks.pop(id(session), None)
        if self._extends_ahead(session):
            self._sessions_called = moving_average(self._sessions_called, float(session.answered > 0))
        self.stage.close(session)

    def _open(self, prompt: list[int], params, generator) -> StageSession:
        """Engine thread: the session; extending ahead, its prompt prefilled now, beside the level above's
        prefill, while sessions here are called (`specmesh.decoding.ahead.prefill_at_open`)."""
        session = self.stage.open(prompt, params, generator)
        if self._extends_ahead(session) and prefill_at_open(self._sessions_called):
            self.stage.prefill(session)
        return session

    def session_tokens(self, session: StageSession) -> int:
        return session.sequence.num_tokens

    @rpc_method
    async def OpenSession(self, request, context) -> stage_pb2.StageOpenSessionResponse:
        prompt = validate_prompt(request.prompt_token_ids, self.engine.max_context, self.engine.vocab_size)
        params = sampling_from_pb(request.sampling, self.engine.vocab_size,
                                  self.quotas.default_max_new_tokens(DEFAULT_MAX_NEW_TOKENS))
        self.quotas.check_prompt(len(prompt))
        self.quotas.check_max_new_tokens(params.max_new_tokens)
        generator, seed = make_generator(params.seed, self.engine.device)
        async with self.admission(len(prompt) + 1):
            session = await self.engine_thread.run(self._open, prompt, params, generator)
            session_id = await self.add_session(session)
        return stage_pb2.StageOpenSessionResponse(session_id=session_id, ttl_ms=self.sessions.ttl_ms, seed=seed,
                                                  ms_per_token=self.engine.stats.step_ms,
                                                  drafts_ahead=self._extends_ahead(session))

    @rpc_method
    async def VerifyAndExtend(self, request, context) -> stage_pb2.VerifyAndExtendResponse:
        vocab = self.engine.vocab_size
        accepted = token_ids_from_pb(request.accepted_token_ids, vocab, "accepted_token_ids")
        draft = token_ids_from_pb(request.draft_token_ids, vocab, "draft_token_ids")
        if len(draft) > self.options.max_draft_tokens:
            raise ValueError(f"{len(draft)} draft tokens exceed this service's limit of {self.options.max_draft_tokens}")
        if not 1 <= request.num_extend_tokens <= self.options.max_extend_tokens:
            raise ValueError(f"num_extend_tokens must be in [1, {self.options.max_extend_tokens}]")
        if request.fill_to_tokens > self.options.max_extend_tokens:
            raise ValueError(f"fill_to_tokens must be in [0, {self.options.max_extend_tokens}]")
        q = distributions_from_pb(request.distributions, len(draft), vocab) if request.HasField("distributions") else None
        async with self.session_call(request.session_id) as session:
            check_draft_has_q(len(draft), q is not None, request.deterministic_draft, session.sequence.params)
            self.check_kv_quota(len(accepted) + max(len(draft) + request.num_extend_tokens, request.fill_to_tokens))
            start = time.perf_counter()
            clock = self._clocks.setdefault(id(session), AheadClock())
            clock.called(start)
            self._calls_running += 1
            self._no_calls.clear()
            try:
                out = await self.engine_thread.run(self.stage.verify_and_extend, session, accepted, draft, q,
                                                   request.num_extend_tokens, request.fill_to_tokens)
            finally:
                self._calls_running -= 1
                if not self._calls_running:
                    self._no_calls.set()
            clock.judged(session.guess_held)
            clock.answered(time.perf_counter())
            self._want_ahead(session, 1 + max(request.fill_to_tokens, len(draft) + request.num_extend_tokens))
        self.metrics.record_verification(len(draft), out.num_accepted)
        ahead_ms = (self._ahead_forward_ms or self.engine.stats.step_ms) if self._extends_ahead(session) else None
        return verify_and_extend_response(out, request.return_distributions, vocab, (time.perf_counter() - start) * 1e3,
                                          self.engine.stats.step_ms, ahead_ms)

    # extending ahead (module docstring)
    def _extends_ahead(self, session: StageSession) -> bool:
        return self.options.draft_ahead and self.stage.extends_ahead(session)

    def _want_ahead(self, session: StageSession, depth: int) -> None:
        if self.options.draft_ahead and self.stage.wants_ahead(session, depth):
            self.ahead.add(id(session), (session, depth))

    def _ahead_step(self, queued: Sequence[tuple[StageSession, int]]) -> None:
        """Engine thread: one forward for the queued sessions with a round ahead left that pays; the others
        leave the queue (here, so a call that queues one again comes after)."""
        live, now = [], time.perf_counter()
        for session, depth in queued:
            clock = self._clocks.get(id(session))
            if (clock is None or not self.stage.wants_ahead(session, depth)
                    or clock.due(now, self._ahead_forward_ms, guessed=bool(session.ahead_logits))):
                self.ahead.discard(id(session))
            else:
                live.append(session)
        if live:
            self.stage.extend_ahead(live)
            self._ahead_forward_ms = moving_average(self._ahead_forward_ms, (time.perf_counter() - now) * 1e3)

    async def stop_batchers(self) -> None:
        await self.ahead.close()

    @rpc_method
    async def CloseSession(self, request, context) -> stage_pb2.StageCloseSessionResponse:
        return stage_pb2.StageCloseSessionResponse(existed=await self.close_session(request.session_id))

    @rpc_method
    async def GetInfo(self, request, context) -> stage_pb2.StageGetInfoResponse:
        return stage_pb2.StageGetInfoResponse(model=model_info_pb(self.options.model, self.model_folder, self.engine),
                                              kv=kv_usage_pb(self.engine.kv_usage()), process=process_info_pb(self.settling))
