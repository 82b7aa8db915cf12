"""The speculation round, once: a sans-IO state machine that every driver steps.

A driver (the in-process loop, the async loop over remote services, the Verify service's fused
`Step`, a cascade stage, a Skeleton-of-Thought branch) does the I/O: it asks the state what to do,
runs the draft and the verify wherever they live, and hands the outcome back.

    state = SpeculationState(params, num_prompt_tokens=len(prompt), max_context=..., eos_token_ids=...)
    event = state.start(first_token_id)              # the target's prefill produced the first token
    while not state.finished:
        k = state.next_k()                           # policy k, capped by budget and context
        step = state.draft_step(k)                   # the draft sub-step: ask the drafter, or not
        proposal = step.take(drafter.propose(..., step.new_tokens, k, ...)) if step.asks else DraftProposal([])
        outcome = verifier.verify(..., proposal)
        event = state.record(proposal.num_tokens, outcome.num_accepted, outcome.token_ids, draft_ms, verify_ms)

It holds no engine, no session and no socket. Everything a round decides lives here: the draft
length (from the `KPolicy`, capped by what is left of max_new_tokens and of the context window), the
finish rules (EOS or stop token, max_new_tokens, stop strings, a full context) and the statistics.

Worked example (greedy, max_new_tokens = 5, EOS = 2, prompt of 3 tokens, context of 64):
    start(7)                            emits [7]                   generated [7]
    next_k() with the policy at 4   ->  min(4, 5 - 1 - 1, 64 - 4) = 3
    record(3, 1, [8, 9])                emits [8, 9]                generated [7, 8, 9]
    next_k()                        ->  min(4, 5 - 3 - 1) = 1
    record(1, 1, [2, 5])                emits [2], finish EOS       (5 came after EOS: dropped)

Lossy, opt-in (an adaptive cascade stopped below the target): `record_unverified(tokens)` emits a
chunk the target did not verify; it costs no target forward and leaves the k policy alone, the event
says `unverified`, and `lossy` stays True for the rest of the generation.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specmesh.decoding.adaptive import AdaptiveK, FixedK, ForwardCost, KPolicy, Outlook
from specmesh.decoding.detokenize import TextStream
from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.stats import SpecStats

DRAFT_SEED_SALT = 0x5EED_D4AF  # the drafter's generator is seeded with seed ^ this
PLAIN_STRETCH_MAX = 16  # the longest plain stretch (rounds the drafter is not asked); see SpeculationState.plain_rounds
PLAIN_RUN_MAX = 64  # the most rounds plain_rounds_from_here hands out when the k policy sets no bound


def draft_seed(seed: int) -> int:
    """The drafter's seed for a request seed: the same split in-process and over the wire."""
    return seed ^ DRAFT_SEED_SALT


class FinishReason(enum.Enum):
    EOS = "eos"  # an EOS or stop token id (kept in the output)
    LENGTH = "length"  # max_new_tokens
    STOP = "stop"  # a stop string (the output is cut after the token that completes it)
    CONTEXT = "context"  # the model's context window is full


@dataclass
class StepEvent:
    """What one round added. The last event of a generation has `finish_reason` and `stats`."""

    token_ids: list[int]  # new tokens, in order (may be empty on the last event)
    num_draft_tokens: int = 0  # drafted this round
    num_accepted_tokens: int = 0  # of those, accepted
    finish_reason: FinishReason | None = None
    stats: SpecStats | None = None
    text: str = ""  # new visible text, when the state decodes (stop strings or streaming text)
    unverified: bool = False  # lossy: the tokens were committed without the target's verification


class DraftStep:
    """One round's draft sub-step, as every driver runs it (`SpeculationState.draft_step`):

        step = state.draft_step(k)
        if step.asks:                                # else the round verifies DraftProposal([])
            proposal = step.take(drafter.propose(draft_state, step.new_tokens, step.k, ...))

    `new_tokens`: what the sequence grew by since the drafter was last told (taken: the drafter
    must be told them now); `take` gates the drafter's proposal (`SpeculationState.gate`) unless
    the round's k was fixed by the caller, and hands the k policy the drafter's own figure for a draft
    token after these forwards (`drafter_ms_per_token`; `AdaptiveK.refresh_draft_cost`), so that no
    driver can leave a stale prior in place."""

    __slots__ = ("asks", "k", "new_tokens", "_state", "_gated")

    def __init__(self, state: SpeculationState, k: int, *, gated: bool):
        self.k = k
        self.asks = state.asks_drafter(k)
        self.new_tokens = state.take_draft_input() if self.asks else []
        self._state, self._gated = state, gated

    def take(self, proposal: DraftProposal, drafter_ms_per_token: float | None = None) -> DraftProposal:
        """The proposal this round verifies. `drafter_ms_per_token`: what the drafter says a draft token
        costs now, after this proposal's forwards (None: it says nothing)."""
        if not self.asks:
            raise RuntimeError("the drafter was not asked this round: the round verifies no draft")
        if isinstance(self._state.k_policy, AdaptiveK):
            self._state.k_policy.refresh_draft_cost(drafter_ms_per_token)
        return self._state.gate(proposal) if self._gated else proposal


