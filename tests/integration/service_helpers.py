"""Small helpers the service tests share."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(predicate: Callable[[], bool], timeout_s: float) -> bool:
    """Poll `predicate` every 50 ms until it holds or `timeout_s` passes; its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def target_only_greedy(folder: str, prompt: str, max_new_tokens: int) -> list[int]:
    """The reference of the exactness tests: greedy target-only decoding of the raw `prompt`, in
    process, float64."""
    from transformers import AutoTokenizer

    from specmesh.decoding.sampling import SamplingParams
    from specmesh.decoding.speculative import generate
    from specmesh.decoding.verifier import TargetVerifier
    from specmesh.models.load import load_engine

    ids = AutoTokenizer.from_pretrained(folder).encode(prompt, add_special_tokens=False)
    params = SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=max_new_tokens)
    return generate(TargetVerifier(load_engine(folder, dtype="float64")), None, ids, params).token_ids


async def speculative_via_coordinator(address: str, prompt: str, k: int, timeout_s: float, **sampling):
    """A speculative request with the Draft service's drafts at a fixed k through the Coordinator at `address`, greedy
    and ignoring EOS unless `sampling` says otherwise (48 new tokens by default): (its tokens, its last message)."""
    from servicekit.channels import open_channel
    from specmesh.proto.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

    sampling = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 48, **sampling}
    request = coordinator_pb2.GenerateRequest(prompt=prompt, mode=coordinator_pb2.GENERATION_MODE_SPECULATIVE, drafter="service",
                                              num_draft_tokens=k, sampling=common_pb2.SamplingParams(**sampling))
    async with open_channel(address) as ch:
        tokens, last = [], None
        async for response in coordinator_pb2_grpc.CoordinatorServiceStub(ch).Generate(request, timeout=timeout_s):
            tokens += response.token_ids
            last = response
        return tokens, last
