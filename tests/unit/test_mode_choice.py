"""coordinator.mode_choice: the request's mode, the coordinator's default, or the router's pick (auto)."""

from __future__ import annotations

import doctest

import pytest

import coordinator.mode_choice as mode_choice
from coordinator.mode_choice import AUTO, DEFAULT, PLAIN_MODE, REQUESTED, ModeChoice, choose_mode, request_question
from specmesh.proto.v1 import coordinator_pb2 as pb


def chat(*messages: tuple[str, str], mode: int = pb.GENERATION_MODE_UNSPECIFIED) -> pb.GenerateRequest:
    return pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role=r, content=c) for r, c in messages]),
                              mode=mode)


def ask(question: str, mode: int = pb.GENERATION_MODE_UNSPECIFIED) -> pb.GenerateRequest:
    return chat(("user", question), mode=mode)


def choose(request: pb.GenerateRequest, default_mode: str = AUTO) -> ModeChoice:
    return choose_mode(request, default_mode, request_question(request))


def test_docstring_examples():
    assert doctest.testmod(mode_choice).failed == 0


@pytest.mark.parametrize("question, mode", [
    ("Give me some tips for better sleep.", "skeleton"),
    ("What are the pros and cons of remote work?", "skeleton"),
    ("Explain how vaccines train the immune system to fight disease.", "skeleton"),
    ("What is 17 * 23?", PLAIN_MODE),
    ("Write a Python function that reverses a linked list.", PLAIN_MODE),
    ("Write a poem about the sea.", PLAIN_MODE),
    ("What is the capital of France?", PLAIN_MODE),
])
def test_auto_routes_per_question(question, mode):
    choice = choose(ask(question))
    assert (choice.mode, choice.routed) == (mode, True)
    assert choice.reason and choice.reason not in (REQUESTED, DEFAULT)


def test_a_requested_mode_wins_over_the_router():
    assert choose(ask("What is 2 + 2?", pb.GENERATION_MODE_SKELETON)) == ModeChoice("skeleton", REQUESTED, routed=False)
    assert choose(ask("List tips for sleep.", pb.GENERATION_MODE_AUTOREGRESSIVE)) == \
        ModeChoice("autoregressive", REQUESTED, routed=False)


@pytest.mark.parametrize("default_mode", ["speculative", "fused", "autoregressive"])
def test_without_auto_the_default_runs_and_the_router_stays_out(default_mode):
    assert choose(ask("Give me some tips for better sleep."), default_mode) == ModeChoice(default_mode, DEFAULT, routed=False)


def test_auto_keeps_a_target_without_sot_plain():
    question = "Give me some tips for better sleep."
    assert choose_mode(ask(question), AUTO, question, skeleton_ok=False) == \
        ModeChoice(PLAIN_MODE, mode_choice.NO_SKELETON, routed=True)


def test_auto_keeps_a_raw_prompt_plain():
    choice = choose(pb.GenerateRequest(prompt="List some tips for better sleep."))
    assert (choice.mode, choice.routed) == (PLAIN_MODE, True)
    assert "raw prompt" in choice.reason


def test_auto_keeps_a_conversation_plain():
    request = chat(("system", "Be brief."), ("user", "List some tips for better sleep."))
    choice = choose(request)
    assert (choice.mode, choice.routed) == (PLAIN_MODE, True)
    assert "2 messages" in choice.reason


def test_an_unknown_mode_value_is_a_value_error():
    request = ask("hi")
    request.mode = 99  # an enum value from a newer client
    with pytest.raises(ValueError, match="unknown generation mode 99"):
        choose(request)


def test_pb_mode_round_trips():
    for value in (pb.GENERATION_MODE_SPECULATIVE, pb.GENERATION_MODE_FUSED, pb.GENERATION_MODE_AUTOREGRESSIVE,
                  pb.GENERATION_MODE_SKELETON):
        assert choose(ask("hi", value)).pb_mode == value


@pytest.mark.parametrize("request_, question", [
    (pb.GenerateRequest(prompt="raw text"), "raw text"),
    (chat(("user", "first"), ("assistant", "answer"), ("user", "second")), "second"),
    (chat(("system", "sys"), ("user", "q"), ("assistant", "a")), "q"),
    (chat(("system", "only a system message")), "only a system message"),
    (pb.GenerateRequest(chat=pb.ChatMessages()), ""),
])
def test_request_question(request_, question):
    assert request_question(request_) == question
