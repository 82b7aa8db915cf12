"""Skeleton text -> `Skeleton` or `Direct`, never an exception.

Text produced under the grammar always parses; the parser also takes unconstrained text (a model
without the grammar, a test) and is lenient where meaning is clear (spaces around fields, blank
lines, the tool's case, text after [END], repeated dependency ids) and strict where it is not. Anything
unusable becomes `Direct` with a reason, so the caller falls back to plain decoding.

>>> parse_skeleton("[PLAN]\\n1.<40><None>[-]Why sleep matters\\n2.<60><Search>[1]How to sleep better\\n[END]")
Skeleton(points=(Point(id=1, est_tokens=40, tool=<Tool.NONE: 'None'>, deps=(), title='Why sleep matters'), \
Point(id=2, est_tokens=60, tool=<Tool.SEARCH: 'Search'>, deps=(1,), title='How to sleep better')))
>>> parse_skeleton("[DIRECT]a calculation[END]")
Direct(text='a calculation', reason='the model chose to answer directly')
>>> parse_skeleton("[PLAN]\\n1.<40><None>[2]A\\n2.<40><None>[1]B\\n[END]").reason
'dependency cycle: 1 -> 2 -> 1'
>>> parse_skeleton("[PLAN]\\n1.<40><None>[-]A\\n2.<40><None>[7]B\\n[END]").reason
'point 2 depends on unknown point 7'
>>> parse_skeleton("Sure! Here is my plan: ...").reason
'the text starts with neither [PLAN] nor [DIRECT]'
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from specmesh.skeleton.types import DIRECT_BY_MODEL, Direct, Point, Skeleton, Tool

PLAN_MARK, DIRECT_MARK, END_MARK = "[PLAN]", "[DIRECT]", "[END]"
_LINE = re.compile(r"(\d+)\s*\.\s*<\s*(\d+)\s*>\s*<\s*(\w+)\s*>\s*\[([^\]]*)\](.*)")
_END_LINE = re.compile(r"^[ \t]*\[END\]", re.MULTILINE)  # a title may contain "[END]"; the plan's end starts a line
_TOOLS = {tool.value.lower(): tool for tool in Tool}


class _Malformed(Exception):
    pass


def parse_skeleton(text: str, max_points: int | None = None) -> Skeleton | Direct:
    """Parse a skeleton; `max_points` (optional) rejects longer plans."""
    body = text.strip()
    if body.startswith(DIRECT_MARK):
        return Direct(body[len(DIRECT_MARK):].split(END_MARK, 1)[0].strip(), DIRECT_BY_MODEL)
    if not body.startswith(PLAN_MARK):
        return Direct(text, "the text starts with neither [PLAN] nor [DIRECT]")
    end = _END_LINE.search(body)
    if end is None:
        return Direct(text, "the plan has no [END] at the start of a line (cut off?)")
    lines = [line.strip() for line in body[len(PLAN_MARK):end.start()].split("\n")]  # not splitlines: U+2028 may be in a title
    points: list[Point] = []
    try:
        for line in lines:
            if line:
                points.append(_parse_line(line, len(points) + 1))
    except _Malformed as error:
        return Direct(text, str(error))
    if not points:
        return Direct(text, "the plan has no points")
    if max_points is not None and len(points) > max_points:
        return Direct(text, f"the plan has {len(points)} points, more than max_points {max_points}")
    problem = dependency_problem(points)
    return Direct(text, problem) if problem else Skeleton(tuple(points))


def _parse_line(line: str, expected_id: int) -> Point:
    match = _LINE.fullmatch(line)
    if match is None:
        raise _Malformed(f"not a plan line: {line!r} (expected like '1.<40><None>[-]Title')")
    point_id, est_tokens, tool, deps, title = match.groups()
    if int(point_id) != expected_id:
        raise _Malformed(f"point ids must count up from 1: expected {expected_id}, got {point_id}")
    if int(est_tokens) < 1:
        raise _Malformed(f"point {point_id}: est_tokens must be >= 1, got {est_tokens}")
    if tool.lower() not in _TOOLS:
        raise _Malformed(f"point {point_id}: unknown tool <{tool}> (expected <None> or <Search>)")
    if not title.strip():
        raise _Malformed(f"point {point_id} has no title")
    return Point(expected_id, int(est_tokens), _TOOLS[tool.lower()], _parse_deps(deps, expected_id), title.strip())


def _parse_deps(deps: str, point_id: int) -> tuple[int, ...]:
    deps = deps.strip()
    if deps in ("-", ""):
        return ()
    parts = [part.strip() for part in deps.split(",")]
    if not all(part.isdigit() for part in parts):
        raise _Malformed(f"point {point_id}: dependencies must be [-] or ids like [1,2], got [{deps}]")
    return tuple(sorted({int(part) for part in parts}))


def dependency_problem(points: Sequence[Point]) -> str | None:
    """The first unknown id or cycle (depth-first, in plan order), as a reason; None if it is a DAG."""
    ids = {p.id for p in points}
    for point in points:
        for dep in point.deps:
            if dep not in ids:
                return f"point {point.id} depends on unknown point {dep}"
    deps = {p.id: p.deps for p in points}
    finished: set[int] = set()
    for root in deps:
        path: list[int] = []
        stack: list[tuple[int, int]] = [(root, 0)]  # (point, index of the next dependency to visit)
        while stack:
            node, index = stack.pop()
            if index == 0:
                if node in path:
                    cycle = path[path.index(node):] + [node]
                    return "dependency cycle: " + " -> ".join(str(n) for n in cycle)
                if node in finished:
                    continue
                path.append(node)
            if index < len(deps[node]):
                stack.append((node, index + 1))
                stack.append((deps[node][index], 0))
            else:
                finished.add(path.pop())
    return None
