"""When a drafter drafts ahead: one rule for the Draft service (`draft_service.servicer`) and the
cluster simulator (`specmesh.sim.cluster`), so the simulated policy is the served one.

While the target verifies a round, a drafter may draft the next one on a guess of the verdict
(`specmesh.drafters.model`). A forward ahead runs on the engine a Propose needs, so one still running
when the session's next Propose arrives delays it. The rule: start a forward ahead if it ends before
that call is expected (the expectation being the session's moving average of the time from an answer
to its next call). One that would still run then is started only where the guess usually holds: on a
hit the call needs that forward anyway, and the part of it done before the call is saved; on a miss
the call waits for the rest of it. So it starts when hit_rate x (part done before) >= (1 - hit_rate)
x (the rest), the hit rate being the session's moving average of whether the verdict was the guess.
Until the times are measured, draft ahead; until a guess has been judged, only what ends in time. The
guess forward itself saves nothing unless a draft ahead follows it, so it is only started in time
(its callers pass no hit rate for it).

    >>> forward_pays(elapsed_ms=10.0, forward_ms=30.0, gap_ms=50.0)
    True
    >>> forward_pays(elapsed_ms=25.0, forward_ms=30.0, gap_ms=50.0)   # 5 ms late, no guess judged yet
    False
    >>> forward_pays(25.0, 30.0, 50.0, hit_rate=0.9)   # 25 ms saved 9 times in 10, 5 lost once
    True
    >>> forward_pays(45.0, 30.0, 50.0, hit_rate=0.8)   # 5 ms saved 8 times in 10, 25 lost twice
    False
    >>> forward_pays(0.0, 80.0, 50.0, hit_rate=0.5)   # a forward longer than the target's round
    True
    >>> forward_pays(60.0, 10.0, 50.0, hit_rate=0.99)   # the call is late: nothing of it is done before
    False
"""

from __future__ import annotations

AVERAGE_WEIGHT = 0.3  # the weight of the newest sample in the moving averages


def forward_pays(elapsed_ms: float, forward_ms: float | None, gap_ms: float | None, hit_rate: float | None = None) -> bool:
    """Whether to start a forward ahead `elapsed_ms` after the session's last answer (module docstring)."""
    if forward_ms is None or gap_ms is None:
        return True
    done_before = gap_ms - elapsed_ms  # of the forward, what is done when the call is expected
    rest = elapsed_ms + forward_ms - gap_ms  # what the call would wait for
    if rest <= 0:
        return True
    if hit_rate is None or done_before <= 0:
        return False
    return hit_rate * done_before >= (1.0 - hit_rate) * rest


def moving_average(old: float | None, new: float, weight: float = AVERAGE_WEIGHT) -> float:
    return new if old is None else old + weight * (new - old)
