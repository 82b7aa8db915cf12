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

from dataclasses import dataclass

AVERAGE_WEIGHT = 0.3  # the weight of the newest sample in the moving averages
PREFILL_WHILE_DRAFTING = 0.5  # share of a service's closed sessions that drafted, above which it prefills prompts at open


def prefill_at_open(share_drafting: float | None) -> bool:
    """Whether a service that drafts ahead takes a new session's prompt in at open, beside the level above's
    prefill (so its first call feeds a token or two): while most of its sessions draft (`share_drafting`, a
    moving average over the closed ones; None: none closed yet). Under a load where no draft pays, a session is
    never asked for a draft, and its prompt would be prefilled for nothing beside the target's forwards.

    >>> prefill_at_open(None), prefill_at_open(0.8), prefill_at_open(0.1)
    (True, True, False)
    """
    return share_drafting is None or share_drafting >= PREFILL_WHILE_DRAFTING


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


@dataclass
class AheadClock:
    """One session's measures for `forward_pays`, as a service sees its calls: when it answered last, the
    time from an answer to the next call and how often the verdict was the guess (moving averages).

    >>> clock = AheadClock()
    >>> clock.called(1.0); clock.answered(1.0); clock.called(1.05)   # a call 50 ms after the answer
    >>> round(clock.gap_ms, 3), clock.due(now=1.04, forward_ms=30.0, guessed=False)   # 10 ms done of 30: late
    (50.0, True)
    >>> clock.answered(2.0); clock.due(now=2.01, forward_ms=30.0, guessed=False)
    False
    """

    answered_at: float = 0.0  # perf_counter when its last call was answered (0: never)
    gap_ms: float | None = None
    hit_rate: float | None = None

    def called(self, now: float) -> None:
        if self.answered_at:
            self.gap_ms = moving_average(self.gap_ms, (now - self.answered_at) * 1e3)

    def judged(self, hit: bool | None) -> None:
        """The call's verdict was the guess ahead (None: nothing was guessed)."""
        if hit is not None:
            self.hit_rate = moving_average(self.hit_rate, float(hit))

    def answered(self, now: float) -> None:
        self.answered_at = now

    def due(self, now: float, forward_ms: float | None, guessed: bool) -> bool:
        """Whether one more forward ahead, `forward_ms` long, would not pay (module docstring); `guessed`: the
        session has a guess drafted ahead (else the forward makes it: started only if it ends in time)."""
        return not forward_pays((now - self.answered_at) * 1e3, forward_ms, self.gap_ms, self.hit_rate if guessed else None)
