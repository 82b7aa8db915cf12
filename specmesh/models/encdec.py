"""EncDecEngine: the Engine contract over a transformers encoder-decoder model (T5, BART, Marian, ...).

A sequence is the *decoder* side: its tokens are the decoder's (the decoder prompt, e.g. the
decoder start token, then everything generated), its KV is the decoder's self-attention cache, and
it carries the encoder's output for one encoder input. The encoder runs once, when the sequence is
made (`new_sequence(encoder_input_ids=...)`); every decoder forward cross-attends to that output.
Rollback (`truncate`) crops the self-attention cache only: the cross-attention keys and values
depend on the encoder input alone and stay. `fork` shares the encoder output.

So the decoding code is the decoder-only code, unchanged: a `TargetVerifier` verifies k draft
tokens in one decoder forward with the same acceptance, a `ModelDrafter` drafts on its own
encoder-decoder model, `SpeculationState` counts decoder tokens. They make sequences with a plain
`new_sequence()`, so a request binds its encoder input with a view of the engine:

    target, draft = load_engine(big_t5), load_engine(small_t5)     # EncDecEngine each
    check_draft_compatible(target, draft, big_t5, small_t5)         # specmesh.models.pairing
    encoder_ids = tokenizer("translate English to German: Hello").input_ids
    verifier = TargetVerifier(target.bind(encoder_ids))             # the encoder runs on open
    drafter = ModelDrafter(draft.bind(encoder_ids))
    result = generate(verifier, drafter, target.decoder_prompt_ids, params)

A view is the same engine (same sequences, same KV pool); only its `new_sequence()` differs. So a
service keeps one verifier (and drafter) on the engine for its batched rounds and opens a session
through a view: `TargetVerifier(engine.bind(ids)).begin(...)`, `ModelDrafter(engine.bind(ids)).open(...)`.

Decoder prompt: `decoder_prompt_ids` is what generation starts from, the model's
decoder_start_token_id, then its forced_bos_token_id if it has one (BART-large, mBART with a fixed
language): a forced first token is a one-token prompt, not a logits processor. Other generation
config processors (bad_words_ids, no_repeat_ngram_size, forced_eos_token_id, length penalties) are
not applied: as for decoder-only models, the model's own distribution is decoded.

KV accounting counts decoder tokens plus, per sequence, its encoder tokens (the cross-attention KV).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from specmesh.models.engine import DEFAULT_MAX_KV_TOKENS, ContextLengthError, EngineStats, KvUsage, SeqInput
from specmesh.models.hf_engine import HFEngine


def validate_encoder_input(encoder_input_ids: Sequence[int], max_tokens: int, vocab_size: int) -> list[int]:
    """The encoder input as a list of ints, or ValueError / ContextLengthError naming what is wrong
    (the one check of every entry point: the engine, the services)."""
    ids = [int(t) for t in encoder_input_ids]
    if not ids:
        raise ValueError("the encoder input must have at least one token")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"encoder input token id {bad} is outside the vocabulary [0, {vocab_size})")
    if len(ids) > max_tokens:
        raise ContextLengthError(f"encoder input of {len(ids)} tokens exceeds the model's {max_tokens}-token limit")
    return ids


def decoder_prompt_ids(model) -> tuple[int, ...]:
    """The decoder's start: decoder_start_token_id (+ forced_bos_token_id); () if the model names none."""
    gen, config = model.generation_config, model.config
    start = _first_set(getattr(gen, "decoder_start_token_id", None), getattr(config, "decoder_start_token_id", None))
    if start is None:
        return ()
    forced = _first_set(getattr(gen, "forced_bos_token_id", None), getattr(config, "forced_bos_token_id", None))
    return (start,) if forced is None else (start, forced)


def _first_set(*values) -> int | None:
    for value in values:
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return None


