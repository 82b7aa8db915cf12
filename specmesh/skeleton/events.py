"""What a Skeleton-of-Thought answer streams (`specmesh.skeleton.answer`), as plain data.

Branch ids, as on the wire: `SKELETON_BRANCH` (0) is the plan, a point's id (1-based) its branch,
`MAIN_BRANCH` (-1) the answer (the merged text, or a direct answer).

    PlanText     a delta of the plan (branch 0); the last one has finish_reason and the plan's stats
    BranchText   a delta of a point's branch (first: its header line); the last one has finish_reason
    BranchEnd    a branch is over: its text and stats, or the error that ended it (reported in-band)
    AnswerText   a delta of a direct answer (no plan), on the main branch
    Merged       the last event, on the main branch: the merged answer (or a direct answer's last
                 delta), the request's summed stats, and `SkeletonSummary`
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specmesh.decoding.state import FinishReason
from specmesh.decoding.stats import SpecStats

MAIN_BRANCH = -1  # the answer: the merged text, or a direct answer
SKELETON_BRANCH = 0  # the plan; points are 1-based


@dataclass(frozen=True)
class TextDelta:
    branch_id: int
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None  # set on the stream's last delta, with its stats
    stats: SpecStats | None = None


class PlanText(TextDelta):
    """A delta of the plan (branch 0)."""


class BranchText(TextDelta):
    """A delta of one point's branch (`branch_id` is the point's id)."""


class AnswerText(TextDelta):
    """A delta of a direct answer (no plan), on the main branch."""


@dataclass(frozen=True)
class BranchEnd:
    point_id: int
    text: str = ""  # the branch's whole text (empty when it failed)
    stats: SpecStats | None = None
    finish_reason: FinishReason | None = None
    error: str = ""  # why it failed; its dependents still start, the merge keeps its title


@dataclass
class BranchSummary:
    """One point's branch, for the final stats (zeros for a point that never started)."""

    point_id: int
    title: str
    est_tokens: int  # the plan's estimate
    num_tokens: int = 0  # tokens the branch generated
    num_rounds: int = 0  # target forwards of the branch
    start_ms: float = 0.0  # since the request started
    wall_ms: float = 0.0  # the branch's own wall time
    finish_reason: FinishReason | None = None  # None: failed (`error`) or never finished
    error: str = ""


@dataclass
class SkeletonSummary:
    """How the answer went (the Coordinator sends it as `SkeletonStats`)."""

    max_parallel: int
    direct_reason: str = ""  # set when no branches ran: why
    skeleton_ms: float = 0.0  # request start -> the plan parsed
    num_skeleton_tokens: int = 0  # tokens the model wrote for the plan (EOS included)
    branches_ms: float = 0.0  # first branch started -> last branch ended
    total_ms: float = 0.0
    branches: list[BranchSummary] = field(default_factory=list)  # in plan order
    parallel_speedup_estimate: float = 0.0  # (skeleton_ms + the branches' summed wall_ms) / total_ms: an upper bound
    num_prefilled_branches: int = 0  # branches opened with a full prefill instead of a fork


@dataclass(frozen=True)
class Merged:
    text: str  # the merged answer; for a direct answer, its last delta
    finish_reason: FinishReason
    stats: SpecStats  # every round of the request (plan, branches or the direct answer), wall_ms set
    summary: SkeletonSummary
    token_ids: list[int] = field(default_factory=list)  # a direct answer's last delta's tokens (a merge has none)


SkeletonEvent = PlanText | BranchText | AnswerText | BranchEnd | Merged
