"""The final answer from the branches: plan order, each point as its numbered title and its text.

Branch text is cleaned of skeleton markers a model may echo ([PLAN], [END], <None>, a whole plan
line prefix such as `3.<40><None>[1]`) and of surrounding blank lines.

>>> from specmesh.skeleton.types import Point, Skeleton, Tool
>>> skeleton = Skeleton((Point(1, 40, Tool.NONE, (), "Sleep"), Point(2, 60, Tool.SEARCH, (1,), "Exercise")))
>>> print(merge(skeleton, {2: "Walk daily. [END]", 1: "\\n2.<60><Search>[1]Seven hours a night.\\n"}))
1. Sleep
Seven hours a night.
<BLANKLINE>
2. Exercise
Walk daily.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from specmesh.skeleton.types import Point, Skeleton

_MARKERS = re.compile(
    r"\d+\s*\.\s*<\s*\d+\s*>\s*<\s*(?:None|Search)\s*>\s*\[[-\d,\s]*\]"  # a plan line's prefix
    r"|\[(?:PLAN|DIRECT|END)\]"
    r"|<(?:None|Search)>",
    re.IGNORECASE,
)


def strip_markers(text: str) -> str:
    """Branch text without skeleton markers and without blank lines around it."""
    return re.sub(r"\n{3,}", "\n\n", _MARKERS.sub("", text)).strip()


def section_header(point: Point) -> str:
    """The first line of a point's section (a stream can send it when the branch starts)."""
    return f"{point.id}. {point.title}"


def format_section(point: Point, text: str) -> str:
    body = strip_markers(text)
    return section_header(point) + ("\n" + body if body else "")


def merge(skeleton: Skeleton, texts: Mapping[int, str]) -> str:
    """All sections in plan order, separated by a blank line; a point without text (its branch
    failed) keeps its title."""
    return "\n\n".join(format_section(p, texts.get(p.id, "")) for p in skeleton.points)
