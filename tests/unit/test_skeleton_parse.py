"""parse_skeleton: worked examples, malformed input -> Direct with a reason, cycles, round trips."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specmesh.skeleton.parse import parse_skeleton
from specmesh.skeleton.types import DIRECT_BY_MODEL, Direct, Point, Skeleton, Tool


def test_worked_example():
    text = ("[PLAN]\n"
            "1.<40><None>[-]Why sleep matters\n"
            "2.<120><Search>[1]What the studies say\n"
            "3.<30><None>[1,2]A bedtime routine\n"
            "[END]")
    assert parse_skeleton(text) == Skeleton((
        Point(1, 40, Tool.NONE, (), "Why sleep matters"),
        Point(2, 120, Tool.SEARCH, (1,), "What the studies say"),
        Point(3, 30, Tool.NONE, (1, 2), "A bedtime routine"),
    ))


def test_lenient_where_the_meaning_is_clear():
    text = "  [PLAN]\n\n 1. < 40 > <none> [ - ]  Why \n2.<5><SEARCH>[1, 1 ]How\n[END]<|im_end|> trailing"
    assert parse_skeleton(text) == Skeleton((Point(1, 40, Tool.NONE, (), "Why"), Point(2, 5, Tool.SEARCH, (1,), "How")))


def test_a_title_may_contain_markers():
    parsed = parse_skeleton("[PLAN]\n1.<4><None>[-]The [END] tag\n[END]")
    assert isinstance(parsed, Skeleton) and parsed.points[0].title == "The [END] tag"


def test_direct():
    assert parse_skeleton("[DIRECT]arithmetic[END]") == Direct("arithmetic", DIRECT_BY_MODEL)
    assert parse_skeleton("[DIRECT][END]").by_model
    assert parse_skeleton("[DIRECT] cut off").text == "cut off"


@pytest.mark.parametrize("text, reason", [
    ("", "the text starts with neither [PLAN] nor [DIRECT]"),
    ("Here is a plan:\n[PLAN]\n1.<4><None>[-]A\n[END]", "the text starts with neither [PLAN] nor [DIRECT]"),
    ("[PLAN]\n1.<4><None>[-]A\n2.<4><None>[-]B", "the plan has no [END] at the start of a line (cut off?)"),
    ("[PLAN]\n1.<4><None>[-]A[END]", "the plan has no [END] at the start of a line (cut off?)"),
    ("[PLAN]\n[END]", "the plan has no points"),
    ("[PLAN]\n1. First point\n[END]", "not a plan line: '1. First point' (expected like '1.<40><None>[-]Title')"),
    ("[PLAN]\n2.<4><None>[-]A\n[END]", "point ids must count up from 1: expected 1, got 2"),
    ("[PLAN]\n1.<4><None>[-]A\n1.<4><None>[-]B\n[END]", "point ids must count up from 1: expected 2, got 1"),
    ("[PLAN]\n1.<0><None>[-]A\n[END]", "point 1: est_tokens must be >= 1, got 0"),
    ("[PLAN]\n1.<4><Web>[-]A\n[END]", "point 1: unknown tool <Web> (expected <None> or <Search>)"),
    ("[PLAN]\n1.<4><None>[-]  \n[END]", "point 1 has no title"),
    ("[PLAN]\n1.<4><None>[a]A\n[END]", "point 1: dependencies must be [-] or ids like [1,2], got [a]"),
    ("[PLAN]\n1.<4><None>[-]A\n2.<4><None>[3]B\n[END]", "point 2 depends on unknown point 3"),
    ("[PLAN]\n1.<4><None>[0]A\n[END]", "point 1 depends on unknown point 0"),
    ("[PLAN]\n1.<4><None>[1]A\n[END]", "dependency cycle: 1 -> 1"),
    ("[PLAN]\n1.<4><None>[3]A\n2.<4><None>[1]B\n3.<4><None>[2]C\n[END]", "dependency cycle: 1 -> 3 -> 2 -> 1"),
    ("[PLAN]\n1.<4><None>[-]A\n2.<4><None>[3]B\n3.<4><None>[1,2]C\n[END]", "dependency cycle: 2 -> 3 -> 2"),
])
def test_malformed_falls_back_to_direct_with_a_reason(text, reason):
    parsed = parse_skeleton(text)
    assert parsed == Direct(text, reason) and not parsed.by_model


def test_max_points():
    text = "[PLAN]\n1.<4><None>[-]A\n2.<4><None>[-]B\n[END]"
    assert isinstance(parse_skeleton(text, max_points=2), Skeleton)
    assert parse_skeleton(text, max_points=1).reason == "the plan has 2 points, more than max_points 1"


def test_forward_dependencies_without_a_cycle_are_kept():
    """Only the grammar insists on earlier points; the parser accepts any DAG (the scheduler copes)."""
    parsed = parse_skeleton("[PLAN]\n1.<4><None>[2]A\n2.<4><None>[-]B\n[END]")
    assert isinstance(parsed, Skeleton) and parsed.points[0].deps == (2,)


titles = st.text(st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=20).map(str.strip).filter(bool)


@st.composite
def skeletons(draw) -> Skeleton:
    num_points = draw(st.integers(1, 8))
    points = []
    for i in range(1, num_points + 1):
        deps = tuple(sorted(draw(st.sets(st.integers(1, i - 1), max_size=3)))) if i > 1 else ()
        points.append(Point(i, draw(st.integers(1, 999)), draw(st.sampled_from(Tool)), deps, draw(titles)))
    return Skeleton(tuple(points))


@given(skeletons())
def test_render_then_parse_round_trips(skeleton):
    assert parse_skeleton(skeleton.render()) == skeleton
