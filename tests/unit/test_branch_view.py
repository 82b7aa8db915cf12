"""client.branch_view: SoT branches as a live terminal view, fed synthetic chunks (no terminal needed)."""

from __future__ import annotations

import asyncio
import doctest
import io
import re

import client.branch_view as branch_view
from client.branch_view import CLEAR_BELOW, CURSOR_SHOW, BranchView, LiveWriter, PlainWriter, allocate, watch, wrap
from client.coordinator_client import Chunk, GenerationStats
from specmesh.proto.v1 import coordinator_pb2 as pb

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
PLAN = "[PLAN]\n1.<40><None>[-]Sleep\n2.<40><None>[-]Food\n[END]"
MERGED = "1. Sleep\nSleep eight hours.\n\n2. Food\nEat well."


def chunk(branch_id: int, text: str = "", tokens: int = 0, finish: str | None = None, error: str = "",
          stats: GenerationStats | None = None) -> Chunk:
    return Chunk(text, list(range(100, 100 + tokens)), finish, stats, error, branch_id)


def sot_stream() -> list[tuple[float, Chunk]]:
    """(arrival s, chunk) of a 2-point SoT answer: plan, two branches interleaved, the merged answer."""
    return [
        (0.1, chunk(0, "[PLAN]\n1.<40><None>[-]Sleep\n", 9)),
        (0.2, chunk(0, "2.<40><None>[-]Food\n[END]", 8, "eos")),
        (0.3, chunk(1, "1. Sleep\n")),
        (0.3, chunk(2, "2. Food\n")),
        (0.5, chunk(1, "Sleep eight", 2)),
        (0.5, chunk(2, "Eat", 1)),
        (0.7, chunk(2, " well.", 2, "eos", stats=GenerationStats(num_generated_tokens=3))),
        (0.9, chunk(1, " hours.", 2, "eos", stats=GenerationStats(num_generated_tokens=4))),
        (1.0, chunk(-1, MERGED, 0, "eos", stats=GenerationStats(num_generated_tokens=24))),
    ]


def fed(stream: list[tuple[float, Chunk]]) -> BranchView:
    view = BranchView(start_s=0.0)
    for now_s, c in stream:
        view.feed(c, now_s)
    return view


async def chunks_of(stream: list[tuple[float, Chunk]], clock: list[float]):
    for now_s, c in stream:
        clock[0] = now_s
        yield c


def run_watch(stream, out, **kwargs) -> BranchView:
    clock = [0.0]
    return asyncio.run(watch(chunks_of(stream, clock), out, clock=lambda: clock[0], **kwargs))


def test_docstring_examples():
    assert doctest.testmod(branch_view).failed == 0


def test_wrap_keeps_lines_within_width_including_wide_characters():
    for line in wrap("日本語のテキスト and some words " * 5, 11):
        assert sum(branch_view.char_width(c) for c in line) <= 11


def test_allocate_never_exceeds_the_total_or_a_need():
    for needs, total in [([5, 0, 3], 4), ([1, 2, 3, 4], 100), ([10] * 9, 5), ([], 3), ([4, 4], 0)]:
        given = allocate(needs, total)
        assert sum(given) == min(total, sum(needs))
        assert all(0 <= g <= n for g, n in zip(given, needs))


def test_the_frame_shows_the_plan_first_then_each_point_growing():
    stream = sot_stream()
    view = fed(stream[:6])
    frame = [ANSI.sub("", line) for line in view.frame(80, 40)]
    assert frame[0].startswith("── plan · 17 tokens · done")
    assert frame[1:5] == ["[PLAN]", "1.<40><None>[-]Sleep", "2.<40><None>[-]Food", "[END]"]
    assert frame[5].startswith("── point 1 · 2 tokens · writing")
    assert frame[6:8] == ["1. Sleep", "Sleep eight"]
    assert frame[8].startswith("── point 2 · 1 tokens · writing")
    assert frame[9:] == ["2. Food", "Eat"]
    view.feed(stream[6][1], 0.7)
    assert any(ANSI.sub("", line).startswith("── point 2 · 3 tokens · done") for line in view.frame(80, 40))


def test_the_frame_fits_a_small_terminal_and_keeps_each_header():
    view = BranchView()
    view.feed(chunk(0, PLAN, 17, "eos"), 0.1)
    for point in (1, 2, 3):
        view.feed(chunk(point, f"{point}. Title {point}\n"), 0.2)
        view.feed(chunk(point, " ".join(f"word{i}" for i in range(60)), 60), 0.3)
    frame = [ANSI.sub("", line) for line in view.frame(30, 16)]
    assert len(frame) <= 15 and all(len(line) <= 29 for line in frame)
    starts = [i for i, line in enumerate(frame) if line.startswith("── ")] + [len(frame)]
    assert len(starts) == 5  # the plan and 3 points
    for point, at, end in zip((1, 2, 3), starts[1:], starts[2:]):  # status line, header, then the latest words
        assert frame[at].startswith(f"── point {point}")
        assert frame[at + 1] == f"{point}. Title {point}"
        assert end - at >= 3 and "word59" in frame[end - 1]


def test_model_text_cannot_send_escape_codes():
    view = BranchView()
    view.feed(chunk(0, "[PLAN]\x1b[2J\x07"), 0.1)
    assert all("\x1b[2J" not in line and "\x07" not in line for line in view.frame(80, 10))


def test_the_live_writer_redraws_in_place_then_leaves_the_answer():
    out = io.StringIO()
    run_watch(sot_stream(), out, live=True, terminal_size=lambda: (80, 24))
    text = out.getvalue()
    assert "\x1b[" in text and "F" in text  # cursor moved up to redraw
    final = text[text.rindex(CLEAR_BELOW) + len(CLEAR_BELOW):]
    assert final == MERGED + CURSOR_SHOW


