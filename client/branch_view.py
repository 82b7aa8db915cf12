"""A Generate stream in a terminal: Skeleton-of-Thought branches filling in live, then the answer.

    view = await watch(client.generate(prompt, mode="skeleton"), sys.stdout)
    result = view.generation()          # the answer as `collect` would give it (stats_line takes it)
    for line in view.summary_lines():   # SoT only: plan time, tokens per branch, parallel speedup
        print(line, file=sys.stderr)

`BranchView` is the pure part: `feed(chunk, now_s)` with each streamed chunk (a `Chunk`: branch_id,
text, token_ids, finish_reason, stats, error_message; and `skeleton`, the `SkeletonStats` of the
last message, when the chunk carries it), `frame(width, height)` the lines of the live area. Two
writers put it on a stream:
- a TTY (`LiveWriter`): one region per branch, redrawn in place with ANSI cursor movement (no
  curses): the plan first, then each point's text growing under its header, each region showing its
  latest lines so the whole area fits the terminal. When the stream ends the area is replaced by
  the answer (points in plan order), which then scrolls like any output. A stream with no branches
  (the plain modes) is printed as it arrives.
- not a TTY (`PlainWriter`: a pipe, CI, a file): only the answer stream (branch -1) is printed, as it
  arrives: a plain answer streams, a SoT answer appears once, merged in plan order, at the end; no
  escape codes, so the output is the answer alone.
Model text is shown with control characters removed (a model cannot move the cursor).

SoT summary: the coordinator's numbers when the last chunk carries `SkeletonStats`, else the client's
clock: plan time = until the plan's last message, a branch's time = its first to its last message,
parallel speedup = (plan time + the branch times summed) / the answer's time, i.e. the gain over
writing the branches one after another if each took as long alone as it did beside its siblings
(an upper bound: alone a branch is no slower; bench/skeleton.py measures the real gain).
"""

from __future__ import annotations

import os
import shutil
import time
import unicodedata
from collections.abc import AsyncIterable, Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from client.coordinator_client import Generation, GenerationStats

MAIN_BRANCH = -1  # the answer: a plain answer, a direct answer, or the merged SoT answer
PLAN_BRANCH = 0  # skeleton mode: the plan; points are 1-based
MIN_REDRAW_S = 0.05  # a live area is redrawn at most this often (and at every branch's end)
CURSOR_HIDE, CURSOR_SHOW, CLEAR_LINE, CLEAR_BELOW = "\x1b[?25l", "\x1b[?25h", "\x1b[K", "\x1b[J"
DIM, RESET = "\x1b[2m", "\x1b[0m"


def cursor_up(num_lines: int) -> str:
    """To column 1, `num_lines` lines up (nothing for 0)."""
    return f"\x1b[{num_lines}F" if num_lines > 0 else "\r"


def printable(text: str) -> str:
    """`text` without control characters (newlines kept, tabs as spaces): model output cannot
    emit escape sequences.

    >>> printable("a\\tb\\x1b[2Jc\\r\\n")
    'a    b[2Jc\\n'
    """
    text = text.replace("\t", "    ")
    return "".join(c for c in text if c == "\n" or unicodedata.category(c)[0] != "C")


def char_width(char: str) -> int:
    """Terminal columns of one character: 2 for wide East Asian ones, 0 for combining marks."""
    if unicodedata.combining(char):
        return 0
    return 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1


def wrap(text: str, width: int) -> list[str]:
    """`text` as terminal lines of at most `width` columns: words kept whole where they fit, longer
    ones cut; every newline starts a line.

    >>> wrap("one two three\\nfour", 8)
    ['one two', 'three', 'four']
    >>> wrap("abcdefghij", 4)
    ['abcd', 'efgh', 'ij']
    >>> wrap("", 4), wrap("a\\n", 4)
    ([''], ['a', ''])
    """
    width = max(1, width)
    lines: list[str] = []
    for paragraph in text.split("\n"):
        line, line_width = "", 0
        for word in paragraph.split(" "):
            word_width = sum(char_width(c) for c in word)
            gap = 1 if line else 0
            if line_width + gap + word_width <= width:
                line, line_width = line + " " * gap + word, line_width + gap + word_width
                continue
            if line:
                lines.append(line)
                line, line_width = "", 0
            for char in word:  # a word longer than the rest of the line: cut it
                w = char_width(char)
                if line_width + w > width:
                    lines.append(line)
                    line, line_width = "", 0
                line, line_width = line + char, line_width + w
        lines.append(line)
    return lines


