"""Plans that would lose to a plain answer are refused (specmesh/skeleton/quality.py)."""

from __future__ import annotations

import pytest

from specmesh.skeleton.parse import parse_skeleton
from specmesh.skeleton.prompts import PLAN_INSTRUCTIONS
from specmesh.skeleton.quality import EXAMPLE_TITLES, chain_length, plan_problem


def plan(*lines: str):
    return parse_skeleton("[PLAN]\n" + "\n".join(lines) + "\n[END]")


def test_the_example_titles_are_the_instructions_example():
    example = PLAN_INSTRUCTIONS.split("Example:", 1)[1]
    assert tuple(line.split("]", 1)[1] for line in example.strip().splitlines()[1:-1]) == EXAMPLE_TITLES


def test_what_the_embedded_model_wrote_for_sleep_tips_is_refused():
    # the plan of issue 27: the example's last point six times, each depending on the one before
    lines = ["1.<40><None>[-]Putting both into a routine"] + [f"{i}.<40><None>[{i - 1}]Putting both into a routine"
                                                            for i in range(2, 7)]
    assert plan_problem(plan(*lines), "What are some tips for better sleep?").startswith("repeated points: 1 and 2")


@pytest.mark.parametrize("lines, question, reason", [
    (["1.<40><None>[-]Regular exercise", "2.<40><None>[-]Light"], "Tips for sleep?", "copies the instruction's example"),
    (["1.<40><None>[-]A", "2.<40><None>[1]B", "3.<40><None>[2]C", "4.<40><None>[-]D"], "Explain X.", "serialised: a chain of 3"),
    (["1.<40><None>[2]A", "2.<40><None>[-]B"], "Explain X.", "serialised: a chain of 2"),
])
def test_flawed_plans_are_named(lines, question, reason):
    assert reason in plan_problem(plan(*lines), question)


def test_good_plans_pass():
    assert plan_problem(plan("1.<60><None>[-]Regular exercise", "2.<50><None>[-]A balanced diet",
                             "3.<40><None>[1,2]Putting both into a routine"),
                        "How do regular exercise and a balanced diet help? Putting both into a routine?") is None
    three = plan("1.<40><None>[-]A", "2.<40><None>[-]B", "3.<40><None>[1,2]C")
    assert chain_length(three) == 2 and plan_problem(three, "Explain X.") is None  # 1.5 points per step
