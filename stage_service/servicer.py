"""StageService: delegates to `specmesh.cascade.stage_model.StageModel` on the engine thread."""

from __future__ import annotations

import asyncio
import time

from servicekit.convert import distributions_from_pb, model_info_pb, sampling_from_pb, token_ids_from_pb
from servicekit.engine_thread import EngineThread
from servicekit.errors import rpc_method
from servicekit.metrics import ServiceMetrics
from servicekit.sessions import SessionTable
from specmesh.cascade.stage_model import StageModel
from specmesh.decoding.sampling import make_generator
from specmesh.proto.v1 import stage_pb2, stage_pb2_grpc
from stage_service.convert import verify_and_extend_response
from stage_service.options import StageOptions


class StageServicer(stage_pb2_grpc.StageServiceServicer):
    def __init__(self, options: StageOptions, engine, model_folder: str, metrics: ServiceMetrics):
        self.options = options
        self.engine = engine
        self.model_folder = model_folder
        self.metrics = metrics
        self.stage = StageModel(engine)
        self.engine_thread = EngineThread("stage-engine")
        self.sessions = SessionTable(options.session_ttl_s, self._free)
        self._background: set[asyncio.Task] = set()

    async def _free(self, session) -> None:
        await self.engine_thread.run(self.stage.close, session)
        self.metrics.sessions.set(len(self.sessions))

    @rpc_method
    async def OpenSession(self, request, context) -> stage_pb2.StageOpenSessionResponse:
        prompt = token_ids_from_pb(request.prompt_token_ids, self.engine.vocab_size, "prompt_token_ids")
        params = sampling_from_pb(request.sampling, self.engine.vocab_size)
        generator, _ = make_generator(params.seed, self.engine.device)
        session = await self.engine_thread.run(self.stage.open, prompt, params, generator)
        try:
            session_id = self.sessions.add(session, request.session_id)
        except ValueError:
            await self.engine_thread.run(self.stage.close, session)
            raise
        self.metrics.sessions.set(len(self.sessions))
        return stage_pb2.StageOpenSessionResponse(session_id=session_id, ttl_ms=self.sessions.ttl_ms)

    @rpc_method
    async def VerifyAndExtend(self, request, context) -> stage_pb2.VerifyAndExtendResponse:
        entry = self.sessions.get(request.session_id)
        vocab = self.engine.vocab_size
        accepted = token_ids_from_pb(request.accepted_token_ids, vocab, "accepted_token_ids")
        draft = token_ids_from_pb(request.draft_token_ids, vocab, "draft_token_ids")
        if len(draft) > self.options.max_draft_tokens:
            raise ValueError(f"{len(draft)} draft tokens exceed this service's limit of {self.options.max_draft_tokens}")
        if not 1 <= request.num_extend_tokens <= self.options.max_extend_tokens:
            raise ValueError(f"num_extend_tokens must be in [1, {self.options.max_extend_tokens}]")
        q = distributions_from_pb(request.distributions, len(draft), vocab) if request.HasField("distributions") else None
        async with entry.lock:
            start = time.perf_counter()
            try:
                out = await self.engine_thread.run(self.stage.verify_and_extend, entry.value, accepted, draft, q,
                                                   request.num_extend_tokens)
            except asyncio.CancelledError:
                task = asyncio.get_running_loop().create_task(self.sessions.close(request.session_id))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
                raise
        self.metrics.record_verification(len(draft), out.num_accepted)
        return verify_and_extend_response(out, request.return_distributions, vocab, (time.perf_counter() - start) * 1e3)

    @rpc_method
    async def CloseSession(self, request, context) -> stage_pb2.StageCloseSessionResponse:
        return stage_pb2.StageCloseSessionResponse(existed=await self.sessions.close(request.session_id))

    @rpc_method
    async def GetInfo(self, request, context) -> stage_pb2.StageGetInfoResponse:
        return stage_pb2.StageGetInfoResponse(model=model_info_pb(self.options.model, self.model_folder, self.engine))

    async def shutdown(self) -> None:
        await self.sessions.stop()
        self.engine_thread.shutdown()
