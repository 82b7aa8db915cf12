"""Skeleton-of-Thought or plain decoding, per question: a transparent rule table with reasons.

SoT helps answers made of independent parts (lists of tips, reasons, factors, comparisons) and
hurts answers whose every step needs the previous one (the SoT paper: math, code, Fermi problems,
writing). The rules, first match wins:

  1. a mode requested with the request (the override) wins;
  2. code (code blocks, "write/implement/debug ... function/script/...", code syntax) -> plain;
  3. math (arithmetic expressions, equations, "solve", "calculate", "prove", ...) -> plain;
  4. creative writing ("write a poem/story/song/...") -> plain;
  5. a list of points ("list", "tips", "ways to", "pros and cons", "compare", "steps", ...) -> SoT;
  6. an open explanation of some length ("explain", "describe", "why", "how does") -> SoT;
  7. anything else (short factual questions included) -> plain.

>>> route("Give me tips for improving sleep quality.")
RouteDecision(mode=<Mode.SKELETON: 'skeleton'>, reason='list of points: matched "tips"')
>>> route("What is 17 * 23?").reason
'math: matched "17 * 23"'
>>> route("What is the capital of France?")
RouteDecision(mode=<Mode.PLAIN: 'plain'>, reason='no rule for SoT matched (short factual question or other)')
>>> route("What is the capital of France?", override="skeleton").mode
<Mode.SKELETON: 'skeleton'>
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class Mode(enum.Enum):
    PLAIN = "plain"
    SKELETON = "skeleton"


@dataclass(frozen=True)
class RouteDecision:
    mode: Mode
    reason: str


@dataclass(frozen=True)
class Rule:
    name: str
    mode: Mode
    pattern: re.Pattern[str]


def _words(*alternatives: str) -> str:
    """A regex of whole words or phrases (no letter or digit right before or after)."""
    return r"(?<!\w)(?:" + "|".join(alternatives) + r")(?!\w)"


_CODE_NOUNS = _words("code", "function", "functions", "program", "script", "class", "method", "regex", "regular expression",
                     "sql", "query", "algorithm", "api", "bug", "unit tests?", "snippet")
_LANGUAGES = _words("python", "javascript", "typescript", "java", "c\\+\\+", "c#", "rust", "golang", "bash", "html", "css")

RULES: tuple[Rule, ...] = (
    Rule("code", Mode.PLAIN, re.compile(
        r"```|\bdef \w+\(|#include|\w+\(\)\s*[;{]|=>|"
        + _words("write", "implement", "debug", "fix", "refactor", "optimi[sz]e", "code") + r"\W+(?:\w+\W+){0,4}?"
        + "(?:" + _CODE_NOUNS + "|" + _LANGUAGES + ")"
        + r"|" + _words("in", "using") + r"\s+" + _LANGUAGES + r"\s*[?.]?$", re.IGNORECASE)),
    Rule("math", Mode.PLAIN, re.compile(
        r"\d[\w.]*\s*[-+*/^×÷=]\s*\(?\s*[\w.]*\d[\w.]*|\d+\s*%\s*of\b|"
        + _words("solve", "calculate", "compute", "evaluate", "simplify", "integral", "derivative", "differentiate",
                 "integrate", "prove", "equation", "factori[sz]e", "square root", "probability that", "how many .* if"),
        re.IGNORECASE)),
    Rule("creative writing", Mode.PLAIN, re.compile(
        _words("write", "compose", "create", "tell") + r"\W+(?:\w+\W+){0,3}?"
        + _words("poem", "poems", "story", "stories", "song", "lyrics", "haiku", "limerick", "sonnet", "joke", "tale",
                 "novel", "screenplay", "rap")
        + r"|" + _words("poem", "haiku", "limerick", "sonnet"), re.IGNORECASE)),
    Rule("list of points", Mode.SKELETON, re.compile(
        _words("list", "tips", "ways to", "ways of", "steps", "reasons", "advantages", "disadvantages", "benefits",
               "pros and cons", "compare", "comparison", "differences", "factors", "strategies", "ideas",
               "examples of", "types of", "kinds of", "what are some", "suggestions", "recommendations", "best practices",
               "key points", "main points", "aspects", "\\d+ (?:things|ways|tips|reasons|ideas|steps)"),
        re.IGNORECASE)),
)
OPEN_EXPLANATION = re.compile(_words("explain", "describe", "discuss", "why", "how does", "how do", "how can", "overview",
                                     "what makes", "impact of", "effects of", "role of"), re.IGNORECASE)
MIN_OPEN_EXPLANATION_WORDS = 6  # "Why is the sky blue?" (5 words) is a short factual question


def route(question: str, override: Mode | str | None = None) -> RouteDecision:
    """SoT or plain for `question`; `override` ("plain" / "skeleton" or a Mode) wins with reason "requested"."""
    if override is not None:
        return RouteDecision(Mode(override), "requested")
    for rule in RULES:
        match = rule.pattern.search(question)
        if match:
            return RouteDecision(rule.mode, f'{rule.name}: matched "{match.group(0).strip()}"')
    match = OPEN_EXPLANATION.search(question)
    if match and len(question.split()) >= MIN_OPEN_EXPLANATION_WORDS:
        return RouteDecision(Mode.SKELETON, f'open explanation: matched "{match.group(0)}"')
    return RouteDecision(Mode.PLAIN, "no rule for SoT matched (short factual question or other)")
