"""When a drafter drafts ahead: one rule for the Draft service (`draft_service.servicer`) and the
cluster simulator (`specmesh.sim.cluster`), so the simulated policy is the served one.

While the target verifies a round, a drafter may draft the next one on a guess of the verdict
(`specmesh.drafters.model`). A forward ahead runs on the engine a Propose needs, so one still running
when the session's next Propose arrives delays it. The rule: start a forward ahead only if it ends
before that call is expected, the expectation being the session's moving average of the time from an
answer to its next call. Until both times are measured, draft ahead.

    >>> forward_fits(elapsed_ms=10.0, forward_ms=30.0, gap_ms=50.0)
    True
    >>> forward_fits(elapsed_ms=25.0, forward_ms=30.0, gap_ms=50.0)
    False
    >>> forward_fits(0.0, 80.0, 50.0)   # a forward longer than the target's round: never
    False
"""

from __future__ import annotations

AVERAGE_WEIGHT = 0.3  # the weight of the newest sample in the moving averages


def forward_fits(elapsed_ms: float, forward_ms: float | None, gap_ms: float | None) -> bool:
    """Whether a forward ahead started `elapsed_ms` after the session's last answer ends before its next call."""
    if forward_ms is None or gap_ms is None:
        return True
    return elapsed_ms + forward_ms <= gap_ms


def moving_average(old: float | None, new: float, weight: float = AVERAGE_WEIGHT) -> float:
    return new if old is None else old + weight * (new - old)
