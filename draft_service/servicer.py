"""DraftService: drafter sessions; concurrent Propose calls share one batched draft forward.

The session's generator is seeded with `draft_seed(request seed)`, as in the in-process loop, so a
seeded run over the wire equals `specmesh.decoding.speculative.generate`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from draft_service.convert import propose_response
from draft_service.options import DraftOptions
from servicekit.batching import WindowBatcher
from servicekit.convert import model_info_pb, q_dtype_from_pb, sampling_from_pb, token_ids_from_pb
from servicekit.engine_thread import EngineThread
from servicekit.errors import Unimplemented, rpc_method
from servicekit.metrics import ServiceMetrics
from servicekit.sessions import SessionTable
from specmesh.decoding.sampling import make_generator
from specmesh.decoding.speculative import draft_seed
from specmesh.models.engine import ContextLengthError
from specmesh.proto.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from specmesh.wire_q import RoundedQModelDrafter, WireSamplingParams


@dataclass
class DraftSession:
    state: Any  # the drafter's per-session state
    params: WireSamplingParams
    generator: torch.Generator
    seed: int


@dataclass
class ProposeCall:
    session: DraftSession
    accepted: list[int]
    k: int


@dataclass
class ProposeResult:
    proposal: Any  # DraftProposal
    raw_q: torch.Tensor | None
    draft_ms: float
    batch_size: int


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, options: DraftOptions, drafter, engine, vocab_size: int, max_context: int, model_folder: str,
                 metrics: ServiceMetrics):
        self.options = options
        self.drafter = drafter
        self.engine = engine  # None for the n-gram drafters
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.model_folder = model_folder
        self.metrics = metrics
        self.engine_thread = EngineThread("draft-engine")
        self.sessions = SessionTable(options.session_ttl_s, self._close_session)
        self.batcher = WindowBatcher(
            self.engine_thread, self._run_batch, options.batch_window_ms, options.max_batch_sessions,
            on_batch=lambda calls: metrics.batch_size.observe(len(calls)),
            on_queue_depth=metrics.queue_depth.set,
        )
        self._background: set[asyncio.Task] = set()

    # engine-thread work
    def _run_batch(self, calls: Sequence[ProposeCall]) -> list:
        start = time.perf_counter()
        try:
            if isinstance(self.drafter, RoundedQModelDrafter):
                pairs = self.drafter.propose_many_raw(
                    [c.session.state for c in calls], [c.accepted for c in calls], [c.k for c in calls],
                    [c.session.params for c in calls], [c.session.generator for c in calls])
            else:
                pairs = [(self.drafter.propose(c.session.state, c.accepted, c.k, c.session.params, c.session.generator), None)
                         for c in calls]
        except Exception as exc:  # noqa: BLE001 - every session of a failed batch is unusable
            return [exc] * len(calls)
        draft_ms = (time.perf_counter() - start) * 1e3
        self.metrics.forwards.inc()
        return [ProposeResult(proposal, raw, draft_ms, len(calls)) for proposal, raw in pairs]

    async def _close_session(self, session: DraftSession) -> None:
        await self.engine_thread.run(self.drafter.close, session.state)
        self.metrics.sessions.set(len(self.sessions))

    def _close_later(self, session_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self.sessions.close(session_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # RPCs
    @rpc_method
    async def OpenSession(self, request: draft_pb2.DraftOpenSessionRequest, context) -> draft_pb2.DraftOpenSessionResponse:
        prompt = token_ids_from_pb(request.prompt_token_ids, self.vocab_size, "prompt_token_ids")
        if not prompt:
            raise ValueError("prompt_token_ids must not be empty")
        if len(prompt) >= self.max_context:
            raise ContextLengthError(f"prompt of {len(prompt)} tokens leaves no room in the {self.max_context}-token context")
        base = sampling_from_pb(request.sampling, self.vocab_size)
        params = WireSamplingParams(**{f: getattr(base, f) for f in base.__dataclass_fields__})
        device = self.engine.device if self.engine is not None else "cpu"
        generator, _ = make_generator(draft_seed(params.seed), device)
        state = await self.engine_thread.run(self.drafter.open, prompt)
        session = DraftSession(state, params, generator, params.seed)
        try:
            session_id = self.sessions.add(session, request.session_id)
        except ValueError:
            await self.engine_thread.run(self.drafter.close, state)
            raise
        self.metrics.sessions.set(len(self.sessions))
        return draft_pb2.DraftOpenSessionResponse(session_id=session_id, ttl_ms=self.sessions.ttl_ms, seed=params.seed)

    @rpc_method
    async def Propose(self, request: draft_pb2.ProposeRequest, context) -> draft_pb2.ProposeResponse:
        entry = self.sessions.get(request.session_id)
        accepted = token_ids_from_pb(request.accepted_token_ids, self.vocab_size, "accepted_token_ids")
        k = request.num_draft_tokens
        if k > self.options.max_draft_tokens:
            raise ValueError(f"num_draft_tokens {k} exceeds this service's limit {self.options.max_draft_tokens}")
        if request.num_rewind_tokens:
            raise Unimplemented("num_rewind_tokens is not supported; send the accepted tokens instead")
        q_dtype = q_dtype_from_pb(request.distributions_dtype)
        async with entry.lock:
            session = entry.value
            session.params.q_wire_dtype = q_dtype
            try:
                result: ProposeResult = await self.batcher.submit(ProposeCall(session, accepted, k))
            except BaseException:
                self._close_later(request.session_id)  # cancelled or failed mid-draft: its state is unknown
                raise
        self.metrics.draft_tokens.inc(result.proposal.num_tokens)
        return propose_response(result.proposal, result.raw_q, request, q_dtype, self.vocab_size, result.draft_ms)

    @rpc_method
    async def CloseSession(self, request: draft_pb2.DraftCloseSessionRequest, context) -> draft_pb2.DraftCloseSessionResponse:
        return draft_pb2.DraftCloseSessionResponse(existed=await self.sessions.close(request.session_id))

    @rpc_method
    async def GetInfo(self, request, context) -> draft_pb2.DraftGetInfoResponse:
        if self.engine is not None:
            info = model_info_pb(self.options.model, self.model_folder, self.engine)
        else:
            info = common_pb2.ModelInfo(model=self.options.model, vocab_size=self.vocab_size, max_context_tokens=self.max_context)
        return draft_pb2.DraftGetInfoResponse(model=info, drafter=self.options.drafter)

    async def shutdown(self) -> None:
        await self.batcher.close()
        await self.sessions.stop()
        self.engine_thread.shutdown()