class EncDecEngine(HFEngine):
    """One sequence per model call (as HFEngine); no token trees. Not thread-safe: one engine thread."""

    is_encoder_decoder = True

    def __init__(self, model, max_context: int, eos_token_ids: Sequence[int] = (),
                 max_kv_tokens: int = DEFAULT_MAX_KV_TOKENS, max_encoder_tokens: int | None = None):
        super().__init__(model, max_context, eos_token_ids, max_kv_tokens)
        self.vocab_size = model.config.get_text_config(decoder=True).vocab_size
        self.max_encoder_tokens = max_encoder_tokens or max_context
        self.decoder_prompt_ids = decoder_prompt_ids(model)
        self._encoded: dict[int, torch.Tensor | None] = {}  # seq_id -> encoder output [1, num_encoder_tokens, d_model]

    def bind(self, encoder_input_ids: Sequence[int]) -> EncoderBoundEngine:
        """This engine, with `new_sequence()` making sequences on `encoder_input_ids` (module docstring)."""
        return EncoderBoundEngine(self, validate_encoder_input(encoder_input_ids, self.max_encoder_tokens, self.vocab_size))

    def encode(self, encoder_input_ids: Sequence[int]) -> torch.Tensor:
        """Run the encoder: ids [n] -> its last hidden state [1, n, d_model]."""
        ids = validate_encoder_input(encoder_input_ids, self.max_encoder_tokens, self.vocab_size)
        self._check_capacity(len(ids))
        with torch.inference_mode():
            tensor = torch.tensor([ids], dtype=torch.long, device=self.device)
            return self.model.get_encoder()(input_ids=tensor).last_hidden_state

    def new_sequence(self, encoder_input_ids: Sequence[int] | None = None) -> int:
        """A decoder sequence on `encoder_input_ids` (the encoder runs now). Without one the sequence
        cannot be forwarded: it is for `fork`, which gives the child its parent's encoder output."""
        encoded = None if encoder_input_ids is None else self.encode(encoder_input_ids)
        seq_id = super().new_sequence()
        self._encoded[seq_id] = encoded
        return seq_id

    def fork(self, seq_id: int) -> int:
        child = super().fork(seq_id)
        self._encoded[child] = self._encoded[seq_id]  # read-only: shared
        return child

    def free(self, seq_id: int) -> None:
        super().free(seq_id)
        del self._encoded[seq_id]

    def num_encoder_tokens(self, seq_id: int) -> int:
        encoded = self._encoded[seq_id]
        return 0 if encoded is None else encoded.shape[1]

    @property
    def num_cached_tokens(self) -> int:
        return sum(self._lengths.values()) + sum(self.num_encoder_tokens(s) for s in self._encoded)

    def forward(self, batch: Sequence[SeqInput]) -> list[torch.Tensor]:
        for item in batch:
            self.seq_len(item.seq_id)
            if self._encoded[item.seq_id] is None:
                raise ValueError(f"sequence {item.seq_id} has no encoder input: make it with "
                                 "new_sequence(encoder_input_ids=...) or through engine.bind(encoder_input_ids)")
        return super().forward(batch)

    def _run(self, seq_id: int, ids: torch.Tensor, start: int) -> tuple[torch.Tensor, Any]:
        """One decoder call over ids [1, num_new]; the cache holds exactly `start` decoder tokens, so the
        model places the new ones at start, start + 1, ... (T5's relative bias, BART's learned positions)."""
        from transformers import DynamicCache, EncoderDecoderCache
        from transformers.modeling_outputs import BaseModelOutput

        cache = self._caches[seq_id]
        if cache is None:
            cache = EncoderDecoderCache(DynamicCache(config=self.model.config), DynamicCache(config=self.model.config))
        out = self.model(encoder_outputs=BaseModelOutput(last_hidden_state=self._encoded[seq_id]),
                         decoder_input_ids=ids, past_key_values=cache, use_cache=True)
        return out.logits, out.past_key_values


class EncoderBoundEngine:
    """An EncDecEngine seen by one request: `new_sequence()` runs the encoder on the bound input; every
    other member is the engine's own (same sequences, KV pool and stats)."""

    is_encoder_decoder = True

    def __init__(self, engine: EncDecEngine, encoder_input_ids: list[int]):
        self.engine = engine
        self.encoder_input_ids = encoder_input_ids  # [num_encoder_tokens]
        self.backend = engine.backend
        self.vocab_size = engine.vocab_size
        self.max_context = engine.max_context
        self.eos_token_ids = engine.eos_token_ids
        self.device = engine.device
        self.dtype = engine.dtype
        self.stats: EngineStats = engine.stats
        self.decoder_prompt_ids = engine.decoder_prompt_ids

    def new_sequence(self) -> int:
        return self.engine.new_sequence(encoder_input_ids=self.encoder_input_ids)

    def kv_usage(self) -> KvUsage:
        return self.engine.kv_usage()

    def fork(self, seq_id: int) -> int:
        return self.engine.fork(seq_id)

    def seq_len(self, seq_id: int) -> int:
        return self.engine.seq_len(seq_id)

    def truncate(self, seq_id: int, length: int) -> None:
        self.engine.truncate(seq_id, length)

    def keep_tree_path(self, seq_id: int, node_indices: Sequence[int]) -> None:
        self.engine.keep_tree_path(seq_id, node_indices)

    def free(self, seq_id: int) -> None:
        self.engine.free(seq_id)

    def forward(self, batch: Sequence[SeqInput]) -> list[torch.Tensor]:
        return self.engine.forward(batch)


def is_encoder_decoder(engine: Any) -> bool:
    """True for an EncDecEngine or a view of one (decoder-only engines have no such flag)."""
    return bool(getattr(engine, "is_encoder_decoder", False))


def bind_encoder_input(engine: Any, encoder_input_ids: Sequence[int]) -> EncoderBoundEngine:
    """`engine.bind(encoder_input_ids)` for an engine known only as an Engine; ValueError when it is
    decoder-only (it takes no encoder input)."""
    if not isinstance(engine, EncDecEngine):
        raise ValueError("this model is decoder-only: it takes no encoder input")
    return engine.bind(encoder_input_ids)


def is_encoder_decoder_config(hf_config) -> bool:
    return bool(getattr(hf_config, "is_encoder_decoder", False))


def load_encdec_engine(folder: str | Path, hf_config, dtype: torch.dtype, device: torch.device,
                       max_kv_tokens: int, eos_token_ids: Sequence[int]) -> EncDecEngine:
    """An EncDecEngine on an HF folder whose config is encoder-decoder (AutoModelForSeq2SeqLM)."""
    from transformers import AutoModelForSeq2SeqLM

    from specmesh.models.engine import config_max_context

    try:
        model = AutoModelForSeq2SeqLM.from_pretrained(folder, dtype=dtype)
    except ValueError as exc:
        raise ValueError(f"{hf_config.model_type!r} is an encoder-decoder architecture transformers cannot load "
                         f"as a text-to-text model (AutoModelForSeq2SeqLM): {str(exc).splitlines()[0]}") from None
    decoder_config = hf_config.get_text_config(decoder=True)
    encoder_config = getattr(hf_config, "encoder", None) or hf_config  # a composite EncoderDecoderConfig has its own
    return EncDecEngine(model.to(device), max_context=config_max_context(decoder_config), eos_token_ids=eos_token_ids,
                        max_kv_tokens=max_kv_tokens, max_encoder_tokens=config_max_context(encoder_config))
