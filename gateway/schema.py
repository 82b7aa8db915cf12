"""The OpenAI request and response bodies as pydantic models.

Requests are strict: an unknown field, a wrong type, or a value we cannot honour is a 400 naming
the field, never a silent ignore. Fields the SDKs send with neutral values are accepted when they
are neutral: `user` (any), `frequency_penalty` / `presence_penalty` 0, an empty `logit_bias`,
`logprobs` false / null, `response_format` text, no tools. specmesh's own options sit under one
key, `"specmesh": {"mode": "fused", "drafter": "ngram", "k": 4, "top_k": 0, "ignore_eos": false}`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_serializer

from specmesh.models.chat import CHAT_ROLES

MAX_STOP_STRINGS = 16
MAX_SEED = 2**64  # seeds are uint64 on the wire
MAX_UINT32 = 2**32 - 1  # max_new_tokens and top_k are uint32 on the wire (the context bounds max_tokens further)
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role
Mode = Literal["speculative", "fused", "skeleton", "autoregressive"]  # the Coordinator's GenerationMode names
MODES = get_args(Mode)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _neutral(value: Any, neutral: tuple, what: str) -> Any:
    """`value` if it is None or neutral (nothing to honour), else the 400 naming what is accepted."""
    if value is not None and value not in neutral:
        accepted = f" (only {' or '.join(json.dumps(v) for v in neutral)})" if neutral else ""
        raise ValueError(f"{what} not supported{accepted}")
    return value


# requests
class SpecmeshOptions(Strict):
    mode: Mode | None = None  # None = the Coordinator's default
    drafter: Literal["service", "ngram"] | None = None  # speculative mode; None = the Coordinator's default
    k: Annotated[int, Field(ge=0, le=64)] = 0  # draft tokens per round; 0 = adaptive
    top_k: Annotated[int, Field(ge=0, le=MAX_UINT32)] = 0  # keep the k most likely tokens; 0 = no limit
    ignore_eos: bool = False  # keep generating past the end-of-sequence token (benchmarks)
    cascade: str = ""  # Stage services the draft climbs first: "" = the Coordinator's, "none" = off
    # the adaptive cascade (LOSSY, opt-in): a number >= 0, or "inf" (lossless; JSON has no infinity);
    # None = the Coordinator's default. usage.specmesh.lossy says when tokens skipped the target's check.
    cascade_lambda: Annotated[float, Field(ge=0)] | Literal["inf"] | None = None


class StreamOptions(Strict):
    include_usage: bool = False


class GenerationFields(Strict):
    """What completions and chat completions share."""

    model: str
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None  # None = 1 (OpenAI's default)
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=0, lt=MAX_SEED)] | None = None
    stop: str | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: Annotated[int, Field(ge=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted; the caller's identity comes from its API key
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    specmesh: SpecmeshOptions = Field(default_factory=SpecmeshOptions)

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None) -> float | None:
        return _neutral(value, (0,), "a non-zero penalty is")

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: dict | None) -> dict | None:
        if value:
            raise ValueError("logit_bias is not supported (only an empty mapping)")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value: str | list[str] | None) -> str | list[str] | None:
        if value == "":
            raise ValueError("a stop string may not be empty")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerationFields):
    prompt: str | Annotated[list[str], Field(min_length=1)] | list[int] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=1, le=MAX_UINT32)] | None = None  # None = 16 (OpenAI's default for completions)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _text_prompts(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("prompt may not be an empty list")
        if isinstance(value, list) and not isinstance(value[0], str):
            raise ValueError("token-id prompts are not supported; send text")
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: int | None) -> int | None:
        return _neutral(value, (), "logprobs are")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        return _neutral(value, ("",), "suffix is")

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        return _neutral(value, (info.data.get("n", 1),), "best_of other than n is")

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)  # type: ignore[arg-type]


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: str  # one of the chat template's roles (`specmesh.models.chat.CHAT_ROLES`) or an alias of one
    content: str | list[TextPart]

    @field_validator("role")
    @classmethod
    def _known_role(cls, value: str) -> str:
        if ROLE_ALIASES.get(value, value) not in CHAT_ROLES:
            roles = ", ".join([*CHAT_ROLES, *ROLE_ALIASES])
            raise ValueError(f"role {value[:40]!r} is not supported; use one of: {roles}")
        return value

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)

    def as_turn(self) -> dict[str, str]:
        """The role / content pair the chat template reads ("developer" is OpenAI's newer "system")."""
        return {"role": ROLE_ALIASES.get(self.role, self.role), "content": self.text}


class ResponseFormat(Strict):
    type: Literal["text"]


class ChatCompletionRequest(GenerationFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, le=MAX_UINT32)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_UINT32)] | None = None  # wins over max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none"] | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | None) -> bool | None:
        return _neutral(value, (False,), "logprobs are")

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, value: int | None) -> int | None:
        return _neutral(value, (0,), "top_logprobs are")

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: list | None) -> list | None:
        if value:
            raise ValueError("tools are not supported")
        return value

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# responses
class SpeculationUsage(BaseModel):
    """The request's speculation stats, summed over its choices (vLLM's definitions)."""

    acceptance_rate: float = 0.0  # accepted / draft tokens
    mean_accepted_length: float = 1.0  # 1 + accepted / drafts: tokens per round that carried a draft
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = Field(default_factory=list)
    num_target_forwards: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    drafter: str = ""  # the drafter that finished the request(s): draft-service | ngram | ngram@verify | fused | "" (target only)
    num_failovers: int = 0
    failovers: list[str] = Field(default_factory=list)
    seeds: list[int] = Field(default_factory=list)  # per choice: the seed that was used
    lossy: bool = False  # an opt-in lossy mode (the adaptive cascade) made some tokens: not exactly the target's


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    specmesh: SpeculationUsage | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class Delta(BaseModel):
    """Only what this chunk adds: the role on a choice's first chunk, then content; {} at the end."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler) -> dict:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specmesh"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
