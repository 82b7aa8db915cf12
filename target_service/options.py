"""Verify (target) service options (flags / YAML keys)."""

from __future__ import annotations

from dataclasses import dataclass

from servicekit.options import CoreOptions, ModelOptions, ServerOptions
from servicekit.quotas import QuotaOptions

FUSED_DRAFTERS = ("ngram", "ngram-store", "model")


def fused_drafter_names(value: str) -> tuple[str, ...]:
    """The drafters a `fused_drafter` value hosts, in order (the first is a Step's default): a comma list
    of FUSED_DRAFTERS names, "" for none. ValueError for an unknown or repeated name.

    >>> fused_drafter_names("ngram, model"), fused_drafter_names("")
    (('ngram', 'model'), ())
    """
    names = tuple(part.strip() for part in value.split(",") if part.strip())
    unknown = [name for name in names if name not in FUSED_DRAFTERS]
    if unknown:
        raise ValueError(f"unknown fused drafter {unknown[0]!r}; choose from {', '.join(FUSED_DRAFTERS)} (comma-separated)")
    if len(set(names)) != len(names):
        raise ValueError(f"fused_drafter {value!r} names a drafter twice")
    return names


@dataclass
class VerifyOptions(ServerOptions, ModelOptions, QuotaOptions, CoreOptions):
    port: int = 50052
    batch_window_ms: float = 2.0  # how long the batcher collects concurrent Verify calls
    max_batch_tokens: int = 4096  # tokens (1 + k per session) per batched verify forward
    prefill_chunk_tokens: int = 512  # prompt tokens per prefill forward; other sessions' rounds run between; 0 = one forward
    max_draft_tokens: int = 64  # largest k a Verify may carry
    max_fork_children: int = 64  # most children one Fork may create
    # drafters hosted for Step / Run, comma-separated, the first the default: "" (none) | ngram | ngram-store | model
    fused_drafter: str = "ngram"
    fused_drafter_model: str = ""  # model spec of the fused model drafter; "" = the target's own weights
    fused_drafter_dtype: str = "bfloat16"  # dtype of the fused model drafter (self-draft at lower precision)
    share_kv: bool = True  # KV cache in shared memory (CPU): a Draft service of this model on this host copies its context's KV
    default_max_new_tokens: int = 256  # Generate's max_new_tokens when the request says 0
    skeleton_max_points: int = 32  # largest plan a constrained session may ask for (compile time grows with it)
    skeleton_max_title_bytes: int = 200
    skeleton_max_direct_bytes: int = 1000
    skeleton_grammars: int = 8  # compiled plan formats kept
