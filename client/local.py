"""In-process speculative generation with text in and text out (the demo and the CLI use it).

    gen = LocalGenerator("default", drafter="bf16")
    for text in gen.stream_text("Explain rainbows.", SamplingParams(temperature=0)):
        print(text, end="")
    print(gen.last_stats.summary())
"""

from __future__ import annotations

from collections.abc import Iterator

from specmesh.decoding.adaptive import AcceptanceMemories, AdaptiveK, FixedK
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.speculative import speculative_stream
from specmesh.decoding.stats import SpecStats
from specmesh.decoding.verifier import TargetVerifier
from specmesh.drafters.model import ModelDrafter, self_draft
from specmesh.drafters.ngram import PromptLookupDrafter
from specmesh.generator import DRAFTERS, SELF_DRAFTS, load_self_draft
from specmesh.models.chat import chat_prompt_ids
from specmesh.models.encdec import bind_encoder_input, is_encoder_decoder
from specmesh.models.engine import measure_step
from specmesh.models.load import load_engine
from specmesh.models.pairing import check_draft_compatible
from specmesh.models.resolve import resolve_model_spec


class LocalGenerator:
    def __init__(self, model: str = "default", drafter: str = "bf16", dtype: str = "float32", device: str = "cpu",
                 quantize: str = ""):
        from transformers import AutoTokenizer

        if drafter not in DRAFTERS:
            raise ValueError(f"unknown drafter {drafter!r}; choose one of {', '.join(DRAFTERS)}")
        folder = resolve_model_spec(model)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.engine = load_engine(folder, dtype=dtype, device=device, quantize=quantize or None)
        self.verifier = TargetVerifier(self.engine)
        self.drafter_name = drafter
        self.draft_engine = None  # the self-draft's engine (bf16, int8, q4_1), if any
        if drafter in SELF_DRAFTS:
            self.draft_engine = load_self_draft(folder, drafter, device)
        if self.draft_engine is not None:
            check_draft_compatible(self.engine, self.draft_engine)
            for engine in (self.engine, self.draft_engine):  # the costs that decide, before the first round,
                measure_step(engine)                          # whether this drafter can pay here
        self.last_stats: SpecStats | None = None
        self.last_token_ids: list[int] = []  # the last generation's tokens, and why it ended (a FinishReason value)
        self.last_finish_reason: str | None = None
        # a self-draft's acceptance over this generator's requests, where its adaptive k starts (its acceptance is the
        # model pair's; an n-gram lookup's is the prompt's: that starts from the prior)
        self._acceptance = AcceptanceMemories()

    def prompt_ids(self, prompt: str, chat: bool = True) -> list[int]:
        return chat_prompt_ids(self.tokenizer, prompt) if chat else self.tokenizer.encode(prompt)

    def _drafter(self, name: str):
        if name == "ngram":
            return PromptLookupDrafter(min_n=1, max_n=4)
        if name in SELF_DRAFTS:
            return self_draft(self.draft_engine, self.engine)
        return None

    def stream_text(self, prompt: str, params: SamplingParams, num_draft_tokens: int = 0,
                    drafter: str | None = None, chat: bool = True) -> Iterator[str]:
        """Yield text deltas; `drafter="none"` decodes plainly; num_draft_tokens 0 = adaptive k."""
        name = self.drafter_name if drafter is None else drafter
        draft = self._drafter(name)
        k_policy = None
        if draft is not None:
            if num_draft_tokens:
                k_policy = FixedK(num_draft_tokens)
            else:
                k_policy = self._acceptance.policy(name, params.is_greedy) if name in SELF_DRAFTS else AdaptiveK()

        def decode(tokens) -> str:
            return self.tokenizer.decode(tokens, skip_special_tokens=True)

        if is_encoder_decoder(self.engine):  # the prompt is the encoder's input; the decoder starts on its own tokens
            encoder_ids = self.tokenizer(prompt).input_ids
            target = bind_encoder_input(self.engine, encoder_ids)
            verifier, ids = TargetVerifier(target), list(target.decoder_prompt_ids)
            if isinstance(draft, ModelDrafter):
                draft = ModelDrafter(bind_encoder_input(draft.engine, encoder_ids))
        else:
            verifier, ids = self.verifier, self.prompt_ids(prompt, chat)
        self.last_token_ids, self.last_finish_reason = [], None
        for event in speculative_stream(verifier, draft, ids, params, k_policy=k_policy, decode=decode):
            self.last_token_ids += event.token_ids
            if event.finish_reason is not None:
                self.last_stats, self.last_finish_reason = event.stats, event.finish_reason.value
            if event.text:
                yield event.text
