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
