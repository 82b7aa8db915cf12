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
