"""An OpenAI request as Coordinator `GenerateRequest`s, one per choice.

Choices are numbered as OpenAI numbers them: prompt i's j-th sample is choice i * n + j. n > 1 is
n Generate streams at once (their verify rounds batch on the Verify service); with a seed s, a
prompt's j-th sample uses seed s + j, so each is reproducible on its own; greedy samples are identical.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.schema import MAX_SEED, ChatCompletionRequest, CompletionRequest, GenerationFields
from specmesh.models.chat import chat_messages_ids
from specmesh.proto.v1 import common_pb2, coordinator_pb2

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat: the Coordinator's default
MODES = {
    None: coordinator_pb2.GENERATION_MODE_UNSPECIFIED,
    "speculative": coordinator_pb2.GENERATION_MODE_SPECULATIVE,
    "fused": coordinator_pb2.GENERATION_MODE_FUSED,
    "skeleton": coordinator_pb2.GENERATION_MODE_SKELETON,
    "autoregressive": coordinator_pb2.GENERATION_MODE_AUTOREGRESSIVE,
}


@dataclass
class Plan:
    requests: list[coordinator_pb2.GenerateRequest]  # [choices] in choice order
    num_prompt_tokens: int  # every prompt once (OpenAI's usage counts a prompt once for its n samples)
    echo: list[str]  # [choices] text shown before the completion ("" unless echo)


def _sampling(body: GenerationFields, max_new_tokens: int | None, choice: int) -> common_pb2.SamplingParams:
    pb = common_pb2.SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.specmesh.top_k,
        stop=body.stop_strings,
        max_new_tokens=max_new_tokens or 0,  # 0 = the Coordinator's default
        ignore_eos=body.specmesh.ignore_eos,
    )
    if body.seed is not None:
        pb.seed = (body.seed + choice) % MAX_SEED
    return pb


def _request(body: GenerationFields, max_new_tokens: int | None, choice: int, request_id: str,
             **input_) -> coordinator_pb2.GenerateRequest:
    request = coordinator_pb2.GenerateRequest(
        **input_, sampling=_sampling(body, max_new_tokens, choice), mode=MODES[body.specmesh.mode],
        num_draft_tokens=body.specmesh.k, drafter=body.specmesh.drafter or "", request_id=f"{request_id}-{choice}",
        cascade=body.specmesh.cascade)
    if body.specmesh.cascade_lambda is not None:
        request.cascade_lambda = float(body.specmesh.cascade_lambda)
    return request


def completion_plan(body: CompletionRequest, tokenizer, request_id: str) -> Plan:
    max_new_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    requests, echo, num_prompt_tokens = [], [], 0
    for prompt in body.prompts:
        num_prompt_tokens += len(tokenizer.encode(prompt, add_special_tokens=False))  # as the Coordinator encodes it
        for j in range(body.n):
            requests.append(_request(body, max_new_tokens, j, request_id, prompt=prompt))
            echo.append(prompt if body.echo else "")
    return Plan(requests, num_prompt_tokens, echo)


def chat_plan(body: ChatCompletionRequest, tokenizer, request_id: str) -> Plan:
    turns = [message.as_turn() for message in body.messages]
    chat = coordinator_pb2.ChatMessages(messages=[coordinator_pb2.ChatMessage(**turn) for turn in turns])
    requests = [_request(body, body.max_new_tokens, j, request_id, chat=chat) for j in range(body.n)]
    return Plan(requests, len(chat_messages_ids(tokenizer, turns)), [""] * body.n)
