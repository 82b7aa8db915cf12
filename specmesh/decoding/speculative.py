"""The speculation loop, written once as a stream of events; `generate` collects it.

    for event in speculative_stream(verifier, drafter, prompt_ids, params):
        print(event.token_ids)            # tokens accepted this round, ready to stream
    result = generate(verifier, drafter, prompt_ids, params)   # the same loop, collected

Each round: the drafter proposes up to k tokens (k from the policy, capped by what is left of
max_new_tokens and of the context window), the target verifies them in one forward and emits the
accepted prefix plus one token of its own (words as in `specmesh.decoding.rejection`). With no
drafter (or k = 0) a round is one plain decoding step, so plain autoregressive decoding is this loop
with `drafter=None` — the baseline and the speculative path share every line that emits tokens.

Randomness: the target and the drafter each get a generator seeded from the request's seed
(`draft_seed` derives the drafter's), the same split the distributed services use, so a seeded run
is reproducible in-process and over the wire.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence


from specmesh.decoding.adaptive import AdaptiveK, FixedK
from specmesh.decoding.sampling import SamplingParams, make_generator
from specmesh.decoding.stats import SpecStats
from specmesh.decoding.verifier import TargetVerifier, timed
from specmesh.drafters.base import DraftProposal, Drafter

DRAFT_SEED_SALT = 0x5EED_D4AF  # the drafter's generator is seeded with seed ^ this


def draft_seed(seed: int) -> int:
    return seed ^ DRAFT_SEED_SALT


class FinishReason(enum.Enum):
    EOS = "eos"
    LENGTH = "length"
    STOP = "stop"
    CONTEXT = "context"  # the model's context window is full


@dataclass
class StepEvent:
    """What one round added. The last event of a stream has `finish_reason` and `stats`."""

    token_ids: list[int]  # new tokens, in order (may be empty on the last event)
    num_draft_tokens: int = 0  # drafted this round
    num_accepted_tokens: int = 0  # of those, accepted
    finish_reason: FinishReason | None = None
    stats: SpecStats | None = None


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens (prompt excluded); includes the EOS / stop-completing token
    finish_reason: FinishReason
    stats: SpecStats
    events: list[StepEvent] = field(default_factory=list)


class StopChecker:
    """Finds the first stop string in the decoded output; `decode` maps token ids to text."""

    def __init__(self, stops: Sequence[str], decode: Callable[[list[int]], str] | None):
        if stops and decode is None:
            raise ValueError("stop strings need a tokenizer to decode the output")
        self.stops = list(stops)
        self.decode = decode

    def tokens_to_keep(self, generated: list[int], num_new: int) -> int | None:
        """None if no stop string appears; else the shortest prefix length of `generated` whose
        text contains one (only prefixes ending in the newest `num_new` tokens are examined)."""
        if not self.stops:
            return None
        if not any(stop in self.decode(generated) for stop in self.stops):
            return None
        for length in range(len(generated) - num_new + 1, len(generated) + 1):
            text = self.decode(generated[:length])
            if any(stop in text for stop in self.stops):
                return length
        return len(generated)


def speculative_stream(
    verifier: TargetVerifier,
    drafter: Drafter | None,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    k_policy: AdaptiveK | FixedK | None = None,
    eos_token_ids: Sequence[int] | None = None,
    decode: Callable[[list[int]], str] | None = None,
) -> Iterator[StepEvent]:
    """Generate with speculative decoding (plain decoding when `drafter` is None); see module doc."""
    params.validate(verifier.engine.vocab_size)
    stop_checker = StopChecker(params.stop, decode)
    eos = set(verifier.engine.eos_token_ids if eos_token_ids is None else eos_token_ids)
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else eos)
    k_policy = k_policy or (AdaptiveK() if drafter is not None else FixedK(0))
    target_generator, seed = make_generator(params.seed, verifier.engine.device)
    draft_device = getattr(drafter, "device", "cpu")  # model drafters sample on their engine's device
    draft_generator, _ = make_generator(draft_seed(seed), draft_device)
    stats = SpecStats(seed=seed)
    start = time.perf_counter()

    session, prefill_ms = timed(verifier.open, prompt_ids, params, target_generator)
    draft_state = drafter.open(prompt_ids) if drafter is not None else None
    try:
        stats.num_target_forwards = 1
        stats.verify_ms = prefill_ms
        generated: list[int] = []
        new_tokens = [session.pending_token_id]  # the first token comes from the prefill
        since_last_draft = list(new_tokens)  # what the drafter has not been told yet
        num_drafted = num_accepted = 0
        while True:
            kept, finish = clip_new_tokens(generated, new_tokens, params, stop_ids, stop_checker)
            generated.extend(kept)
            stats.num_generated_tokens = len(generated)
            if finish is None and verifier.max_draft_tokens(session) == 0:
                finish = FinishReason.CONTEXT
            if finish is not None:
                stats.wall_ms = (time.perf_counter() - start) * 1e3
                yield StepEvent(kept, num_drafted, num_accepted, finish, stats)
                return
            yield StepEvent(kept, num_drafted, num_accepted)

            budget = min(params.max_new_tokens - len(generated) - 1, verifier.max_draft_tokens(session))
            k = max(0, min(k_policy.next_k(), budget))
            proposal, draft_ms = DraftProposal(token_ids=[]), 0.0
            if drafter is not None:
                proposal, draft_ms = timed(drafter.propose, draft_state, since_last_draft, k, params, draft_generator)
                since_last_draft = []
            outcome, verify_ms = timed(verifier.verify, session, proposal)
            num_drafted, num_accepted = proposal.num_tokens, outcome.num_accepted
            stats.record_round(num_drafted, num_accepted, draft_ms, verify_ms)
            k_policy.update(num_drafted, num_accepted, draft_ms, verify_ms)
            new_tokens = outcome.token_ids
            since_last_draft.extend(new_tokens)
    finally:
        verifier.close(session)
        if drafter is not None:
            drafter.close(draft_state)


def generate(
    verifier: TargetVerifier,
    drafter: Drafter | None,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    **kwargs,
) -> GenerationResult:
    """`speculative_stream`, collected."""
    events = list(speculative_stream(verifier, drafter, prompt_ids, params, **kwargs))
    tokens = [t for event in events for t in event.token_ids]
    return GenerationResult(tokens, events[-1].finish_reason, events[-1].stats, events)


def clip_new_tokens(
    generated: list[int],
    new_tokens: list[int],
    params: SamplingParams,
    stop_ids: set[int],
    stop_checker: StopChecker,
) -> tuple[list[int], FinishReason | None]:
    """The part of `new_tokens` to emit after `generated`, and why generation ends there (if it does):
    an EOS / stop token (kept), max_new_tokens, or a stop string (cut after its last token)."""
    kept: list[int] = []
    finish = None
    for token in new_tokens:
        kept.append(token)
        if token in stop_ids:
            finish = FinishReason.EOS
            break
        if len(generated) + len(kept) >= params.max_new_tokens:
            finish = FinishReason.LENGTH
            break
    keep = stop_checker.tokens_to_keep(generated + kept, len(kept))
    if keep is not None:
        return kept[: keep - len(generated)], FinishReason.STOP
    return kept, finish
