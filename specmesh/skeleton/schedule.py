"""Which skeleton points to decode when: a pure scheduler, events in and launch decisions out.

Policy: list scheduling with longest-estimated-first (LPT). A point is *ready* once every point it
depends on has finished; whenever fewer than `max_parallel` branches run, the ready point with the
largest est_tokens starts (ties: plan order). Admission is continuous: each `finish` can start
branches at once, no waiting for a wave to end. A started point gets the texts of its dependencies.

The driver (the coordinator with real branches, a test with fake ones) does:

    scheduler = BranchScheduler(skeleton.points, max_parallel=4)
    start(scheduler.admit())                   # the first launches
    on a branch's end: start(scheduler.finish(point_id, text))   # or scheduler.fail(point_id, why)
    until scheduler.done

Worked example (max_parallel=2; est_tokens 10, 50, 30, 20; point 4 depends on point 2):
    >>> from specmesh.skeleton.types import Point, Tool
    >>> points = [Point(1, 10, Tool.NONE, (), "a"), Point(2, 50, Tool.NONE, (), "b"),
    ...           Point(3, 30, Tool.NONE, (), "c"), Point(4, 20, Tool.NONE, (2,), "d")]
    >>> scheduler = BranchScheduler(points, max_parallel=2)
    >>> [launch.point.id for launch in scheduler.admit()]      # LPT among the ready 1, 2, 3
    [2, 3]
    >>> [launch.point.id for launch in scheduler.finish(3, "C")]   # 4 still waits for 2
    [1]
    >>> [(launch.point.id, launch.dependencies) for launch in scheduler.finish(2, "B")]
    [(4, ((Point(id=2, est_tokens=50, tool=<Tool.NONE: 'None'>, deps=(), title='b'), 'B'),))]
    >>> scheduler.finish(1, "A"), scheduler.finish(4, "D"), scheduler.done
    ([], [], True)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specmesh.skeleton.parse import dependency_problem
from specmesh.skeleton.types import Point


@dataclass(frozen=True)
class Launch:
    """Start a branch for `point`; `dependencies` are (point, its text) for each finished point it
    depends on, in id order (a failed dependency is left out)."""

    point: Point
    dependencies: tuple[tuple[Point, str], ...]


class BranchScheduler:
    def __init__(self, points: Sequence[Point], max_parallel: int):
        if not isinstance(max_parallel, int) or max_parallel < 1:
            raise ValueError(f"max_parallel must be an integer >= 1, got {max_parallel!r}")
        self.points = {p.id: p for p in points}
        if len(self.points) != len(points):
            raise ValueError("point ids must be unique")
        problem = dependency_problem(points)
        if problem:
            raise ValueError(problem)
        self.max_parallel = max_parallel
        self.waiting: set[int] = set(self.points)  # not started yet
        self.running: set[int] = set()
        self.texts: dict[int, str] = {}  # finished points
        self.failures: dict[int, str] = {}  # failed points -> reason
        self.order: list[int] = []  # point ids in start order

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def admit(self) -> list[Launch]:
        """Start every branch that may start now (LPT among ready points, up to max_parallel)."""
        ended = self.texts.keys() | self.failures.keys()
        ready = [self.points[i] for i in self.waiting if all(d in ended for d in self.points[i].deps)]
        ready.sort(key=lambda p: (-p.est_tokens, p.id))
        launches = []
        for point in ready[:max(0, self.max_parallel - len(self.running))]:
            self.waiting.remove(point.id)
            self.running.add(point.id)
            self.order.append(point.id)
            deps = tuple((self.points[d], self.texts[d]) for d in sorted(point.deps) if d in self.texts)
            launches.append(Launch(point, deps))
        assert launches or self.running or not self.waiting, "acyclic dependencies always leave a ready point"
        return launches

    def finish(self, point_id: int, text: str) -> list[Launch]:
        """Point `point_id`'s branch ended with `text`; returns the branches to start now."""
        self._end(point_id)
        self.texts[point_id] = text
        return self.admit()

    def fail(self, point_id: int, reason: str) -> list[Launch]:
        """The branch failed: its dependents still start, without its text; the merge shows the title."""
        self._end(point_id)
        self.failures[point_id] = reason
        return self.admit()

    def _end(self, point_id: int) -> None:
        if point_id not in self.running:
            raise ValueError(f"point {point_id} is not running")
        self.running.remove(point_id)
