"""BranchScheduler (LPT, max_parallel, dependencies, continuous admission) driven by fake branches
on a fake clock; merge in plan order with markers stripped."""

from __future__ import annotations

import heapq

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specmesh.skeleton.merge import format_section, merge, strip_markers
from specmesh.skeleton.schedule import BranchScheduler, Launch
from specmesh.skeleton.types import Point, Skeleton, Tool


def pts(*specs: tuple[int, tuple[int, ...]]) -> list[Point]:
    """(est_tokens, deps) per point, ids 1.. in order."""
    return [Point(i, est, Tool.NONE, deps, f"t{i}") for i, (est, deps) in enumerate(specs, 1)]


def simulate(points: list[Point], max_parallel: int, jitter: float = 0.0) -> tuple[list[tuple[float, float, Launch]], float]:
    """Fake branches: each runs est_tokens (+ jitter * id, so no two end together) time units;
    returns (start, end, launch) per branch and the makespan."""
    scheduler = BranchScheduler(points, max_parallel)
    now, events, log = 0.0, [], []
    def start(launches):
        for launch in launches:
            end = now + launch.point.est_tokens + jitter * launch.point.id
            heapq.heappush(events, (end, launch.point.id))
            log.append((now, end, launch))
    start(scheduler.admit())
    while events:
        now, point_id = heapq.heappop(events)
        start(scheduler.finish(point_id, f"text {point_id}"))
    assert scheduler.done
    return log, now


def test_lpt_order_for_independent_points():
    points = pts((10, ()), (50, ()), (30, ()), (50, ()), (20, ()))
    scheduler = BranchScheduler(points, max_parallel=2)
    assert [launch.point.id for launch in scheduler.admit()] == [2, 4]  # longest first, ties in plan order
    assert scheduler.admit() == []  # both slots taken
    assert [launch.point.id for launch in scheduler.finish(4, "")] == [3]
    assert [launch.point.id for launch in scheduler.finish(3, "")] == [5]
    assert [launch.point.id for launch in scheduler.finish(2, "")] == [1]
    assert scheduler.order == [2, 4, 3, 5, 1]


def test_lpt_makespan_on_the_textbook_example():
    """Sizes 3,3,2,2,2 on 2 machines: LPT gives 7, the worst list order (2,2,2,3,3) gives 8."""
    _, makespan = simulate(pts((3, ()), (3, ()), (2, ()), (2, ()), (2, ())), max_parallel=2)
    assert makespan == 7


def test_dependencies_start_after_they_finish_and_see_their_texts():
    points = pts((10, ()), (100, ()), (5, (1, 2)), (40, (1,)))
    log, makespan = simulate(points, max_parallel=4)
    started = {launch.point.id: (start, launch) for start, _, launch in log}
    assert started[4][0] == 10 and started[3][0] == 100
    assert started[3][1].dependencies == ((points[0], "text 1"), (points[1], "text 2"))
    assert started[4][1].dependencies == ((points[0], "text 1"),)
    assert makespan == 105


def test_continuous_admission_does_not_wait_for_a_wave():
    log, _ = simulate(pts((100, ()), (10, ()), (10, ()), (10, ())), max_parallel=2)
    starts = {launch.point.id: start for start, _, launch in log}
    assert starts == {1: 0, 2: 0, 3: 10, 4: 20}


def test_failed_branch_lets_dependents_start_without_its_text():
    points = pts((10, ()), (20, (1,)))
    scheduler = BranchScheduler(points, max_parallel=2)
    assert [launch.point.id for launch in scheduler.admit()] == [1]
    assert scheduler.fail(1, "UNAVAILABLE") == [Launch(points[1], ())]
    assert scheduler.failures == {1: "UNAVAILABLE"}


def test_invalid_use():
    with pytest.raises(ValueError, match="max_parallel"):
        BranchScheduler(pts((1, ())), max_parallel=0)
    with pytest.raises(ValueError, match="unknown point 3"):
        BranchScheduler(pts((1, (3,))), max_parallel=1)
    with pytest.raises(ValueError, match="dependency cycle"):
        BranchScheduler(pts((1, (2,)), (1, (1,))), max_parallel=1)
    scheduler = BranchScheduler(pts((1, ()), (1, ())), max_parallel=1)
    scheduler.admit()
    with pytest.raises(ValueError, match="not running"):
        scheduler.finish(2, "")


@st.composite
def plans(draw) -> list[Point]:
    num_points = draw(st.integers(1, 10))
    return [Point(i, draw(st.integers(1, 100)), Tool.NONE,
                  tuple(sorted(draw(st.sets(st.integers(1, i - 1), max_size=3)))) if i > 1 else (), f"t{i}")
            for i in range(1, num_points + 1)]


@given(plans(), st.integers(1, 5))
def test_invariants_on_random_plans(points, max_parallel):
    log, makespan = simulate(points, max_parallel, jitter=1e-3)
    assert sorted(launch.point.id for _, _, launch in log) == [p.id for p in points]  # each point once
    ends = {launch.point.id: end for _, end, launch in log}
    for start, _, launch in log:
        assert all(ends[d] <= start for d in launch.point.deps)  # dependencies first
        assert [p.id for p, _ in launch.dependencies] == sorted(launch.point.deps)
        running = sum(1 for s, e, _ in log if s <= start < e)
        assert running <= max_parallel
    # work conservation: between becoming ready and starting, a point only waits while all slots are busy
    ready = {launch.point.id: max([ends[d] for d in launch.point.deps], default=0.0) for _, _, launch in log}
    starts = {launch.point.id: start for start, _, launch in log}
    event_times = {0.0, *ends.values()}
    for point_id, start in starts.items():
        for t in event_times:
            if ready[point_id] <= t < start:
                assert sum(1 for s, e, _ in log if s <= t < e) == max_parallel
    # LPT: a point started at t is at least as long as every point ready at t that starts later
    for point_id, start in starts.items():
        for other, other_start in starts.items():
            if ready[other] <= start < other_start:
                mine, theirs = points[point_id - 1], points[other - 1]
                assert (mine.est_tokens, -mine.id) > (theirs.est_tokens, -theirs.id)
    assert makespan >= max(p.est_tokens for p in points)


# --- merge ------------------------------------------------------------------------------------------

SKELETON = Skeleton((Point(1, 40, Tool.NONE, (), "Why sleep matters"), Point(2, 60, Tool.SEARCH, (1,), "How to sleep better")))


def test_merge_in_plan_order_with_markers_stripped():
    texts = {2: "Keep a schedule.\n[END]", 1: "1.<40><None>[-] Sleep restores the body.\n\n\n\nIt helps memory. <None>"}
    assert merge(SKELETON, texts) == (
        "1. Why sleep matters\nSleep restores the body.\n\nIt helps memory.\n\n"
        "2. How to sleep better\nKeep a schedule."
    )


def test_merge_keeps_the_title_of_a_failed_point():
    assert merge(SKELETON, {1: "Text."}) == "1. Why sleep matters\nText.\n\n2. How to sleep better"
    assert format_section(SKELETON.points[1], "[PLAN][END]") == "2. How to sleep better"


@pytest.mark.parametrize("text, clean", [
    ("[PLAN]\nplain", "plain"),
    ("a <Search> b", "a  b"),
    ("x 3. < 40 > <None> [1, 2] y", "x  y"),
    ("brackets [like this] stay", "brackets [like this] stay"),
    ("3.5 < 4 is true", "3.5 < 4 is true"),
])
def test_strip_markers(text, clean):
    assert strip_markers(text) == clean
