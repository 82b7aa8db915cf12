"""Per-request speculation statistics, with vLLM's definitions.

- acceptance rate = accepted draft tokens / draft tokens
- mean accepted length = 1 + accepted draft tokens / drafts: tokens emitted per verification round
  that carried a draft (the +1 is the recovered or bonus token)
- accepted_per_position[i] = how many times draft position i was accepted; divided by the number of
  rounds that drafted at least i + 1 tokens it gives the per-position acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    num_drafts: int = 0  # verification rounds with >= 1 draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [max k seen]
    drafted_per_position: list[int] = field(default_factory=list)  # [max k seen] rounds that drafted position i
    num_generated_tokens: int = 0
    num_target_forwards: int = 0  # prefill + one per verification round
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    wall_ms: float = 0.0  # first forward to last token
    seed: int = 0
    num_withheld_drafts: int = 0  # drafts not verified: their estimated acceptance did not pay (SpeculationState.gate)
    plan: str = ""  # how the request ran: a `specmesh.decoding.plan.Plan` value ("" in-process)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated_tokens / (self.wall_ms / 1e3) if self.wall_ms > 0 else 0.0

    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def record_round(self, num_drafted: int, num_accepted: int, draft_ms: float, verify_ms: float) -> None:
        """One verification round: `num_drafted` draft tokens offered (a chain or a tree path's
        depth), `num_accepted` of them kept."""
        self.num_target_forwards += 1
        self.draft_ms += draft_ms
        self.verify_ms += verify_ms
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        grow = num_drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for position in range(num_drafted):
            self.drafted_per_position[position] += 1
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def merge(self, other: SpecStats) -> None:
        """Add another request's counts (aggregate stats, e.g. for a service's totals)."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for mine, theirs in ((self.accepted_per_position, other.accepted_per_position),
                             (self.drafted_per_position, other.drafted_per_position)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, value in enumerate(theirs):
                mine[i] += value
        self.num_generated_tokens += other.num_generated_tokens
        self.num_target_forwards += other.num_target_forwards
        self.num_withheld_drafts += other.num_withheld_drafts
        self.draft_ms += other.draft_ms
        self.verify_ms += other.verify_ms
        self.wall_ms += other.wall_ms

    def summary(self) -> str:
        return (
            f"{self.num_generated_tokens} tokens, {self.tokens_per_s:.1f} tok/s; "
            f"acceptance {self.acceptance_rate:.0%}, mean accepted length {self.mean_accepted_length:.2f}, "
            f"{self.num_target_forwards} target forwards; draft {self.draft_ms:.0f} ms, verify {self.verify_ms:.0f} ms"
        )
