"""gRPC adapter for a cascade stage: the Stage service as a `specmesh.cascade.pipeline.AsyncStage`.

    stage = RemoteStage(stage_pb2_grpc.StageServiceStub(channel))
    drafter = AsyncCascadeDrafter(RemoteDrafter(draft_stub), [stage])
    async for event in speculative_stream_async(RemoteVerifier(verify_stub), drafter, prompt_ids, params): ...

Conversion and calls only. The lower level's q travels in the dtype it was stored in (dense, or its
exact support with `sparse_q`); absent q with a sampled session is a deterministic (one-hot) draft and
says so (`deterministic_draft`). The stage answers with its own p rows as float32, which are the q
the next level verifies against (`specmesh.cascade.plan`, "Exactness").

VerifyAndExtend is not resent after a lost answer: the request carries no round index, so a resend
could advance the stage twice. A failed call raises `grpc.aio.AioRpcError`; the cascade decides
whether that retires the stage (`AsyncCascadeDrafter(is_stage_failure=...)`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from servicekit.convert import distributions_from_pb, distributions_to_pb, token_ids_from_pb
from servicekit.remote import Metadata, WireCounters, _close_quietly, _token_level
from specmesh.cascade.stage_model import StageOutput, TokenFeatures
from specmesh.decoding.sampling import SamplingParams
from specmesh.proto.v1 import stage_pb2, stage_pb2_grpc


@dataclass(frozen=True)
class StageInfo:
    vocab_size: int
    max_context: int  # tokens
    tokenizer_fingerprint: str = ""


@dataclass
class RemoteStageSession:
    session_id: str
    return_q: bool  # standard sampling: the stage sends its q for the next level (`SamplingParams.needs_q`)
    ms_per_token: float | None = None  # one of the stage's own tokens, as it said at open or last answered (None: not said)
    drafts_ahead: bool = False  # the service extends the session's proposals ahead (StageOptions.draft_ahead)
    ahead_forward_ms: float | None = None  # what one of its forwards ahead costs, as it last answered (None: not said)


class RemoteStage:
    def __init__(self, stub: stage_pb2_grpc.StageServiceStub, *, timeout_s: float = 60.0, sparse_q: bool = False,
                 counters: WireCounters | None = None, metadata: Metadata = (), info: StageInfo | None = None):
        self.stub = stub
        self.timeout_s = timeout_s
        self.sparse_q = sparse_q
        self.counters = counters or WireCounters()
        self.metadata = tuple(metadata) or None
        self._info = info  # known already (saves a GetInfo), or asked on first use

    async def info(self) -> StageInfo:
        if self._info is None:
            model = (await self.stub.GetInfo(stage_pb2.StageGetInfoRequest(), timeout=self.timeout_s,
                                             metadata=self.metadata)).model
            self._info = StageInfo(model.vocab_size, model.max_context_tokens, model.tokenizer_fingerprint)
        return self._info

    async def max_context(self) -> int:
        return (await self.info()).max_context

    async def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> RemoteStageSession:
        """`params.seed` is this stage's own seed (`specmesh.cascade.plan.stage_seed`)."""
        await self.info()
        response = await self.stub.OpenSession(stage_pb2.StageOpenSessionRequest(
            prompt_token_ids=list(prompt_ids), sampling=_token_level(params)), timeout=self.timeout_s, metadata=self.metadata)
        return RemoteStageSession(response.session_id, return_q=params.needs_q,
                                  ms_per_token=response.ms_per_token if response.HasField("ms_per_token") else None,
                                  drafts_ahead=response.drafts_ahead)

    def opened_ms_per_token(self, session: RemoteStageSession) -> float | None:
        return session.ms_per_token

    def drafts_ahead(self, session: RemoteStageSession) -> bool:
        return session.drafts_ahead

    def ahead_forward_ms(self, session: RemoteStageSession) -> float | None:
        return session.ahead_forward_ms

    async def verify_and_extend(self, session: RemoteStageSession, accepted: Sequence[int], draft: Sequence[int],
                                q: torch.Tensor | None, num_extend: int, fill_to: int = 0) -> StageOutput:
        vocab_size = (await self.info()).vocab_size
        request = stage_pb2.VerifyAndExtendRequest(
            session_id=session.session_id, accepted_token_ids=list(accepted), draft_token_ids=list(draft),
            num_extend_tokens=num_extend, fill_to_tokens=fill_to, return_distributions=session.return_q, deterministic_draft=q is None)
        if q is not None and len(draft):
            request.distributions.CopyFrom(distributions_to_pb(q, q.dtype, self.sparse_q, vocab_size))
        response = await self.stub.VerifyAndExtend(request, timeout=self.timeout_s, metadata=self.metadata)
        self.counters.add(request, response)
        if response.HasField("ms_per_token"):
            session.ms_per_token = response.ms_per_token  # its cost now: the cascade's figure after this round
        session.ahead_forward_ms = response.ahead_forward_ms if response.HasField("ahead_forward_ms") else None
        return stage_output_from_pb(response, len(draft), num_extend, session.return_q, vocab_size, fill_to)

    async def close(self, session: RemoteStageSession) -> None:
        await _close_quietly(self.stub.CloseSession(stage_pb2.StageCloseSessionRequest(session_id=session.session_id),
                                                    timeout=self.timeout_s, metadata=self.metadata))


def stage_output_from_pb(response: stage_pb2.VerifyAndExtendResponse, num_draft: int, num_extend: int, with_q: bool,
                         vocab_size: int, fill_to: int = 0) -> StageOutput:
    """The StageOutput a VerifyAndExtendResponse reports, or ValueError when it cannot be one: a
    proposal of the accepted draft tokens plus `num_extend` own tokens (or as many as make `fill_to`),
    with q when asked."""
    tokens = token_ids_from_pb(response.proposal_token_ids, vocab_size, "proposal_token_ids")
    num_accepted = response.num_accepted_tokens
    if num_accepted > num_draft or len(tokens) != max(num_accepted + num_extend, fill_to):
        raise ValueError(f"malformed VerifyAndExtendResponse: {len(tokens)} tokens for {num_accepted} of {num_draft} "
                         f"draft tokens accepted, {num_extend} extension tokens and a fill to {fill_to}")
    q = distributions_from_pb(response.distributions, len(tokens), vocab_size) if with_q else None
    if with_q and q is None:
        raise ValueError("malformed VerifyAndExtendResponse: the stage sent no distributions for a sampled session")
    features = [TokenFeatures(f.entropy_nats, f.top1_prob, f.token_logprob) for f in response.features]
    return StageOutput(num_accepted, tokens, q, features)
