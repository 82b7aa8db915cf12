"""gateway.plan: what a completion asks the Coordinator for, beyond its OpenAI fields."""

from __future__ import annotations

from gateway.plan import completion_plan
from gateway.schema import CompletionRequest


class Words:
    """A stand-in tokenizer: a token per word."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(range(len(text.split())))


def test_a_completion_answered_whole_asks_for_no_messages_between():
    """Not streamed and without stop strings: the largest stream interval (the first tokens and the last,
    nothing between); streamed, or with a stop string the Verify service does not know: the Coordinator's."""
    def interval(**fields):
        request = completion_plan(CompletionRequest(model="m", prompt="one two three", **fields), Words(), "cmpl-1").requests[0]
        return request.stream_interval_ms if request.HasField("stream_interval_ms") else None

    assert interval() == 10_000
    assert interval(stream=True) is None
    assert interval(stop=["\n"]) is None
