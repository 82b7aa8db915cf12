"""A parsed skeleton: the plan's points, or the decision to answer directly.

Plan line format (see `automaton.py` for the grammar): `<id>.<<est_tokens>><<tool>>[<deps>]<title>`,
e.g. `2.<60><Search>[1]How to sleep better` is point 2, about 60 tokens long, answered with the
search tool, written after point 1.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

DIRECT_BY_MODEL = "the model chose to answer directly"


class Tool(enum.Enum):
    NONE = "None"  # the point is written from the model's knowledge
    SEARCH = "Search"  # the point's prompt gets passages retrieved from the request's documents


@dataclass(frozen=True)
class Point:
    id: int  # 1-based, in plan order
    est_tokens: int  # the model's estimate of the point's length, in tokens
    tool: Tool
    deps: tuple[int, ...]  # ids of the points this one needs written first; () = independent
    title: str

    def render(self) -> str:
        """The plan line, without its newline.

        >>> Point(2, 60, Tool.SEARCH, (1,), "How to sleep better").render()
        '2.<60><Search>[1]How to sleep better'
        """
        deps = ",".join(str(d) for d in self.deps) if self.deps else "-"
        return f"{self.id}.<{self.est_tokens}><{self.tool.value}>[{deps}]{self.title}"


@dataclass(frozen=True)
class Skeleton:
    points: tuple[Point, ...]  # in plan order; ids are 1..len(points)

    def point(self, point_id: int) -> Point:
        return self.points[point_id - 1]

    def render(self) -> str:
        """The canonical text, as the grammar spells it; `parse_skeleton(s.render()) == s`."""
        return "[PLAN]\n" + "".join(p.render() + "\n" for p in self.points) + "[END]"


@dataclass(frozen=True)
class Direct:
    """No plan: answer with plain decoding. `text` is what the model wrote inside [DIRECT]...[END]
    (or the whole malformed text); `reason` says why there is no plan."""

    text: str
    reason: str

    @property
    def by_model(self) -> bool:
        """True when the model asked for a direct answer, False when its plan was unusable."""
        return self.reason == DIRECT_BY_MODEL
