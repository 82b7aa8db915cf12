"""An OpenAI request as Coordinator `GenerateRequest`s, one per choice.

Choices are numbered as OpenAI numbers them: prompt i's j-th sample is choice i * n + j. n > 1 is
n Generate streams at once (their verify rounds batch on the Verify service); with a seed s, a
prompt's j-th sample uses seed s + j, so each is reproducible on its own; greedy samples are identical.

With the target's context length known (the Coordinator's GetStats), a prompt that fills it, or a
max_tokens / max_completion_tokens the client set above what a prompt leaves of it, is a 400
(`context_length_exceeded`) before anything is sent; an unset one is the default, which the
Coordinator ends at the context's end.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.errors import OpenAIError, invalid
from gateway.schema import MAX_SEED, ChatCompletionRequest, CompletionRequest, GenerationFields
from servicekit.streams import whole_answer_interval_ms
from specmesh.models.chat import ChatRoleError, chat_messages_ids
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
    whole = None if body.stream else whole_answer_interval_ms(body.stop_strings)
    if whole is not None:  # a completion answered whole: no messages between its first tokens and its last
        request.stream_interval_ms = whole
    return request


def check_context(num_prompt_tokens: int, asked: int | None, max_context: int | None, param: str, prompt_param: str) -> None:
    """OpenAIError 400 when the prompt fills the context, or the client asked (`asked`, its field
    `param`) for more new tokens than the prompt leaves; nothing to check while the context is unknown."""
    if not max_context:
        return
    if num_prompt_tokens >= max_context:
        raise OpenAIError(400, f"This model's maximum context length is {max_context} tokens, and the prompt has "
                               f"{num_prompt_tokens}: it leaves no room for new tokens", prompt_param, "context_length_exceeded")
    left = max_context - num_prompt_tokens
    if asked is not None and asked > left:
        raise OpenAIError(400, f"{param} = {asked} is more than the {left} tokens the {num_prompt_tokens}-token prompt leaves "
                               f"of this model's {max_context}-token context", param, "context_length_exceeded")


def completion_plan(body: CompletionRequest, tokenizer, request_id: str, max_context: int | None = None) -> Plan:
    max_new_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    requests, echo, num_prompt_tokens = [], [], 0
    for prompt in body.prompts:
        num_tokens = len(tokenizer.encode(prompt, add_special_tokens=False))  # as the Coordinator encodes it
        check_context(num_tokens, body.max_tokens, max_context, "max_tokens", "prompt")
        num_prompt_tokens += num_tokens
        for j in range(body.n):
            requests.append(_request(body, max_new_tokens, j, request_id, prompt=prompt))
            echo.append(prompt if body.echo else "")
    return Plan(requests, num_prompt_tokens, echo)


def chat_plan(body: ChatCompletionRequest, tokenizer, request_id: str, max_context: int | None = None) -> Plan:
    turns = [message.as_turn() for message in body.messages]
    try:
        num_prompt_tokens = len(chat_messages_ids(tokenizer, turns))  # as the Coordinator renders it (roles checked)
    except ChatRoleError as exc:  # a role this model's template does not render
        raise invalid(str(exc), f"messages.{exc.index}.role") from exc
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    check_context(num_prompt_tokens, body.max_new_tokens, max_context, param, "messages")
    chat = coordinator_pb2.ChatMessages(messages=[coordinator_pb2.ChatMessage(**turn) for turn in turns])
    requests = [_request(body, body.max_new_tokens, j, request_id, chat=chat) for j in range(body.n)]
    return Plan(requests, num_prompt_tokens, [""] * body.n)
