"""StageService: delegates to `specmesh.cascade.stage_model.StageModel` on the engine thread."""

from __future__ import annotations

import time

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

    def free_session(self, session: StageSession) -> None:
        self.stage.close(session)

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
            session = await self.engine_thread.run(self.stage.open, prompt, params, generator)
            session_id = await self.add_session(session)
        return stage_pb2.StageOpenSessionResponse(session_id=session_id, ttl_ms=self.sessions.ttl_ms, seed=seed,
                                                  ms_per_token=self.engine.stats.step_ms)

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
            out = await self.engine_thread.run(self.stage.verify_and_extend, session, accepted, draft, q,
                                               request.num_extend_tokens, request.fill_to_tokens)
        self.metrics.record_verification(len(draft), out.num_accepted)
        return verify_and_extend_response(out, request.return_distributions, vocab, (time.perf_counter() - start) * 1e3,
                                          self.engine.stats.step_ms)

    @rpc_method
    async def CloseSession(self, request, context) -> stage_pb2.StageCloseSessionResponse:
        return stage_pb2.StageCloseSessionResponse(existed=await self.close_session(request.session_id))

    @rpc_method
    async def GetInfo(self, request, context) -> stage_pb2.StageGetInfoResponse:
        return stage_pb2.StageGetInfoResponse(model=model_info_pb(self.options.model, self.model_folder, self.engine),
                                              kv=kv_usage_pb(self.engine.kv_usage()), process=process_info_pb(self.settling))