class SpeculationState:
    """One generation's round-by-round state (module docstring). Not thread-safe; no I/O."""

    def __init__(
        self,
        params: SamplingParams,
        *,
        num_prompt_tokens: int,
        max_context: int,
        eos_token_ids: Sequence[int] = (),
        k_policy: KPolicy | None = None,
        has_drafter: bool = True,
        decode: Callable[[Sequence[int]], str] | None = None,
        prompt_ids: Sequence[int] = (),
        seed: int = 0,
        vocab_size: int | None = None,
        plain_stretches: bool = False,
    ):
        params.validate(vocab_size)
        if params.stop and decode is None:
            raise ValueError("stop strings need a tokenizer to decode the output; this caller works on token ids")
        self.params = params
        self.num_prompt_tokens = num_prompt_tokens
        self.max_context = max_context
        self.stop_token_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.k_policy: KPolicy = k_policy or (AdaptiveK() if has_drafter else FixedK(0))
        self.has_drafter = has_drafter
        self.text = TextStream(decode, params.stop, prompt_ids) if decode is not None else None
        self.stats = SpecStats(seed=seed)
        self.generated: list[int] = []  # kept output tokens (the EOS / stop-completing token included)
        self.finish_reason: FinishReason | None = None
        self.num_tokens = num_prompt_tokens  # prompt + every token the target emitted (the pending one too)
        self._emitted: list[int] = []  # every token the target emitted, also past a finish (what the KV saw)
        self._num_told_drafter = 0
        self._round_catch_up = 0  # tokens this round's ask brought that a round after a draft would not
        # plain stretches apply to a policy's k only (a caller's fixed k is kept)
        self._stretches = plain_stretches and has_drafter and not isinstance(self.k_policy, FixedK)
        self._fruitless_rounds = 0  # rounds in a row that accepted no draft token (a stretch's not counted)
        self._last_round_drafted = True  # the round before drafted (the first round's drafter is up to date)
        self._stretch_left = 0  # rounds of the current plain stretch still to run
        self.num_unverified_tokens = 0  # emitted without the target's verification (lossy mode only)
        self._start_s = time.perf_counter()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def context_left(self) -> int:
        """Draft tokens that still fit in the context window after the pending token."""
        return max(0, self.max_context - self.num_tokens)

    @property
    def max_draft_tokens(self) -> int:
        """The most draft tokens the next round may verify: the last round may emit up to
        max_new_tokens (k accepted + 1), and every token must fit in the context window."""
        return max(0, min(self.params.max_new_tokens - len(self.generated) - 1, self.context_left))

    def start(self, first_token_id: int, prefill_ms: float = 0.0) -> StepEvent:
        """The target's prefill emitted the first token (one target forward)."""
        if self.num_tokens != self.num_prompt_tokens:
            raise RuntimeError("start() is called once, before any round")
        self.stats.num_target_forwards += 1
        self.stats.verify_ms += prefill_ms
        return self._emit([first_token_id], 0, 0)

    def next_k(self, requested: int | None = None) -> int:
        """Draft length for the next round: `requested` (a caller's fixed k) or the policy's, capped
        by `max_draft_tokens`; 0 without a drafter."""
        self._check_not_finished()
        if not self.has_drafter:
            return 0
        if requested is None and self._stretch_left:
            return 0
        k = self.k_policy.next_k() if requested is None else requested
        return max(0, min(k, self.max_draft_tokens))

    def prior_costs(self, draft_ms_per_token: float | None, decode_ms: float | None,
                    catch_up_ms_per_token: float | None = None, forward_cost: ForwardCost | None = None) -> None:
        """Costs known before the first round, for a k policy that prices rounds (`AdaptiveK.prior_costs`);
        other policies take none."""
        if isinstance(self.k_policy, AdaptiveK):
            self.k_policy.prior_costs(draft_ms_per_token, decode_ms, catch_up_ms_per_token, forward_cost)

    def draft_step(self, k: int, *, fixed_k: bool = False) -> DraftStep:
        """The draft sub-step of a round at draft length `k` (`DraftStep`): whether the drafter is
        asked, what it is told, and the gate its proposal passes (none when `fixed_k`: a caller's
        k for this round, verified as drafted)."""
        return DraftStep(self, k, gated=not fixed_k)

    def asks_drafter(self, k: int) -> bool:
        """Whether this round calls the drafter: when it drafts (k > 0), when the round before did
        (the drafter must hear the verdict on its draft before anything else: `Drafter.propose`), and
        on the last round (k capped at 0 by the budget). Other rounds at k = 0 leave their tokens for
        the next draft to take in (over the wire: no Propose call for nothing)."""
        return self.has_drafter and (k > 0 or self._last_round_drafted or self.max_draft_tokens == 0)

    def plain_rounds(self) -> int:
        """Rounds of the current plain stretch that will decode plainly whatever the drafter says (a
        driver hands a stretch to the verifier in one go through `plain_rounds_from_here`). Only
        with `plain_stretches` and a policy's k (a fixed k is kept): after m
        rounds in a row that accepted no draft token (the policy's k was 0, `gate` withheld the
        draft, the drafter had none, or all of it was rejected), the next min(2^(m-1),
        PLAIN_STRETCH_MAX) rounds are plain without asking the drafter (it is told their tokens
        afterwards, so an n-gram index still scores them). An accepted draft token ends the streak.
        The target's tokens are the same either way; only which rounds draft changes. A stretch
        right after a draft starts one round later: that round still tells the drafter its verdict
        (`asks_drafter`)."""
        return 0 if self._last_round_drafted else self._stretch_left

    def plain_rounds_from_here(self) -> int:
        """For a round with nothing to verify (k = 0, or its draft empty or withheld): how many rounds
        decode plainly from this one on, counting it, or 1 without plain stretches. A driver may run
        them in one go. They are this round and the plain stretch that recording it starts
        (`plain_rounds`), and more while the k policy stays at 0 (`KPolicy.plain_rounds_ahead`): its
        rounds at k = 0 are plain too, each one ending a stretch starting the next, up to the first
        round after a stretch at which the policy drafts (at most PLAIN_RUN_MAX rounds when it sets no
        bound). Were the policy's costs to change within them, the rounds stay plain: only which
        rounds draft changes, never the target's tokens."""
        if not self._stretches:
            return 1
        policy_rounds = self.k_policy.plain_rounds_ahead()
        until = PLAIN_RUN_MAX if policy_rounds is None else policy_rounds
        # a stretch deferred by the round before's draft (this round is its first), else none yet; then a round
        # after a stretch (this one first) and the stretch recording it starts, while the policy stays at 0
        rounds, fruitless = self._stretch_left, self._fruitless_rounds
        while not rounds or rounds < until:
            rounds, fruitless = rounds + 1 + min(PLAIN_STRETCH_MAX, 2**fruitless), fruitless + 1
        return rounds

    def gate(self, proposal: DraftProposal) -> DraftProposal:
        """The proposal to verify: none (plain decoding this round) when the drafter estimates its
        first token's acceptance and the k policy says that does not pay (`KPolicy.pays`); else as
        drafted. Withholding a draft changes the speed only: the target's tokens are the same."""
        if proposal.acceptance is None or not proposal.num_tokens or proposal.unverified:
            return proposal
        if self.k_policy.pays(proposal.acceptance):
            return proposal
        self.stats.num_withheld_drafts += 1
        return DraftProposal(token_ids=[])

    def take_draft_input(self) -> list[int]:
        """Tokens the sequence grew by since the drafter was last told (the `accepted_since_last`
        of `Drafter.propose`); telling it is the caller's job once this returns."""
        up_to_date = self._drafter_primed and self._last_round_drafted  # it brings the verdict on its draft
        self._round_catch_up = 0 if up_to_date else self._catch_up_tokens()
        new = self._emitted[self._num_told_drafter:]
        self._num_told_drafter = len(self._emitted)
        return new

    @property
    def _drafter_primed(self) -> bool:
        """The drafter was asked once (it took in the prompt then): the first token precedes any ask."""
        return self._num_told_drafter > 0

    def _catch_up_tokens(self) -> int:
        """Tokens the drafter takes in at its next ask: those emitted since it was last told, and the
        prompt if it was never asked (a model drafter prefills it lazily, with its first proposal)."""
        return len(self._emitted) - self._num_told_drafter + (0 if self._drafter_primed else self.num_prompt_tokens)

    def record(
        self,
        num_drafted: int,
        num_accepted: int,
        token_ids: Sequence[int],
        draft_ms: float = 0.0,
        verify_ms: float = 0.0,
        cost: ForwardCost | None = None,
    ) -> StepEvent:
        """Fold in one verified round: `num_drafted` draft tokens (a tree counts its accepted path's
        depth bound, the chain its length), `num_accepted` kept, and `token_ids` the accepted tokens
        plus the final one, as the target's sequence grew; `cost`: the verify forward's, when known."""
        self._check_not_finished()
        if len(token_ids) != num_accepted + 1:
            raise ValueError(f"a round emits num_accepted + 1 = {num_accepted + 1} tokens, got {len(token_ids)}")
        self.stats.record_round(num_drafted, num_accepted, draft_ms, verify_ms)
        catch_up = self._round_catch_up if num_drafted > 0 else 0
        self._round_catch_up = 0
        # the next round's catch-up, were it to draft: what this one leaves untold, and its own tokens
        outlook = Outlook(self._catch_up_tokens() + len(token_ids) if num_drafted == 0 else 0,
                          self.params.max_new_tokens - len(self.generated) - len(token_ids))
        self.k_policy.update(num_drafted, num_accepted, draft_ms, verify_ms, cost, catch_up=catch_up, outlook=outlook)
        self._last_round_drafted = num_drafted > 0
        self._count_fruitless(num_accepted)
        return self._emit(list(map(int, token_ids)), num_drafted, num_accepted)

    @property
    def lossy(self) -> bool:
        """True once any chunk was committed without the target's verification."""
        return self.num_unverified_tokens > 0

    def record_unverified(self, token_ids: Sequence[int], draft_ms: float = 0.0) -> StepEvent:
        """Fold in a chunk the drafter committed without the target's verification (lossy, opt-in: an
        adaptive cascade stopped below the target). The driver tells the target to take the tokens as
        context (`TargetVerifier.append_unverified`); they are told to the drafter like any others.
        1 <= len(token_ids) <= the round's `max_draft_tokens`, as a draft of that round would be."""
        self._check_not_finished()
        if not 1 <= len(token_ids) <= self.max_draft_tokens:
            raise ValueError(f"an unverified chunk has 1..{self.max_draft_tokens} tokens, got {len(token_ids)}")
        self.stats.draft_ms += draft_ms
        self.num_unverified_tokens += len(token_ids)
        event = self._emit(list(map(int, token_ids)), 0, 0)
        event.unverified = True
        return event

    def _count_fruitless(self, num_accepted: int) -> None:
        if num_accepted:
            self._fruitless_rounds = self._stretch_left = 0
        elif self._stretch_left:
            self._stretch_left -= 1
        elif self._stretches:
            self._fruitless_rounds += 1
            self._stretch_left = min(PLAIN_STRETCH_MAX, 2 ** (self._fruitless_rounds - 1))

    def _check_not_finished(self) -> None:
        if self.finish_reason is not None:
            raise RuntimeError(f"the generation has finished ({self.finish_reason.value})")

    def _emit(self, new_tokens: list[int], num_drafted: int, num_accepted: int) -> StepEvent:
        self._emitted.extend(new_tokens)
        self.num_tokens += len(new_tokens)
        kept, finish = self._clip(new_tokens)
        self.generated.extend(kept)
        text = ""
        if self.text is not None:
            text = self.text.take_delta()
        if finish is None and self.context_left == 0:
            finish = FinishReason.CONTEXT
        self.stats.num_generated_tokens = len(self.generated)
        if finish is None:
            return StepEvent(kept, num_drafted, num_accepted, text=text)
        self.finish_reason = finish
        if self.text is not None:
            text += self.text.finish()
        self.stats.wall_ms = (time.perf_counter() - self._start_s) * 1e3
        return StepEvent(kept, num_drafted, num_accepted, finish, self.stats, text)

    def _clip(self, new_tokens: list[int]) -> tuple[list[int], FinishReason | None]:
        """The part of `new_tokens` to keep, and why generation ends there (if it does): an EOS /
        stop token (kept), max_new_tokens, or a stop string (cut after the token completing it)."""
        kept: list[int] = []
        finish = None
        for token in new_tokens:
            kept.append(token)
            if token in self.stop_token_ids:
                finish = FinishReason.EOS
                break
            if len(self.generated) + len(kept) >= self.params.max_new_tokens:
                finish = FinishReason.LENGTH
                break
        if self.text is not None:
            keep = self.text.add(kept)
            if keep is not None:
                return kept[:keep], FinishReason.STOP
        return kept, finish
