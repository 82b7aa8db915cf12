"""One generation over the wire: the async speculation driver with the Draft and Verify services.

    tokens, stats = run_wire_generation("127.0.0.1:50051", "127.0.0.1:50052", prompt_ids,
                                        SamplingParams(temperature=0, max_new_tokens=64), k=4)

The round is `specmesh.decoding.state`, stepped by `specmesh.decoding.async_driver` over the gRPC
adapters of `servicekit.remote`; so with the same models and seed it returns the same tokens as the
in-process `generate(..., k_policy=FixedK(k))`. q travels from the Draft to the Verify service as
the exact values the drafter sampled from (`q_dtype` float32 / float16 / bfloat16, dense or sparse).
Used by the benches and integration tests that drive the services without a Coordinator (its home is
here, beside the adapters it steps, rather than in `client/`, the user's CLI).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from servicekit.channels import open_channel
from servicekit.remote import RemoteDrafter, RemoteVerifier, WireCounters
from specmesh.decoding.adaptive import FixedK, KPolicy
from specmesh.decoding.async_driver import generate_async
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.state import FinishReason
from specmesh.decoding.stats import SpecStats
from specmesh.proto.v1 import draft_pb2_grpc, verify_pb2_grpc

Q_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class WireResult:
    token_ids: list[int]  # generated tokens (prompt excluded)
    finish_reason: FinishReason
    stats: SpecStats
    num_rounds: int = 0  # Propose + Verify rounds
    bytes_per_round: list[int] = field(default_factory=list)  # serialized Propose + Verify messages, both ways


async def wire_generate(
    draft: draft_pb2_grpc.DraftServiceStub | None,
    verify: verify_pb2_grpc.VerifyServiceStub,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    k_policy: KPolicy | None = None,
    q_dtype: str = "float32",
    sparse_q: bool = False,
    timeout_s: float = 60.0,
) -> WireResult:
    """One generation driven over gRPC (plain decoding on the Verify service when `draft` is None)."""
    if q_dtype not in Q_DTYPES:
        raise ValueError(f"q_dtype must be one of {', '.join(Q_DTYPES)}, got {q_dtype!r}")
    counters = WireCounters()
    verifier = RemoteVerifier(verify, timeout_s=timeout_s, sparse_q=sparse_q, counters=counters)
    drafter = None if draft is None else RemoteDrafter(draft, q_dtype=Q_DTYPES[q_dtype], sparse_q=sparse_q,
                                                       timeout_s=timeout_s, counters=counters)
    events = await generate_async(verifier, drafter, prompt_ids, params, k_policy=k_policy)
    return WireResult([t for e in events for t in e.token_ids], events[-1].finish_reason, events[-1].stats,
                      len(counters.bytes_per_round), counters.bytes_per_round)


async def wire_generation(draft_addr: str | None, verify_addr: str, prompt_ids: Sequence[int], params: SamplingParams,
                          k: int | None = 4, **kwargs) -> WireResult:
    """Open channels, run `wire_generate` with FixedK(k) (AdaptiveK when k is None), close."""
    async with open_channel(verify_addr) as verify_channel:
        draft_channel = open_channel(draft_addr) if draft_addr else None
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
