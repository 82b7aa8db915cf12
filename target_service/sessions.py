"""What the Verify service keeps per session (the target KV lives in the engine, named by seq_id)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from specmesh.decoding.adaptive import AdaptiveK
from specmesh.decoding.verifier import TargetSession


@dataclass
class FusedDraft:
    """Step's in-process drafter state for one session."""

    state: Any  # the fused drafter's session state
    generator: torch.Generator  # seeded with draft_seed(seed)
    num_fed_tokens: int  # how many of VerifySession.token_ids the drafter has seen
    k_policy: AdaptiveK = field(default_factory=AdaptiveK)


@dataclass
class VerifySession:
    target: TargetSession
    token_ids: list[int]  # prompt + every emitted token (the last one is target.pending_token_id)
    num_prompt_tokens: int
    seed: int
    fused: FusedDraft | None = None
