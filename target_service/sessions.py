"""What the Verify service keeps per session (the target KV lives in the engine, named by seq_id)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from servicekit.rounds import RoundLog
from specmesh.decoding.state import SpeculationState
from specmesh.decoding.verifier import TargetSession


@dataclass
class FusedDraft:
    """Step's in-process drafter state for one session."""

    state: Any  # the fused drafter's session state
    generator: torch.Generator  # seeded with draft_seed(seed)
    name: str = ""  # which hosted drafter (a `fused_drafter` name): the session keeps it
    drafter: Any = None  # that drafter


@dataclass
class VerifySession:
    target: TargetSession  # the sequence: prompt + every emitted token (the last one pending)
    round: SpeculationState  # finish rules, k policy and stats of the session's rounds
    seed: int
    fused: FusedDraft | None = None
    rounds: RoundLog = field(default_factory=RoundLog)  # Verify / Step rounds applied (safe resends)
    encoder_input_ids: list[int] = field(default_factory=list)  # encoder-decoder targets: the session's encoder input
    principal: str = ""  # who opened it (a shared KV's tag names it: specmesh.kv.shared.kv_tag)