def allocate(needs: list[int], total: int) -> list[int]:
    """Lines for each region, at most its need, `total` in all when the needs exceed it: each region
    gets an equal share first, what a region does not need goes to the others (plan order first).

    >>> allocate([2, 10, 10], 12)
    [2, 5, 5]
    >>> allocate([1, 1], 12)
    [1, 1]
    >>> allocate([9, 9, 9], 7)
    [3, 2, 2]
    """
    given = [0] * len(needs)
    left = max(0, total)
    while left > 0:
        hungry = [i for i, need in enumerate(needs) if given[i] < need]
        if not hungry:
            break
        share = max(1, left // len(hungry))
        for i in hungry:
            extra = min(share, needs[i] - given[i], left)
            given[i] += extra
            left -= extra
            if left == 0:
                break
    return given


@dataclass
class Branch:
    """What has streamed on one branch."""

    branch_id: int
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    first_s: float = 0.0  # clock of its first and last message
    last_s: float = 0.0
    finish_reason: str | None = None
    error_message: str = ""
    stats: GenerationStats | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def ended(self) -> bool:
        return self.finish_reason is not None or bool(self.error_message)

    @property
    def label(self) -> str:
        if self.branch_id == PLAN_BRANCH:
            return "plan"
        return "answer" if self.branch_id == MAIN_BRANCH else f"point {self.branch_id}"

    def status(self) -> str:
        """e.g. "point 2 · 41 tokens · writing", "plan · 25 tokens · done", "point 3 · failed: ..."."""
        if self.error_message:
            state = f"failed: {printable(self.error_message)}"
        elif self.finish_reason is None:
            state = "writing"
        else:
            state = "done" if self.finish_reason in ("eos", "stop") else f"done ({self.finish_reason})"
        return f"{self.label} · {self.num_tokens} tokens · {state}"


@dataclass
class BranchSummary:
    point_id: int
    title: str
    num_tokens: int
    wall_s: float


@dataclass
class SkeletonSummary:
    """How a SoT answer went (the coordinator's `SkeletonStats`, or the client's clock)."""

    source: str  # "coordinator" or "client clock"
    plan_s: float
    total_s: float
    branches: list[BranchSummary]
    parallel_speedup: float
    route_reason: str = ""
    direct_reason: str = ""  # set when the model planned no points

    def lines(self) -> list[str]:
        head = f"[skeleton: plan {self.plan_s:.2f} s of {self.total_s:.2f} s"
        head += f", SoT because {self.route_reason}" if self.route_reason else ""
        if self.direct_reason or not self.branches:
            return [head + f"; no branches ({self.direct_reason or 'no points'}): answered directly]"]
        tokens = [b.num_tokens for b in self.branches]
        lines = [head + f"; {len(self.branches)} branches, {sum(tokens)} tokens, longest {max(tokens)}; "
                 f"parallel speedup {self.parallel_speedup:.2f}x ({self.source})]"]
        lines += [f"  {b.point_id}. {b.title or '?'}: {b.num_tokens} tokens in {b.wall_s:.2f} s" for b in self.branches]
        return lines


class BranchView:
    """The state of one Generate stream, fed chunk by chunk (module docstring)."""

    def __init__(self, start_s: float = 0.0):
        self.start_s = start_s
        self.branches: dict[int, Branch] = {}
        self.first_token_s: float | None = None
        self.end_s = start_s
        self.final: Any = None  # the answer stream's last chunk

    @property
    def is_skeleton(self) -> bool:
        """A branch other than the answer has streamed (SoT ran, or at least planned)."""
        return any(branch_id != MAIN_BRANCH for branch_id in self.branches)

    @property
    def done(self) -> bool:
        main = self.branches.get(MAIN_BRANCH)
        return main is not None and main.ended

    def feed(self, chunk: Any, now_s: float) -> Branch:
        """Take one streamed chunk, received at `now_s`; returns its branch."""
        branch = self.branches.get(chunk.branch_id)
        if branch is None:
            branch = self.branches[chunk.branch_id] = Branch(chunk.branch_id, first_s=now_s)
        branch.texts.append(chunk.text)  # as the model wrote it (--json, a pipe); a terminal shows printable()
        branch.token_ids += chunk.token_ids
        branch.last_s = self.end_s = now_s
        if chunk.token_ids and self.first_token_s is None:
            self.first_token_s = now_s
        if chunk.finish_reason is not None:
            branch.finish_reason = chunk.finish_reason
        if chunk.error_message:
            branch.error_message = chunk.error_message
        if chunk.stats is not None:
            branch.stats = chunk.stats
        if chunk.branch_id == MAIN_BRANCH and branch.ended:
            self.final = chunk
        return branch

    def regions(self) -> list[Branch]:
        """Branches in display order: the plan, the points by id, then the answer stream (a direct
        answer streams there; the merged answer is shown only at the end)."""
        points = sorted(b for b in self.branches if b > PLAN_BRANCH)
        order = ([PLAN_BRANCH] if PLAN_BRANCH in self.branches else []) + points
        main = self.branches.get(MAIN_BRANCH)
        if main is not None and main.text and not main.ended:
            order.append(MAIN_BRANCH)
        return [self.branches[i] for i in order]

    def frame(self, width: int, height: int) -> list[str]:
        """The live area: per region a status line, then its latest text lines; at most `height` - 1
        lines of at most `width` - 1 columns (a full last column would wrap on some terminals).
        A point's first line (its "i. Title" header) stays while its text scrolls."""
        width = max(2, width) - 1
        regions = self.regions()
        if not regions:
            return []
        bodies = []
        for region in regions:
            text = printable(region.text)
            lines = wrap(text.rstrip("\n"), width) if text.strip() else []
            bodies.append(lines)
        room = max(0, height - 1 - len(regions))
        shown = allocate([len(body) for body in bodies], room)
        frame: list[str] = []
        for region, body, num_lines in zip(regions, bodies, shown):
            frame.append(DIM + _cut(f"── {region.status()} ", width, "─") + RESET)
            if num_lines >= len(body):
                frame += body
            elif region.branch_id > PLAN_BRANCH and num_lines >= 2:
                frame += [body[0], *body[len(body) - num_lines + 1:]]
            elif num_lines > 0:
                frame += body[len(body) - num_lines:]
        return frame[:max(1, height - 1)]

    def answer(self) -> str:
        """The answer's text: the merged SoT answer, a direct answer, or a plain answer."""
        main = self.branches.get(MAIN_BRANCH)
        return main.text if main is not None else ""

    def generation(self) -> Generation:
        """The stream as `CoordinatorClient.collect` returns a plain one: the answer's text; token ids:
        the answer stream's, then (SoT) every point's in plan order; the answer's finish, stats and
        error; client-side times."""
        main = self.branches.get(MAIN_BRANCH) or Branch(MAIN_BRANCH)
        token_ids = [*main.token_ids, *(t for b in sorted(self.branches) if b > PLAN_BRANCH for t in self.branches[b].token_ids)]
        first_token_s = (self.first_token_s - self.start_s) if self.first_token_s is not None else 0.0
        return Generation(self.answer(), token_ids, main.finish_reason, main.stats, main.error_message,
                          time_to_first_token_s=first_token_s, latency_s=self.end_s - self.start_s)

    def summary(self) -> SkeletonSummary | None:
        """How the SoT answer went; None for a stream without branches."""
        if not self.is_skeleton:
            return None
        pb = getattr(self.final, "skeleton", None)
        if pb is not None and (pb.total_ms or pb.skeleton_ms):
            return SkeletonSummary(
                "coordinator", pb.skeleton_ms / 1e3, pb.total_ms / 1e3,
                [BranchSummary(b.point_id, b.title, b.num_tokens, b.wall_ms / 1e3) for b in pb.branches],
                pb.parallel_speedup_estimate, pb.route_reason, pb.direct_reason)
        plan = self.branches.get(PLAN_BRANCH)
        plan_s = (plan.last_s - self.start_s) if plan is not None else 0.0
        total_s = self.end_s - self.start_s
        points = [self.branches[b] for b in sorted(self.branches) if b > PLAN_BRANCH]
        summaries = [BranchSummary(b.branch_id, _title(b), b.stats.num_generated_tokens if b.stats else b.num_tokens,
                                   b.last_s - b.first_s) for b in points]
        speedup = (plan_s + sum(s.wall_s for s in summaries)) / total_s if total_s > 0 else 0.0
        return SkeletonSummary("client clock", plan_s, total_s, summaries, speedup,
                               direct_reason="" if points else "the model planned no points")

    def summary_lines(self) -> list[str]:
        summary = self.summary()
        return summary.lines() if summary is not None else []



class PlainWriter:
    """Not a TTY: the answer stream's text as it arrives, nothing else."""

    def __init__(self, out: TextIO):
        self.out = out
        self.num_written = 0  # pieces of the answer stream written

    @staticmethod
    def shown(text: str) -> str:
        """The text as written out: exactly the model's (a pipe, a file)."""
        return text

    def update(self, view: BranchView) -> None:
        main = view.branches.get(MAIN_BRANCH)
        if main is not None and len(main.texts) > self.num_written:
            self.out.write(self.shown("".join(main.texts[self.num_written:])))
            self.num_written = len(main.texts)
            self.out.flush()

    def finish(self, view: BranchView, completed: bool) -> None:
        self.update(view)


class LiveWriter(PlainWriter):
    """A TTY: the live area redrawn in place once branches stream (module docstring); a stream
    without branches is written as it arrives."""

    @staticmethod
    def shown(text: str) -> str:
        """A terminal: no control characters from the model (it cannot move the cursor or clear the screen)."""
        return printable(text)

    def __init__(self, out: TextIO, terminal_size: Callable[[], tuple[int, int]] | None = None):
        super().__init__(out)
        self.terminal_size = terminal_size or (lambda: tuple(shutil.get_terminal_size()))  # type: ignore[return-value]
        self.num_lines = 0  # lines of the live area now on screen, the cursor just below them

    def update(self, view: BranchView) -> None:
        if not view.is_skeleton:
            super().update(view)
            return
        width, height = self.terminal_size()
        lines = view.frame(width, height)
        hide = CURSOR_HIDE if self.num_lines == 0 else ""
        self.out.write(hide + cursor_up(self.num_lines) + "".join(line + CLEAR_LINE + "\n" for line in lines) + CLEAR_BELOW)
        self.num_lines = len(lines)
        self.out.flush()

    def finish(self, view: BranchView, completed: bool) -> None:
        """Completed: the live area gives way to the answer. Else (an error, ^C) it stays as it was."""
        if not view.is_skeleton:
            super().update(view)
            return
        if completed:
            self.out.write(cursor_up(self.num_lines) + CLEAR_BELOW + view.answer())
            self.num_lines = 0
        self.out.write(CURSOR_SHOW)
        self.out.flush()


def is_terminal(out: TextIO) -> bool:
    return out.isatty() and os.environ.get("TERM", "") != "dumb"


async def watch(chunks: AsyncIterable[Any], out: TextIO | None, *, live: bool | None = None,
                clock: Callable[[], float] = time.perf_counter,
                terminal_size: Callable[[], tuple[int, int]] | None = None) -> BranchView:
    """Consume a Generate stream, showing it on `out` (None: show nothing, e.g. --json); `live`
    defaults to whether `out` is a terminal. Redraws at most every MIN_REDRAW_S, and whenever a
    branch ends. Returns the view (its generation() and summary_lines())."""
    view = BranchView(clock())
    writer: PlainWriter | None = None
    if out is not None:
        writer = LiveWriter(out, terminal_size) if (is_terminal(out) if live is None else live) else PlainWriter(out)
    last_draw_s = float("-inf")
    completed = False
    try:
        async for chunk in chunks:
            now_s = clock()
            branch = view.feed(chunk, now_s)
            if writer is not None and (branch.ended or now_s - last_draw_s >= MIN_REDRAW_S):
                writer.update(view)
                last_draw_s = now_s
        completed = True
    finally:
        if writer is not None:
            writer.finish(view, completed)
    return view


def _cut(text: str, width: int, fill: str = "") -> str:
    """`text` cut (or padded with `fill`) to `width` columns."""
    out, used = "", 0
    for char in text:
        w = char_width(char)
        if used + w > width:
            return out
        out, used = out + char, used + w
    return out + fill * (width - used) if fill else out


def _title(branch: Branch) -> str:
    """A point's title from its header line "i. Title"."""
    header = printable(branch.text.split("\n", 1)[0])
    prefix = f"{branch.branch_id}. "
    return header[len(prefix):].strip() if header.startswith(prefix) else header.strip()
