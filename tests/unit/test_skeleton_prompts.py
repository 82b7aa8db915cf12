"""SoT prompts: chat messages, the branch prompt's shared prefix with the skeleton session, the
<Search> tool (BM25 passages; without documents like <None>), and the SoT-or-plain router."""

from __future__ import annotations

import pytest

from specmesh.models.chat import chat_messages_ids
from specmesh.skeleton.automaton import SkeletonFormat
from specmesh.skeleton.parse import parse_skeleton
from specmesh.skeleton.prompts import common_prefix_length, point_messages, point_request, skeleton_messages
from specmesh.skeleton.router import Mode, route
from specmesh.skeleton.tools import PassageIndex, passages_for, split_passages
from specmesh.skeleton.types import Point, Skeleton, Tool

QUESTION = "What are some tips for better sleep?"
SKELETON_TEXT = "[PLAN]\n1.<40><None>[-]Keep a schedule\n2.<60><Search>[1]Mind the light\n[END]"


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir("llama"))


def test_skeleton_messages_hold_the_question_and_the_format():
    messages = skeleton_messages(QUESTION, SkeletonFormat(max_points=5))
    assert [m["role"] for m in messages] == ["user"]
    content = messages[0]["content"]
    assert content.startswith(QUESTION) and "[PLAN]" in content and "[DIRECT]" in content and "at most 5 points" in content
    assert "1.<est_tokens><tool>[deps]Title" in content
    example = content[content.index("Example:\n") + len("Example:\n"):]
    assert isinstance(parse_skeleton(example), Skeleton)  # the prompt's own example follows the grammar


def test_point_messages_extend_the_skeleton_conversation():
    skeleton = parse_skeleton(SKELETON_TEXT)
    assert isinstance(skeleton, Skeleton)
    first, second = skeleton.points
    messages = point_messages(QUESTION, SKELETON_TEXT, second, [(first, "Go to bed at ten.")], ["Blue light delays sleep."])
    assert messages[:1] == skeleton_messages(QUESTION)
    assert messages[1] == {"role": "assistant", "content": SKELETON_TEXT}
    request = messages[2]["content"]
    assert messages[2]["role"] == "user"
    assert request.endswith('Point 2: "Mind the light", about 60 tokens (roughly 45 words).')
    assert "1. Keep a schedule\nGo to bed at ten." in request and "[1] Blue light delays sleep." in request


def test_independent_points_share_their_prompts_up_to_the_point_line():
    """The instruction comes before the point's own words, so sibling branches' prompts share a long
    head (the Verify service prefills it once for all of them)."""
    skeleton = parse_skeleton(SKELETON_TEXT)
    assert isinstance(skeleton, Skeleton)
    first, second = (point_request(p) for p in skeleton.points)
    shared = common_prefix_length(first, second)
    assert first[:shared].endswith("plan markers.\nPoint ") and shared > 100


def test_search_without_passages_is_the_none_prompt():
    search = Point(2, 60, Tool.SEARCH, (1,), "Mind the light")
    none = Point(2, 60, Tool.NONE, (1,), "Mind the light")
    assert point_request(search) == point_request(none)
    assert passages_for(search, QUESTION, None) == []


def test_branch_prompt_forks_from_the_skeleton_session(tiny_tokenizer):
    """The branch's prompt starts with every token of the skeleton session (prompt + generated skeleton +
    EOS), so the branch forks there and prefills only its own request."""
    session = chat_messages_ids(tiny_tokenizer, skeleton_messages(QUESTION))
    session += tiny_tokenizer.encode(SKELETON_TEXT, add_special_tokens=False) + [tiny_tokenizer.eos_token_id]
    skeleton = parse_skeleton(SKELETON_TEXT)
    assert isinstance(skeleton, Skeleton)
    branches = [chat_messages_ids(tiny_tokenizer, point_messages(QUESTION, SKELETON_TEXT, p)) for p in skeleton.points]
    for branch in branches:
        assert common_prefix_length(session, branch) == len(session)
    assert common_prefix_length(*branches) > len(session)  # ... and the "<|im_start|>user\n" after it


