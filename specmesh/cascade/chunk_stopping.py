"""The adaptive (lossy, opt-in) cascade at run time: one session's stop-or-go-on decision per chunk.

A *chunk* is what the cascade hands the target in one round: stage j's proposal, cut to the cap of
the level above (`specmesh.cascade.plan`). After every stage that ran this round the pipeline asks
`decide`; on "stop" the chunk is returned as an `unverified` `DraftProposal` and the driver commits
it without the target's verification (`SpeculationState.record_unverified`). The levels above j never
see it this round: next round they are told it as confirmed tokens like any others and feed it as
context in their next forward (`TargetVerifier.rewind` / `append_unverified`), so an early stop costs
no extra forward anywhere.

Stopper stages (`policy.AdaptiveStopper`): 0..S-1 are the pipeline's S stages (the base drafter is not
one: it has no distributions to read features from), S is the target. The stopper learns: each chunk
that went on is judged by the next level, and `observe(j, agreed)` updates stage j's Beta posterior
    stage j+1 ran this round:   agreed = it accepted the whole chunk (num_accepted >= len(chunk))
    j = S-1 (the target next):  known only from the next round's news: the target emitted the chunk
                                whole and one token more (a rejected token is never re-sampled: the
                                residual max(0, p - q) is 0 there), so
                                agreed = len(news) > len(chunk) and news[:len(chunk)] == chunk
A chunk whose judge never reports (the generation ended, or a retired stage sat between) is not
observed. lam = inf never stops (the stopper does not even run the predictor), so the tokens are
exactly the lossless pipeline's; lam = 0 stops at stage 0 every round.

Worked example (S = 2 stages, chunk of 3 tokens [a, b, c] from stage 1 that went on):
    the target's news next round [a, b, c, d]  -> agreed (all 3 kept, d its bonus token)
    the target's news next round [a, x]        -> disagreed (b rejected, x recovered)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from specmesh.cascade.plan import StageCall, StageStats
from specmesh.cascade.policy import AdaptiveStopper
from specmesh.cascade.stage_model import StageOutput
from specmesh.decoding.proposal import DraftProposal


def target_agreed(chunk: Sequence[int], news: Sequence[int]) -> bool:
    """Did the target accept the whole chunk it verified, given the tokens it emitted for it?

    >>> target_agreed([5, 6, 7], [5, 6, 7, 8]), target_agreed([5, 6, 7], [5, 9])
    (True, False)
    """
    n = len(chunk)
    return len(news) > n and [int(t) for t in news[:n]] == [int(t) for t in chunk]


@dataclass
class _Waiting:
    stage: int  # the stage whose chunk went on
    tokens: list[int]  # the chunk


class ChunkStopping:
    """One generation's decisions (module docstring). Not thread-safe: the session's driver calls it."""

    def __init__(self, stopper: AdaptiveStopper, num_stages: int, num_prompt_tokens: int, lam: float | None = None):
        if stopper.num_stages != num_stages + 1:
            raise ValueError(f"the stopper was made for {stopper.num_stages} levels; this cascade has "
                             f"{num_stages} stages and the target ({num_stages + 1})")
        if lam is not None and (math.isnan(lam) or lam < 0):
            raise ValueError(f"lambda must be >= 0 (inf = lossless), got {lam}")
        self.stopper = stopper
        self.num_stages = num_stages
        self.num_prompt_tokens = num_prompt_tokens
        self.lam = stopper.lam if lam is None else lam
        self.features = stopper.new_session(num_prompt_tokens)
        self.num_chunks_to_target = 0  # chunks the target verified (the lossless outcome)
        self._waiting: _Waiting | None = None

    def start_round(self, news: Sequence[int], stats: Sequence[StageStats]) -> None:
        """The target's news (tokens it emitted since the last round) judges the last stage's chunk, if
        that chunk went to the target last round."""
        waiting, self._waiting = self._waiting, None
        if waiting is not None and waiting.stage == self.num_stages - 1 and news:
            self._observe(waiting.stage, target_agreed(waiting.tokens, news), stats)

    def stage_verified(self, index: int, call: StageCall, out: StageOutput, stats: Sequence[StageStats]) -> None:
        """Stage `index` verified `call.draft`: the judgment of stage index-1's chunk, when that went on."""
        waiting, self._waiting = self._waiting, None
        if waiting is not None and waiting.stage == index - 1 and waiting.tokens == list(call.draft.token_ids):
            self._observe(waiting.stage, out.num_accepted >= len(waiting.tokens), stats)

    def decide(self, index: int, call: StageCall, out: StageOutput, chunk: DraftProposal, num_generated_tokens: int,
               stats: Sequence[StageStats]) -> bool:
        """Stop at stage `index` with `chunk` (its output as sent up)? Counts a stop in `stats`."""
        x = self.features.chunk(index, out.features[:chunk.num_tokens], call.draft.num_tokens, out.num_accepted,
                                num_generated_tokens)
        if self.stopper.decide(index, x, lam=self.lam).stop:
            stats[index].num_chunks_stopped += 1
            self._waiting = None
            return True
        self._waiting = _Waiting(index, list(chunk.token_ids))
        return False

    def sent_to_target(self, proposal: DraftProposal) -> None:
        """The round's proposal goes to the target for verification."""
        if proposal.num_tokens:
            self.num_chunks_to_target += 1

    def _observe(self, stage: int, agreed: bool, stats: Sequence[StageStats]) -> None:
        self.stopper.observe(stage, agreed)
        stats[stage].num_chunks_judged += 1
        stats[stage].num_chunks_agreed += int(agreed)
