"""The contract every model backend serves: sequences with server-side KV, one ragged forward.

Glossary
- sequence: one KV history owned by the engine, named by an integer `seq_id`. Its *cached length*
  is how many tokens are in its KV cache.
- SeqInput: the new tokens one sequence contributes to a forward. They are appended to its KV.
  Positions continue from the cached length. With `parents` the new tokens form a tree: token i
  attends to the cached prefix, to itself and to its ancestors (following `parents`), nothing else;
  its position is cached_len + depth(i). Without `parents` they form a causal chain.
- logits_at: indices into the new tokens whose next-token logits are returned, in that order.

Worked example (tree, 2 branches x depth 2 after a cached prompt of 5 tokens):
    token_ids = [a, b, c, d]      parents = [-1, 0, -1, 2]   (a->b and c->d; -1 = child of prefix)
    positions = [5, 6, 5, 6]      b sees prefix+a+b; d sees prefix+c+d; c does not see a or b
After a tree forward the caller keeps one path with `keep_tree_path(seq_id, [2, 3])` (c, d),
which compacts the KV so the sequence reads prefix + c + d at positions 5, 6.

Layouts of forked branches (Skeleton-of-Thought): by default every SeqInput is its own row of the
forward ("batching": one padded attention problem per sequence, each reading the shared prefix's
keys itself). SeqInputs that carry the same `group` are laid out IN ONE SEQUENCE instead: one
attention row whose keys are the group's shared prefix once, then each member's own tokens side by
side (its *region*), under a block mask: a member's token sees the prefix, its own region (its own
chain or tree among the new tokens) and nothing of its siblings. A region is the member's own block
table past the shared blocks, so rejected drafts roll back inside it (`truncate` of that member)
without touching the prefix or the other regions. Positions stay each member's own, so a member's
logits are those of its sequence alone. Backends without packed attention (HF, encoder-decoder)
accept `group` and compute each member alone: the layout changes how the work is arranged, never
the numbers a member gets.

    keys:        p0 p1 p2 | a0 a1 | b0          (a and b forked from p0..p2; a has a0 cached, b has b0 new)
    query a1:    1  1  1    1  1    0           position 4
    query b0:    1  1  1    0  0    1           position 3
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

NO_PARENT = -1  # parents[i] == NO_PARENT: token i hangs directly off the cached prefix
DEFAULT_MAX_KV_TOKENS = 16384  # KV pool size in tokens (all sequences together) unless configured
DEFAULT_MAX_CONTEXT = 2048  # for configs that state no context length


def config_max_context(text_config) -> int:
    """The context window (tokens) a transformers text config states, or DEFAULT_MAX_CONTEXT."""
    return int(getattr(text_config, "max_position_embeddings", None) or getattr(text_config, "n_positions", None)
               or DEFAULT_MAX_CONTEXT)


class ContextLengthError(ValueError):
    """A sequence would grow past the model's maximum context; services map it to INVALID_ARGUMENT."""


@dataclass
class SeqInput:
    seq_id: int
    token_ids: list[int]  # [num_new]
    logits_at: list[int]  # indices into token_ids whose next-token logits come back
    parents: list[int] | None = None  # [num_new] tree parents (NO_PARENT = off the prefix); None = chain
    group: int | None = None  # inputs with one group share one attention row (module docstring: layouts)


@dataclass(frozen=True)
class KvUsage:
    """The KV pool: `total_blocks` of `block_size` tokens, `free_blocks` of them unused."""

    block_size: int
    total_blocks: int
    free_blocks: int


@dataclass
class EngineStats:
    num_forwards: int = 0  # forward calls (one ragged batch each)
    num_sequences_forwarded: int = 0  # sum of batch sizes
    num_tokens_forwarded: int = 0
    num_attention_rows: int = 0  # sum of attention rows (fewer than sequences when groups share a row)
    # wall ms of a one-token forward (a decode step of one sequence), averaged over the recent ones; None
    # until one ran. What a drafter's token and a target's step cost here, before a generation measures them
    step_ms: float | None = None
    # wall ms per token of a one-sequence forward of PREFILL_STAT_TOKENS or more (a prefill chunk), averaged the
    # same way: what a drafter's catch-up on tokens it was not told costs here (`AdaptiveK.prior_costs`)
    prefill_ms_per_token: float | None = None
    # ((tokens, wall ms), ...) of forwards of 1 and ROUND_STAT_TOKENS new tokens on a short context, timed by
    # `measure_step` as a verify round is; None until measured. What a draft token adds to a round here, before
    # rounds of different sizes have run (`TargetVerifier.forward_cost` starts its fit from them)
    round_timings: tuple[tuple[int, float], ...] | None = None

    def record_step(self, ms: float, weight: float = 0.2) -> None:
        self.step_ms = _moving_average(self.step_ms, ms, weight)

    def record_prefill(self, ms: float, tokens: int, weight: float = 0.2) -> None:
        self.prefill_ms_per_token = _moving_average(self.prefill_ms_per_token, ms / tokens, weight)


# a timing taken in is at most this times the average: on a shared machine a forward is slowed (another
# process's burst, a core taken away), never sped up, so one slow timing moves the average by 5% at most
# (weight 0.2), where uncapped a forward twice the usual moved it 20%: a bf16 self-draft's step went 9.6 ->
# 11.5 ms and a cluster's requests were priced below the draft gate (`AdaptiveK.could_pay`) and decoded
# plainly, 1.5x the time. A lasting slowdown still comes through, compounding 5% a forward
SLOW_TIMING_CAP = 1.25
# and a timing below the average is taken in at this weight at least: it is what the forward costs undisturbed.
# A figure that read high (timed while the machine was busy) comes down in two forwards, not eight
FAST_TIMING_WEIGHT = 0.5