def test_common_prefix_length():
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix_length([1, 2, 3], [1, 2]) == 2
    assert common_prefix_length([4], [1]) == 0


# --- the <Search> tool ------------------------------------------------------------------------------

DOCUMENTS = [
    "Morning sunlight sets the body clock.\n\nScreens emit blue light, which delays melatonin and sleep.",
    "Caffeine stays in the blood for hours; avoid coffee after noon.",
    "The history of the bicycle starts in 1817.",
]


def test_bm25_finds_the_relevant_passages():
    index = PassageIndex(DOCUMENTS)
    assert len(index.passages) == 4  # paragraphs
    found = index.search("blue light from screens", top_k=2)
    assert found[0].text.startswith("Screens emit blue light") and found[0].document_index == 0
    assert all(p.score > 0 for p in found) and [p.score for p in found] == sorted((p.score for p in found), reverse=True)
    assert index.search("coffee")[0].document_index == 1
    assert index.search("quantum chromodynamics") == []  # no shared term: nothing, not filler
    assert index.search("the of and") == []  # stop words only


def test_passages_for_a_point():
    index = PassageIndex(DOCUMENTS)
    search = Point(2, 60, Tool.SEARCH, (), "Avoid caffeine late")
    assert passages_for(search, QUESTION, index, top_k=1)[0].text.startswith("Caffeine")
    assert passages_for(Point(2, 60, Tool.NONE, (), "Avoid caffeine late"), QUESTION, index) == []
    assert PassageIndex([]).search("caffeine") == [] and PassageIndex(["the a of"]).search("caffeine") == []


def test_split_passages_windows_long_paragraphs():
    text = " ".join(f"w{i}" for i in range(250)) + "\n \nshort"
    passages = split_passages(text, max_passage_words=100)
    assert [len(p.split()) for p in passages] == [100, 100, 50, 1]


# --- the router -------------------------------------------------------------------------------------


@pytest.mark.parametrize("question, mode, rule", [
    ("What are some tips for improving sleep quality?", Mode.SKELETON, "list of points"),
    ("What are the pros and cons of Python versus Java?", Mode.SKELETON, "list of points"),
    ("List the main causes of the French Revolution.", Mode.SKELETON, "list of points"),
    ("Give me 5 ways to save money.", Mode.SKELETON, "list of points"),
    ("What are the differences between TCP and UDP?", Mode.SKELETON, "list of points"),
    ("Explain the impact of social media on teenagers.", Mode.SKELETON, "open explanation"),
    ("How can I improve my time management skills at work?", Mode.SKELETON, "open explanation"),
    ("Solve 3x + 5 = 20 for x.", Mode.PLAIN, "math"),
    ("What is 17 * 23?", Mode.PLAIN, "math"),
    ("What is 15% of 80?", Mode.PLAIN, "math"),
    ("What is the derivative of x^2?", Mode.PLAIN, "math"),
    ("Write a Python function that reverses a linked list.", Mode.PLAIN, "code"),
    ("Implement quicksort in C++.", Mode.PLAIN, "code"),
    ("How do I fix this bug in my JavaScript code?", Mode.PLAIN, "code"),
    ("def foo(): return 1 -- what does this do?", Mode.PLAIN, "code"),
    ("Write a poem about the sea.", Mode.PLAIN, "creative writing"),
    ("Tell me a story about a dragon.", Mode.PLAIN, "creative writing"),
    ("What is the capital of France?", Mode.PLAIN, "no rule"),
    ("Who wrote Hamlet?", Mode.PLAIN, "no rule"),
    ("Why is the sky blue?", Mode.PLAIN, "no rule"),
    ("How many legs does a spider have?", Mode.PLAIN, "no rule"),
])
def test_router_examples(question, mode, rule):
    decision = route(question)
    assert decision.mode is mode and decision.reason.startswith(rule), decision


def test_router_override():
    assert route("Solve 2 + 2.", override="skeleton").mode is Mode.SKELETON
    assert route("List three fruits.", override=Mode.PLAIN).reason == "requested"
    with pytest.raises(ValueError):
        route("List three fruits.", override="fast")
