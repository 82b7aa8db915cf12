"""Prompts of Skeleton-of-Thought as chat messages (role / content dicts, for the chat template).

Two steps (Ning et al. 2024, "Skeleton-of-Thought: Prompting LLMs for Efficient Parallel Generation"):
1. `skeleton_messages(question)`: one user turn, the question then the plan instructions; the
   assistant answers with a skeleton in the grammar's format (see `automaton.py`).
2. `point_messages(question, skeleton_text, point, ...)`: the same user turn, the skeleton as the
   assistant's turn, then a user turn asking for that one point only, about est_tokens long, with
   the texts of the points it depends on and, for a <Search> point, retrieved passages.

Every branch's conversation starts with the skeleton conversation, so a branch can be forked from
the skeleton's session: the tokens its prompt shares with the skeleton session's tokens are already
in the KV cache. `common_prefix_length(session_ids, branch_ids)` says how many (compare token ids,
never texts: the chat template may tokenize the skeleton differently from how it was generated);
fork at that length and prefill the rest. Pass the skeleton text exactly as generated.

A <Search> point without passages gets exactly the prompt of a <None> point.
"""

from __future__ import annotations

from collections.abc import Sequence

from specmesh.skeleton.automaton import DEFAULT_FORMAT, SkeletonFormat
from specmesh.skeleton.types import Point

Message = dict[str, str]

PLAN_INSTRUCTIONS = """\
Do not answer yet. First write a short plan of the answer, in exactly this format:
[PLAN]
1.<est_tokens><tool>[deps]Title
2.<est_tokens><tool>[deps]Title
[END]
- est_tokens: about how many tokens the point will need, digits only (for example 60).
- tool: <Search> if the point needs facts from the provided documents, otherwise <None>.
- deps: [-] if the point can be written on its own, or the numbers of earlier points it builds on, like [1,2].
- Title: a few words naming the point.
Use at most {max_points} points, each one a separate part of the answer. If the question needs no plan \
(a calculation, code, a story or poem, a one-line fact), write only [DIRECT], a few words of reason, and [END].
Example:
[PLAN]
1.<60><None>[-]Regular exercise
2.<50><None>[-]A balanced diet
3.<40><None>[1,2]Putting both into a routine
[END]"""

# The instruction every point shares comes first and the point's own words last, so sibling branches'
# prompts share every token up to "Point": the Verify service prefills that part once for all of them
# (TargetVerifier.fork: a common head of the children's appends goes through one trunk forward).
POINT_INSTRUCTIONS = """\
Write one point of the plan only, in plain text. Do not repeat the title, do not write the other points, \
and do not write plan markers.
Point {id}: "{title}", about {est_tokens} tokens (roughly {num_words} words)."""


def skeleton_messages(question: str, fmt: SkeletonFormat = DEFAULT_FORMAT) -> list[Message]:
    """The conversation whose answer is the skeleton."""
    return [{"role": "user", "content": question.strip() + "\n\n" + PLAN_INSTRUCTIONS.format(max_points=fmt.max_points)}]


def point_messages(question: str, skeleton_text: str, point: Point,
                   dependencies: Sequence[tuple[Point, str]] = (), passages: Sequence[str] = (),
                   fmt: SkeletonFormat = DEFAULT_FORMAT) -> list[Message]:
    """The conversation whose answer is point `point`'s text. `dependencies`: (point, text) for the
    finished points it depends on (`Launch.dependencies`); `passages`: retrieved for a <Search> point."""
    return skeleton_messages(question, fmt) + [
        {"role": "assistant", "content": skeleton_text},
        {"role": "user", "content": point_request(point, dependencies, passages)},
    ]


def point_request(point: Point, dependencies: Sequence[tuple[Point, str]] = (), passages: Sequence[str] = ()) -> str:
    """The last user turn of a branch: context first, then the instruction.

    >>> from specmesh.skeleton.types import Tool
    >>> print(point_request(Point(2, 40, Tool.SEARCH, (1,), "Costs"), [(Point(1, 30, Tool.NONE, (), "Uses"), "Many.")], ["Price: 3 EUR."]))
    Points it builds on, already written:
    1. Uses
    Many.
    <BLANKLINE>
    Passages from the provided documents:
    [1] Price: 3 EUR.
    <BLANKLINE>
    Write one point of the plan only, in plain text. Do not repeat the title, do not write the other points, \
and do not write plan markers.
    Point 2: "Costs", about 40 tokens (roughly 30 words).
    """
    parts = []
    if dependencies:
        parts.append("Points it builds on, already written:\n"
                     + "\n".join(f"{dep.id}. {dep.title}\n{text.strip()}" for dep, text in dependencies))
    if passages:
        parts.append("Passages from the provided documents:\n"
                     + "\n".join(f"[{n}] {passage.strip()}" for n, passage in enumerate(passages, 1)))
    num_words = max(1, round(point.est_tokens * 0.75))
    parts.append(POINT_INSTRUCTIONS.format(id=point.id, title=point.title, est_tokens=point.est_tokens, num_words=num_words))
    return "\n\n".join(parts)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading token ids `a` and `b` share.

    >>> common_prefix_length([5, 6, 7, 8], [5, 6, 9])
    2
    """
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length
