"""Verify (target) service options (flags / YAML keys)."""

from __future__ import annotations

from dataclasses import dataclass

from servicekit.options import CoreOptions, ModelOptions, ServerOptions
from servicekit.quotas import QuotaOptions

FUSED_DRAFTERS = ("", "ngram", "ngram-store", "model")


@dataclass
class VerifyOptions(ServerOptions, ModelOptions, QuotaOptions, CoreOptions):
    port: int = 50052
    batch_window_ms: float = 2.0  # how long the batcher collects concurrent Verify calls
    max_batch_tokens: int = 4096  # tokens (1 + k per session) per batched verify forward
    prefill_chunk_tokens: int = 512  # prompt tokens per prefill forward; other sessions' rounds run between; 0 = one forward
    max_draft_tokens: int = 64  # largest k a Verify may carry
    max_fork_children: int = 64  # most children one Fork may create
    fused_drafter: str = "ngram"  # drafter hosted for Step: "" (none) | ngram | ngram-store | model
    fused_drafter_model: str = ""  # model spec of the fused model drafter; "" = the target's own weights
    fused_drafter_dtype: str = "bfloat16"  # dtype of the fused model drafter (self-draft at lower precision)
    share_kv: bool = True  # KV cache in shared memory (CPU): a Draft service of this model on this host copies its context's KV
    default_max_new_tokens: int = 256  # Generate's max_new_tokens when the request says 0
    skeleton_max_points: int = 32  # largest plan a constrained session may ask for (compile time grows with it)
    skeleton_max_title_bytes: int = 200
    skeleton_max_direct_bytes: int = 1000
    skeleton_grammars: int = 8  # compiled plan formats kept
