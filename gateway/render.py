"""Coordinator stream events as OpenAI chunks (server-sent events) and bodies, and `usage`.

One path for both: the stream's events go through a `Tally`; a streamed request sends each
event's chunk as it comes, a non-streamed one sends the body the tally holds at the end.

    tally = Tally(plan)
    opening = renderer.opening(tally)                     # chat: each choice's role; completions: echo
    async for index, response in generation.events():
        chunks = renderer.delta(index, *tally.add(index, response))
    renderer.usage_chunk(tally.usage()); renderer.body(tally)
"""

from __future__ import annotations

from gateway.plan import Plan
from gateway.schema import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionChunk,
    CompletionResponse,
    Delta,
    SpeculationUsage,
    Usage,
)
from specmesh.proto.v1 import common_pb2, coordinator_pb2

FINISH_REASONS = {  # OpenAI's names; the context window running out reads "length", as in vLLM
    common_pb2.FINISH_REASON_EOS: "stop",
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_CONTEXT: "length",
    common_pb2.FINISH_REASON_CANCELLED: "abort",
}
DONE = b"data: [DONE]\n\n"


def sse(model) -> bytes:
    return b"data: " + model.model_dump_json().encode() + b"\n\n"


class Tally:
    """What a request's choices produced so far: text, tokens, finish reasons, speculation stats."""

    def __init__(self, plan: Plan):
        num_choices = len(plan.requests)
        self.num_prompt_tokens = plan.num_prompt_tokens
        self.echo = plan.echo
        self.texts: list[list[str]] = [[text] if text else [] for text in plan.echo]
        self.finish: list[str | None] = [None] * num_choices
        self.num_tokens = [0] * num_choices
        self.stats: list[common_pb2.SpeculationStats | None] = [None] * num_choices

    def add(self, index: int, response: coordinator_pb2.GenerateResponse) -> tuple[str, str | None]:
        """Count one event of choice `index`; returns its new text and finish reason (None: going on).
        Skeleton mode streams the plan and the points as branches >= 0; the answer is branch -1 only."""
        self.num_tokens[index] += len(response.token_ids)
        if response.branch_id != -1:
            return "", None
        if response.text:
            self.texts[index].append(response.text)
        if response.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
            return response.text, None
        finish = FINISH_REASONS.get(response.finish_reason, "stop")
        self.finish[index], self.stats[index] = finish, response.stats
        return response.text, finish

    def text(self, index: int) -> str:
        return "".join(self.texts[index])

    def usage(self) -> Usage:
        completion = sum(self.num_tokens)
        return Usage(prompt_tokens=self.num_prompt_tokens, completion_tokens=completion,
                     total_tokens=self.num_prompt_tokens + completion, specmesh=speculation_usage(self.stats))


def speculation_usage(per_choice: list[common_pb2.SpeculationStats | None]) -> SpeculationUsage:
    """The choices' stats summed; rates recomputed from the sums (vLLM's definitions)."""
    stats = [s for s in per_choice if s is not None]
    usage = SpeculationUsage(
        num_drafts=sum(s.num_drafts for s in stats), num_draft_tokens=sum(s.num_draft_tokens for s in stats),
        num_accepted_tokens=sum(s.num_accepted_tokens for s in stats),
        num_target_forwards=sum(s.num_target_forwards for s in stats),
        draft_ms=sum(s.draft_ms for s in stats), verify_ms=sum(s.verify_ms for s in stats),
        drafter=",".join(dict.fromkeys(s.drafter for s in stats)),
        num_failovers=sum(s.num_failovers for s in stats), failovers=[f for s in stats for f in s.failovers],
        seeds=[s.seed for s in stats], lossy=any(s.lossy for s in stats))
    for s in stats:
        for position, count in enumerate(s.accepted_per_position):
            if position == len(usage.accepted_per_position):
                usage.accepted_per_position.append(0)
            usage.accepted_per_position[position] += count
    if usage.num_draft_tokens:
        usage.acceptance_rate = usage.num_accepted_tokens / usage.num_draft_tokens
    if usage.num_drafts:
        usage.mean_accepted_length = 1.0 + usage.num_accepted_tokens / usage.num_drafts
    return usage


class ChatRenderer:
    def __init__(self, response_id: str, created: int, model: str):
        self.response_id, self.created, self.model = response_id, created, model

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
        return sse(ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model, choices=choices,
                                       usage=usage))

    def opening(self, tally: Tally) -> list[bytes]:
        return [self._chunk([ChatChunkChoice(index=i, delta=Delta(role="assistant", content=""))])
                for i in range(len(tally.finish))]

    def delta(self, index: int, text: str, finish: str | None) -> list[bytes]:
        chunks = [self._chunk([ChatChunkChoice(index=index, delta=Delta(content=text))])] if text else []
        if finish is not None:
            chunks.append(self._chunk([ChatChunkChoice(index=index, delta=Delta(), finish_reason=finish)]))
        return chunks

    def usage_chunk(self, usage: Usage) -> bytes:
        return self._chunk([], usage)

    def body(self, tally: Tally) -> bytes:
        choices = [ChatChoice(index=i, message=AssistantMessage(content=tally.text(i)), finish_reason=tally.finish[i])
                   for i in range(len(tally.finish))]
        return ChatCompletionResponse(id=self.response_id, created=self.created, model=self.model, choices=choices,
                                      usage=tally.usage()).model_dump_json().encode()


class CompletionRenderer:
    def __init__(self, response_id: str, created: int, model: str):
        self.response_id, self.created, self.model = response_id, created, model

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> bytes:
        return sse(CompletionChunk(id=self.response_id, created=self.created, model=self.model, choices=choices,
                                   usage=usage))

    def opening(self, tally: Tally) -> list[bytes]:
        return [self._chunk([CompletionChoice(index=i, text=text, finish_reason=None)])
                for i, text in enumerate(tally.echo) if text]

    def delta(self, index: int, text: str, finish: str | None) -> list[bytes]:
        if not text and finish is None:
            return []
        return [self._chunk([CompletionChoice(index=index, text=text, finish_reason=finish)])]

    def usage_chunk(self, usage: Usage) -> bytes:
        return self._chunk([], usage)

    def body(self, tally: Tally) -> bytes:
        choices = [CompletionChoice(index=i, text=tally.text(i), finish_reason=tally.finish[i])
                   for i in range(len(tally.finish))]
        return CompletionResponse(id=self.response_id, created=self.created, model=self.model, choices=choices,
                                  usage=tally.usage()).model_dump_json().encode()
