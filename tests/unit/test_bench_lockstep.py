"""bench/never_costs.py's lockstep timing: every stream runs to its end, its events kept in order, and
each is timed on its own steps only (what another stream's steps take is not charged to it)."""

from __future__ import annotations

import time

from bench.never_costs import lockstep, one_by_one


def _stream(name: str, steps: int, step_s: float):
    for i in range(steps):
        time.sleep(step_s)
        yield f"{name}{i}"


def test_each_stream_is_timed_on_its_own_steps():
    timed = lockstep({"slow": _stream("s", 3, 0.02), "fast": _stream("f", 6, 0.0), "empty": _stream("e", 0, 0.0)})
    assert timed["slow"][0] == ["s0", "s1", "s2"] and timed["fast"][0] == [f"f{i}" for i in range(6)]
    assert timed["empty"][0] == []
    assert timed["slow"][1] >= 0.06
    assert timed["fast"][1] < 0.02 and timed["empty"][1] < 0.02  # the slow stream's sleeps are not theirs


def test_one_by_one_runs_a_stream_alone():
    events, seconds = one_by_one(_stream("a", 2, 0.01))
    assert events == ["a0", "a1"] and seconds >= 0.02
