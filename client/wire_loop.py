"""The speculation loop over the wire: Draft.Propose -> Verify.Verify, one session on each service.

    tokens, stats = run_wire_generation("127.0.0.1:50051", "127.0.0.1:50052", prompt_ids,
                                        SamplingParams(temperature=0, max_new_tokens=64), k=4)

It mirrors `specmesh.decoding.speculative.speculative_stream` round for round (same k choice, same
clipping at EOS / max_new_tokens / context, same seed split: the target uses the request seed, the
drafter `draft_seed(seed)`), so with the same models and seed it returns the same tokens as the
in-process `generate(..., k_policy=FixedK(k))`. q travels from the Draft to the Verify service as
the exact bytes the drafter sampled from (`q_dtype` float32 / float16 / bfloat16, dense or sparse).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Sequence

import grpc

from specmesh.decoding.adaptive import AdaptiveK, FixedK
from specmesh.decoding.sampling import SamplingParams, make_generator
from specmesh.decoding.speculative import FinishReason, StopChecker, clip_new_tokens
from specmesh.decoding.stats import SpecStats
from specmesh.proto.v1 import common_pb2, draft_pb2, draft_pb2_grpc, verify_pb2, verify_pb2_grpc

Q_DTYPES = {"float32": common_pb2.D_TYPE_FLOAT32, "float16": common_pb2.D_TYPE_FLOAT16, "bfloat16": common_pb2.D_TYPE_BFLOAT16}
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


@dataclass
class WireResult:
    token_ids: list[int]  # generated tokens (prompt excluded)
    finish_reason: FinishReason
    stats: SpecStats
    num_rounds: int = 0  # Propose + Verify rounds
    bytes_per_round: list[int] = field(default_factory=list)  # serialized Propose + Verify messages, both ways


def sampling_pb(params: SamplingParams, seed: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                     seed=seed, has_seed=True, max_new_tokens=params.max_new_tokens,
                                     ignore_eos=params.ignore_eos)


async def wire_generate(
    draft: draft_pb2_grpc.DraftServiceStub | None,
    verify: verify_pb2_grpc.VerifyServiceStub,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    k_policy: AdaptiveK | FixedK | None = None,
    q_dtype: str = "float32",
    sparse_q: bool = False,
    timeout_s: float = 60.0,
) -> WireResult:
    """One generation driven over gRPC (plain decoding on the Verify service when `draft` is None)."""
    info = (await verify.GetInfo(verify_pb2.VerifyGetInfoRequest(), timeout=timeout_s)).model
    params.validate(info.vocab_size)
    stop_checker = StopChecker(params.stop, None)
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(info.eos_token_ids))
    k_policy = k_policy or (AdaptiveK() if draft is not None else FixedK(0))
    _, seed = make_generator(params.seed)
    start = time.perf_counter()
    stats = SpecStats(seed=seed, num_target_forwards=1)
    opened = await verify.OpenSession(verify_pb2.VerifyOpenSessionRequest(
        prompt_token_ids=list(prompt_ids), sampling=sampling_pb(params, seed)), timeout=timeout_s)
    draft_session = None
    try:
        if draft is not None:
            draft_session = (await draft.OpenSession(draft_pb2.DraftOpenSessionRequest(
                prompt_token_ids=list(prompt_ids), sampling=sampling_pb(params, seed)), timeout=timeout_s)).session_id
        result = WireResult([], FinishReason.LENGTH, stats)
        new_tokens = [opened.first_token_id]
        since_last_draft = list(new_tokens)
        num_tokens = len(prompt_ids) + 1
        while True:
            kept, finish = clip_new_tokens(result.token_ids, new_tokens, params, stop_ids, stop_checker)
            result.token_ids.extend(kept)
            if finish is None and info.max_context_tokens - num_tokens <= 0:
                finish = FinishReason.CONTEXT
            if finish is not None:
                result.finish_reason = finish
                stats.num_generated_tokens = len(result.token_ids)
                stats.wall_ms = (time.perf_counter() - start) * 1e3
                return result
            budget = min(params.max_new_tokens - len(result.token_ids) - 1, info.max_context_tokens - num_tokens)
            k = max(0, min(k_policy.next_k(), budget))
            request = verify_pb2.VerifyRequest(session_id=opened.session_id)
            round_bytes, draft_ms = 0, 0.0
            if draft is not None:
                propose = draft_pb2.ProposeRequest(
                    session_id=draft_session, accepted_token_ids=since_last_draft, num_draft_tokens=k,
                    return_distributions=not params.is_greedy, sparse_distributions=sparse_q,
                    distributions_dtype=Q_DTYPES[q_dtype])
                proposal = await draft.Propose(propose, timeout=timeout_s)
                since_last_draft = []
                draft_ms = proposal.draft_ms
                round_bytes += propose.ByteSize() + proposal.ByteSize()
                request.draft_token_ids.extend(proposal.draft_token_ids)
                request.tree_parents.extend(proposal.tree_parents)
                if proposal.HasField("distributions"):
                    request.distributions.CopyFrom(proposal.distributions)
            response = await verify.Verify(request, timeout=timeout_s)
            round_bytes += request.ByteSize() + response.ByteSize()
            num_drafted = len(request.draft_token_ids)
            stats.record_round(num_drafted, response.num_accepted_tokens, draft_ms, response.verify_ms)
            k_policy.update(num_drafted, response.num_accepted_tokens, draft_ms, response.verify_ms)
            result.num_rounds += 1
            result.bytes_per_round.append(round_bytes)
            new_tokens = list(response.accepted_token_ids)
            since_last_draft.extend(new_tokens)
            num_tokens += len(new_tokens)
    finally:
        await _close_quietly(verify.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=opened.session_id), timeout=timeout_s))
        if draft_session is not None:
            await _close_quietly(draft.CloseSession(draft_pb2.DraftCloseSessionRequest(session_id=draft_session), timeout=timeout_s))


async def _close_quietly(call) -> None:
    try:
        await call
    except grpc.aio.AioRpcError:
        pass  # the session already expired or the service went away: nothing left to free


def channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


async def wire_generation(draft_addr: str | None, verify_addr: str, prompt_ids: Sequence[int], params: SamplingParams,
                          k: int | None = 4, **kwargs) -> WireResult:
    """Open channels, run `wire_generate` with FixedK(k) (AdaptiveK when k is None), close."""
    async with channel(verify_addr) as verify_channel:
        draft_channel = channel(draft_addr) if draft_addr else None
        try:
            draft = draft_pb2_grpc.DraftServiceStub(draft_channel) if draft_channel else None
            policy = FixedK(k) if k is not None else None
            return await wire_generate(draft, verify_pb2_grpc.VerifyServiceStub(verify_channel), prompt_ids, params,
                                       k_policy=policy, **kwargs)
        finally:
            if draft_channel is not None:
                await draft_channel.close()


def run_wire_generation(draft_addr: str | None, verify_addr: str, prompt_ids: Sequence[int], params: SamplingParams,
                        k: int | None = 4, **kwargs) -> tuple[list[int], SpecStats]:
    """Blocking form for scripts and the demo: (generated token ids, speculation stats)."""
    result = asyncio.run(wire_generation(draft_addr, verify_addr, prompt_ids, params, k, **kwargs))
    return result.token_ids, result.stats