def _moving_average(old: float | None, new: float, weight: float) -> float:
    if old is None:
        return new
    if new < old:
        weight = max(weight, FAST_TIMING_WEIGHT)
    return (1 - weight) * old + weight * min(new, SLOW_TIMING_CAP * old)


PREFILL_STAT_TOKENS = 8  # one-sequence forwards of this many tokens or more count as prefill (`EngineStats`)
ROUND_STAT_TOKENS = (5, 9)  # the verify chains `measure_step` times beside one-token steps (`EngineStats.round_timings`)


class Engine(Protocol):
    """Implemented by the native Llama-family engine and the HF fallback."""

    backend: str  # "native" | "hf"
    vocab_size: int
    max_context: int  # tokens
    eos_token_ids: tuple[int, ...]
    device: torch.device
    dtype: torch.dtype
    stats: EngineStats

    def new_sequence(self) -> int: ...

    def kv_usage(self) -> KvUsage: ...

    def fork(self, seq_id: int) -> int:
        """A child sequence sharing the parent's KV prefix (copy-on-write)."""
        ...

    def seq_len(self, seq_id: int) -> int: ...

    def truncate(self, seq_id: int, length: int) -> None:
        """Drop cached tokens past `length` (rollback of rejected tokens)."""
        ...

    def keep_tree_path(self, seq_id: int, node_indices: Sequence[int]) -> None:
        """After a tree forward, keep only the given nodes of the last forward's new tokens (a root-to-node
        path, in order) and drop the rest, so the sequence continues as a plain chain."""
        ...

    def free(self, seq_id: int) -> None: ...

    def forward(self, batch: Sequence[SeqInput]) -> list[torch.Tensor]:
        """One forward over a ragged batch; returns per input float32 logits [len(logits_at), vocab]."""
        ...


class TimingStopped(Exception):
    """`measure_step`'s `stop` said to give the cores back: the timing is abandoned, the stats as they were."""


def measure_step(engine: Engine, num_steps: int = 3, stop: Callable[[], bool] | None = None) -> float | None:
    """Time `num_steps` one-token forwards of a scratch sequence (freed after; the first, which may
    pay one-off set-up, is not timed) so `engine.stats.step_ms`, the fastest of them, is known before the
    first generation: the prior that lets a k policy skip a drafter that cannot pay here from its first
    round (`AdaptiveK.prior_costs`); then forwards of 1 and ROUND_STAT_TOKENS tokens on it, the fastest of
    two each, for `round_timings` (what a draft token adds to a round); then one scratch prefill of
    2 * PREFILL_STAT_TOKENS tokens for `prefill_ms_per_token` (what a drafter's catch-up costs per token).
    The fastest, not an average: a shared machine's noise only adds, and one slow step priced a bf16
    self-draft at 13.1 ms where its steps take 10.8-11.3, which decided that it could never pay. The
    scratch forwards are not counted in the other stats. None for a backend that does not time its steps.
    `stop`, asked before each forward: True abandons the timing (TimingStopped), the stats left as they were
    (a service timing on borrowed cores gives them back as soon as their owner wants them)."""
    if engine.backend != "native":
        return None
    kept = dataclasses.replace(engine.stats)
    stop = stop or (lambda: False)
    try:
        seq_id = engine.new_sequence()
        try:
            steps: list[float] = []
            for i in range(num_steps + 1):
                _check(stop)
                engine.stats.step_ms = None
                engine.forward([SeqInput(seq_id, [0], logits_at=[0])])
                if i > 0 and engine.stats.step_ms is not None:
                    steps.append(engine.stats.step_ms)
            engine.stats.step_ms = min(steps, default=kept.step_ms)
            engine.stats.round_timings = _time_rounds(engine, seq_id, stop)
        finally:
            engine.free(seq_id)
        _check(stop)
        seq_id = engine.new_sequence()
        try:
            engine.forward([SeqInput(seq_id, [0] * (2 * PREFILL_STAT_TOKENS), logits_at=[2 * PREFILL_STAT_TOKENS - 1])])
        finally:
            engine.free(seq_id)
    except TimingStopped:
        for field in dataclasses.fields(kept):
            setattr(engine.stats, field.name, getattr(kept, field.name))
        raise
    for name in (f.name for f in dataclasses.fields(kept) if f.name not in ("step_ms", "prefill_ms_per_token", "round_timings")):
        setattr(engine.stats, name, getattr(kept, name))
    return engine.stats.step_ms


def _check(stop: Callable[[], bool]) -> None:
    if stop():
        raise TimingStopped


def _time_rounds(engine: Engine, seq_id: int, stop: Callable[[], bool] = lambda: False) -> tuple[tuple[int, float], ...]:
    """((tokens, ms), ...) of forwards of 1 and ROUND_STAT_TOKENS tokens fed to `seq_id` (each the fastest of two,
    rolled back after; every row's logits asked for, as a verify forward asks), timed around `forward` as
    `TargetVerifier` times its rounds. The engine's own per-token times stay as they were."""
    kept = engine.stats.step_ms, engine.stats.prefill_ms_per_token
    length = engine.seq_len(seq_id)
    points = []
    for tokens in (1, *ROUND_STAT_TOKENS):
        best = float("inf")
        for _ in range(2):
            _check(stop)
            start = time.perf_counter()
            engine.forward([SeqInput(seq_id, [0] * tokens, logits_at=list(range(tokens)))])
            best = min(best, (time.perf_counter() - start) * 1e3)
            engine.truncate(seq_id, length)
        points.append((tokens, best))
    engine.stats.step_ms, engine.stats.prefill_ms_per_token = kept
    return tuple(points)
