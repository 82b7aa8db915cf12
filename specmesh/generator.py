"""Text in, text out: a model's tokenizer and chat template, its engine, a drafter and the speculation
loop (`specmesh.decoding.speculative`), put together. Nothing here is new; it only wires the pieces.

    gen = Generator("default", drafter="ngram")      # any model spec: "default", an HF folder, a .gguf, a hub id
    result = gen.generate("Explain rainbows.", SamplingParams(temperature=0, max_new_tokens=64))
    print(result.text, result.stats.summary())
    for event in gen.stream("Explain rainbows.", SamplingParams(temperature=0.7, seed=1)):
        print(event.text, end="")                    # each round's new text, as it is accepted

Drafters by name: "ngram" (prompt lookup: no second model), "bf16" / "int8" / "q4_1" (a self-draft: the
target's own weights in bfloat16, int8 or 4-bit Q4_1 blocks, the low-bit ones on the CPU; each takes what it
was not told from the target's KV), "none" (plain decoding); or any `Drafter` object. The output is the
target's own (greedy: token-identical to plain decoding; sampling: the same distribution). A Generator
is not thread-safe: one generation at a time.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from specmesh.decoding.adaptive import FixedK
from specmesh.decoding.proposal import Drafter
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.speculative import GenerationResult, generate, speculative_stream
from specmesh.decoding.state import StepEvent
from specmesh.decoding.verifier import TargetVerifier
from specmesh.drafters.model import ModelDrafter, self_draft
from specmesh.drafters.ngram import PromptLookupDrafter
from specmesh.models.chat import chat_messages_ids
from specmesh.models.encdec import bind_encoder_input, is_encoder_decoder
from specmesh.models.engine import Engine
from specmesh.models.load import load_engine
from specmesh.models.pairing import check_draft_compatible
from specmesh.models.resolve import resolve_model_spec

# a self-draft: the target's own weights at a lower precision, as `load_engine` loads them (low-bit: CPU only).
# Measured on 2 CPU threads (bench/draft_bounds.py): a step of the default model in bf16 11.5 ms, int8 11.1,
# Q4_1 9.1 against the fp32 target's 19.5, agreeing with its greedy tokens 99.5% / 97.3% / 98.6% of the time
SELF_DRAFTS: dict[str, dict[str, str]] = {"bf16": {"dtype": "bfloat16"}, "int8": {"dtype": "float32", "quantize": "int8"},
                                          "q4_1": {"dtype": "float32", "quantize": "q4_1"}}
DRAFTERS = ("none", "ngram", *SELF_DRAFTS)


def load_self_draft(folder, name: str, device: str = "cpu") -> Engine:
    """The engine of self-draft `name` (`SELF_DRAFTS`) of the model in `folder`; a low-bit one on the CPU."""
    kind = SELF_DRAFTS[name]
    quantize = kind.get("quantize")
    return load_engine(folder, dtype=kind["dtype"], device="cpu" if quantize else device, quantize=quantize)

Prompt = str | Sequence[dict[str, str]]  # text (one user message), or a conversation of role / content dicts


class Generator:
    """A model spec -> tokenizer, target engine and verifier, drafter; `generate` / `stream` take text."""

    def __init__(self, model: str = "default", drafter: str | Drafter | None = "ngram", *, dtype: str = "float32",
                 device: str = "cpu", quantize: str | None = None, k: int = 0):
        """`k`: draft tokens per round, 0 = adaptive (the cost-aware `AdaptiveK`)."""
        from transformers import AutoTokenizer

        if isinstance(drafter, str) and drafter not in DRAFTERS:
            raise ValueError(f"unknown drafter {drafter!r}; choose one of {', '.join(DRAFTERS)} or pass a Drafter")
        folder = resolve_model_spec(model)
        self.tokenizer: Any = AutoTokenizer.from_pretrained(folder)  # a transformers tokenizer
        self.engine = load_engine(folder, dtype=dtype, device=device, quantize=quantize or None)
        self.verifier = TargetVerifier(self.engine)
        self.drafter = self._make_drafter(folder, drafter, device)
        self.k = k

    def _make_drafter(self, folder, drafter: str | Drafter | None, device: str) -> Drafter | None:
        if drafter is None or not isinstance(drafter, str):
            return drafter
        if drafter == "none":
            return None
        if drafter == "ngram":
            return PromptLookupDrafter(min_n=1, max_n=4)
        draft_engine = load_self_draft(folder, drafter, device)
        check_draft_compatible(self.engine, draft_engine)
        return self_draft(draft_engine, self.engine)

    def prompt_ids(self, prompt: Prompt, chat: bool = True) -> list[int]:
        """Token ids of a prompt: through the model's chat template (a string is one user message),
        or, with `chat=False`, the text tokenized as-is."""
        if isinstance(prompt, str):
            return chat_messages_ids(self.tokenizer, [{"role": "user", "content": prompt}]) if chat else self.tokenizer.encode(prompt)
        return chat_messages_ids(self.tokenizer, list(prompt))

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _loop_args(self, prompt: Prompt, params: SamplingParams | None, chat: bool):
        params = SamplingParams() if params is None else params
        params.validate(self.engine.vocab_size)
        kwargs = {"k_policy": FixedK(self.k) if self.k else None, "decode": self._decode}
        if not is_encoder_decoder(self.engine):
            return self.verifier, self.drafter, self.prompt_ids(prompt, chat), params, kwargs
        # encoder-decoder (T5, BART, ...): the text is the encoder's input; the decoder starts on its own tokens
        if not isinstance(prompt, str):
            raise ValueError("an encoder-decoder model takes text, not a conversation")
        encoder_ids = self.tokenizer(prompt).input_ids
        target = bind_encoder_input(self.engine, encoder_ids)
        drafter = self.drafter
        if isinstance(drafter, ModelDrafter):
            drafter = ModelDrafter(bind_encoder_input(drafter.engine, encoder_ids))
        return TargetVerifier(target), drafter, list(target.decoder_prompt_ids), params, kwargs

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, *, chat: bool = True) -> Iterator[StepEvent]:
        """One `StepEvent` per round: `.text` the new visible text, `.token_ids` the new tokens; the last
        has `finish_reason` and `stats`. Stop strings (`params.stop`) end the text before them."""
        verifier, drafter, ids, params, kwargs = self._loop_args(prompt, params, chat)
        return speculative_stream(verifier, drafter, ids, params, **kwargs)

    def generate(self, prompt: Prompt, params: SamplingParams | None = None, *, chat: bool = True) -> GenerationResult:
        """`stream`, collected: `.text`, `.token_ids`, `.finish_reason`, `.stats` (`SpecStats`)."""
        verifier, drafter, ids, params, kwargs = self._loop_args(prompt, params, chat)
        return generate(verifier, drafter, ids, params, **kwargs)
