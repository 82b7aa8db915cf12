"""Stage service options (flags / YAML keys)."""

from __future__ import annotations

from dataclasses import dataclass

from servicekit.options import ModelOptions, ServerOptions
from servicekit.quotas import QuotaOptions


@dataclass
class StageOptions(ServerOptions, ModelOptions, QuotaOptions):
    port: int = 50053
    max_draft_tokens: int = 64  # largest lower-stage draft accepted
    max_extend_tokens: int = 32  # largest num_extend_tokens and fill_to_tokens
    # greedy sessions: after answering, go on with this model's own tokens on the guess that the level above
    # confirms the proposal and then the stage's next token (specmesh/cascade/stage_model.py), so the next
    # call may be answered at once. The answers are the same either way; it pays where this process has
    # cores (or a device) of its own: on shared cores its forwards slow the level above's.
    draft_ahead: bool = False
