"""Draft service options (flags / YAML keys)."""

from __future__ import annotations

from dataclasses import dataclass

from servicekit.options import CoreOptions, ModelOptions, ServerOptions
from servicekit.quotas import QuotaOptions

DRAFTERS = ("model", "ngram", "ngram-store")


@dataclass
class DraftOptions(ServerOptions, ModelOptions, QuotaOptions, CoreOptions):
    port: int = 50051
    drafter: str = "model"  # model | ngram (prompt lookup) | ngram-store (may draft token trees)
    ngram_min_n: int = 1
    ngram_max_n: int = 4
    ngram_max_branching: int = 1  # ngram-store: > 1 proposes token trees
    max_draft_tokens: int = 64  # largest k a Propose may ask for
    batch_window_ms: float = 2.0  # how long the batcher collects concurrent Propose calls
    max_batch_sessions: int = 64  # sessions per batched draft forward
    # model drafter: after answering a Propose of k tokens, keep drafting k more on the guess that the
    # target accepts them all (specmesh/drafters/model.py), so the next Propose may be answered at once.
    # The drafts are the same either way; it pays where this process has cores of its own (cpus:).
    draft_ahead: bool = False