def test_the_live_writer_moves_up_exactly_the_lines_it_drew():
    out = io.StringIO()
    writer = LiveWriter(out, lambda: (80, 24))
    view = fed(sot_stream()[:4])
    writer.update(view)
    drawn = out.getvalue().count("\n")
    out.truncate(0), out.seek(0)
    writer.update(view)
    assert out.getvalue().startswith(f"\x1b[{drawn}F")


def test_a_piped_sot_answer_is_the_merged_answer_alone():
    out = io.StringIO()
    view = run_watch(sot_stream(), out, live=False)
    assert out.getvalue() == MERGED
    assert view.is_skeleton and view.done


def test_a_plain_stream_prints_as_it_arrives_on_a_terminal_too():
    stream = [(0.1, chunk(-1, "Hello", 1)), (0.2, chunk(-1, " world", 1)),
              (0.3, chunk(-1, "!", 1, "eos", stats=GenerationStats(num_generated_tokens=3)))]
    for live in (True, False):
        out = io.StringIO()
        view = run_watch(stream, out, live=live)
        assert out.getvalue() == "Hello world!"
        assert view.summary_lines() == []
        result = view.generation()
        assert (result.text, len(result.token_ids), result.finish_reason) == ("Hello world!", 3, "eos")
        assert (result.time_to_first_token_s, result.latency_s) == (0.1, 0.3)


def test_the_generation_of_a_sot_answer():
    result = fed(sot_stream()).generation()
    assert result.text == MERGED
    assert len(result.token_ids) == 7  # the points' tokens (the merged message carries none)
    assert result.finish_reason == "eos" and result.stats.num_generated_tokens == 24


def test_the_summary_from_the_client_clock():
    summary = fed(sot_stream()).summary()
    assert summary is not None and summary.source == "client clock"
    assert (summary.plan_s, summary.total_s) == (0.2, 1.0)
    assert [(b.point_id, b.title, b.num_tokens) for b in summary.branches] == [(1, "Sleep", 4), (2, "Food", 3)]
    assert [round(b.wall_s, 6) for b in summary.branches] == [0.6, 0.4]
    assert round(summary.parallel_speedup, 6) == round((0.2 + 0.6 + 0.4) / 1.0, 6)
    lines = fed(sot_stream()).summary_lines()
    assert "plan 0.20 s of 1.00 s" in lines[0] and "parallel speedup 1.20x" in lines[0]
    assert lines[1:] == ["  1. Sleep: 4 tokens in 0.60 s", "  2. Food: 3 tokens in 0.40 s"]


def test_the_summary_prefers_the_coordinators_skeleton_stats():
    stream = sot_stream()
    last = stream[-1][1]
    last.skeleton = pb.SkeletonStats(  # type: ignore[attr-defined]  # as a Chunk carrying SkeletonStats would
        route_reason="requested", skeleton_ms=150, total_ms=950, parallel_speedup_estimate=1.5,
        branches=[pb.BranchStats(point_id=1, title="Sleep", num_tokens=4, wall_ms=600),
                  pb.BranchStats(point_id=2, title="Food", num_tokens=3, wall_ms=400)])
    summary = fed(stream).summary()
    assert summary is not None and summary.source == "coordinator"
    assert (summary.plan_s, summary.total_s, summary.parallel_speedup) == (0.15, 0.95, 1.5)
    assert "SoT because requested" in summary.lines()[0]


def test_a_direct_answer_streams_in_its_own_region_then_alone():
    stream = [(0.1, chunk(0, "[DIRECT] a fact [END]", 6, "eos")), (0.2, chunk(-1, "Paris", 1)),
              (0.3, chunk(-1, ".", 1, "eos"))]
    view = fed(stream[:2])
    assert [r.label for r in view.regions()] == ["plan", "answer"]
    out = io.StringIO()
    view = run_watch(stream, out, live=True, terminal_size=lambda: (80, 24))
    assert out.getvalue().endswith(CLEAR_BELOW + "Paris." + CURSOR_SHOW)
    assert "no branches" in view.summary_lines()[0]


def test_a_failed_branch_is_shown_as_failed():
    view = BranchView()
    view.feed(chunk(0, PLAN, 17, "eos"), 0.1)
    view.feed(chunk(1, "1. Sleep\n"), 0.2)
    view.feed(chunk(1, error="UNAVAILABLE: gone", finish="error"), 0.3)
    assert any("point 1 · 0 tokens · failed: UNAVAILABLE: gone" in line for line in view.frame(80, 20))


def test_an_interrupted_live_view_stays_on_screen():
    async def broken():
        yield chunk(0, "[PLAN]\n", 2)
        raise RuntimeError("connection lost")

    out = io.StringIO()
    try:
        asyncio.run(watch(broken(), out, live=True, terminal_size=lambda: (80, 24)))
    except RuntimeError:
        pass
    text = out.getvalue()
    assert "[PLAN]" in text and text.endswith(CURSOR_SHOW)
    assert text.count(CLEAR_BELOW) == 1  # drawn once, never erased


def test_no_output_when_out_is_none():
    view = run_watch(sot_stream(), None)
    assert view.answer() == MERGED


def test_plain_writer_writes_only_new_answer_text():
    out = io.StringIO()
    writer = PlainWriter(out)
    view = BranchView()
    view.feed(chunk(-1, "a", 1), 0.1)
    writer.update(view)
    writer.update(view)
    view.feed(chunk(-1, "b", 1), 0.2)
    writer.finish(view, True)
    assert out.getvalue() == "ab"
