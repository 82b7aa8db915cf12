"""Is a parsed plan worth fanning out? A plan that cannot win is answered plainly instead.

Skeleton-of-Thought pays only when its points are distinct parts of the answer that can be written
at the same time. A small model often writes plans that lose: the same point again and again, the
instruction's own example copied instead of a plan for the question, or dependencies that chain the
points so they run one after another. `plan_problem` names the first such flaw (None: fan out):

  1. repeated points: two titles equal once case, punctuation and spacing are dropped;
  2. the instruction's example copied: a title equal to one of `EXAMPLE_TITLES` whose words the
     question does not contain;
  3. serialised: the longest dependency chain is so long that fewer than `MIN_PARALLELISM` points
     per step run side by side (points / chain length), e.g. 2 points where the 2nd needs the 1st.

A branch is cut at `branch_token_budget` tokens: twice its point's estimate (at least 32, at most the
request's max_new_tokens), so a branch that repeats itself stops instead of running to the request's
limit while its siblings wait for the merge.

>>> from specmesh.skeleton.parse import parse_skeleton
>>> plan = lambda *lines: parse_skeleton("[PLAN]\\n" + "\\n".join(lines) + "\\n[END]")
>>> plan_problem(plan("1.<40><None>[-]Why sleep matters", "2.<40><None>[-]How to sleep better"), "Tips for sleep?")
>>> plan_problem(plan("1.<40><None>[-]Dark room", "2.<40><None>[-]dark room."), "Tips for sleep?")
'repeated points: 1 and 2 ("dark room")'
>>> plan_problem(plan("1.<40><None>[-]Dark room", "2.<40><None>[-]Putting both into a routine"), "Tips for sleep?")
'point 2 copies the instruction\\'s example ("Putting both into a routine")'
>>> plan_problem(plan("1.<40><None>[-]Causes", "2.<40><None>[1]Effects"), "Why do we dream?")
'serialised: a chain of 2 dependent points among 2 (1.0 per step, below 1.5)'
"""

from __future__ import annotations

import re

from specmesh.skeleton.types import Point, Skeleton

BRANCH_TOKENS_PER_ESTIMATE = 2  # a branch may write twice its point's estimate, then it is cut
MIN_BRANCH_TOKENS = 32
# the titles of PLAN_INSTRUCTIONS' example plan (specmesh/skeleton/prompts.py); a test keeps them in step
EXAMPLE_TITLES = ("Regular exercise", "A balanced diet", "Putting both into a routine")
MIN_PARALLELISM = 1.5  # points per step of the longest dependency chain, at least


def _normal(title: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", title.lower()).split())


def chain_length(plan: Skeleton) -> int:
    """Points in the longest dependency chain (1 when no point depends on another)."""
    depth: dict[int, int] = {}

    def of(point_id: int) -> int:  # the parser refuses cycles, so this ends
        if point_id not in depth:
            depth[point_id] = 1 + max((of(dep) for dep in plan.point(point_id).deps), default=0)
        return depth[point_id]

    return max((of(point.id) for point in plan.points), default=0)


def plan_problem(plan: Skeleton, question: str) -> str | None:
    """Why this plan would lose to answering plainly (module docstring), or None."""
    seen: dict[str, int] = {}
    for point in plan.points:
        key = _normal(point.title)
        if key in seen:
            return f'repeated points: {seen[key]} and {point.id} ("{key}")'
        seen[key] = point.id
    asked = set(_normal(question).split())
    examples = {_normal(title): title for title in EXAMPLE_TITLES}
    for point in plan.points:
        key = _normal(point.title)
        if key in examples and not set(key.split()) <= asked:
            return f"point {point.id} copies the instruction's example (\"{examples[key]}\")"
    chain = chain_length(plan)
    parallelism = len(plan.points) / chain
    if chain > 1 and parallelism < MIN_PARALLELISM:
        return (f"serialised: a chain of {chain} dependent points among {len(plan.points)} "
                f"({parallelism:.1f} per step, below {MIN_PARALLELISM})")
    return None


def branch_token_budget(point: Point, max_new_tokens: int) -> int:
    """Tokens a branch may write (module docstring).

    >>> from specmesh.skeleton.types import Tool
    >>> branch_token_budget(Point(1, 60, Tool.NONE, (), "A"), 256), branch_token_budget(Point(1, 5, Tool.NONE, (), "A"), 256)
    (120, 32)
    >>> branch_token_budget(Point(1, 300, Tool.NONE, (), "A"), 256)
    256
    """
    return min(max_new_tokens, max(MIN_BRANCH_TOKENS, BRANCH_TOKENS_PER_ESTIMATE * point.est_tokens))
