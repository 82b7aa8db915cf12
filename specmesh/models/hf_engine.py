"""HFEngine: the Engine contract over any transformers AutoModelForCausalLM (the fallback backend).

One sequence per model call (a batch is run sequence by sequence), a `DynamicCache` per sequence,
cropped on truncate and deep-copied on fork. Token trees are not supported (NotImplementedError):
use the native engine for tree verification. KV capacity is counted in tokens over all sequences.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from specmesh.kv.errors import OutOfBlocksError
from specmesh.models.engine import DEFAULT_MAX_KV_TOKENS, ContextLengthError, EngineStats, KvUsage, SeqInput


class HFEngine:
    backend = "hf"  # Engine.backend

    def __init__(self, model, max_context: int, eos_token_ids: Sequence[int] = (), max_kv_tokens: int = DEFAULT_MAX_KV_TOKENS):
        self.model = model.eval()
        self.vocab_size = model.config.get_text_config().vocab_size
        self.max_context = max_context
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = model.device
        self.dtype = model.dtype
        self.stats = EngineStats()
        self.max_kv_tokens = max_kv_tokens
        self._caches: dict[int, Any] = {}  # seq_id -> DynamicCache (None while empty)
        self._lengths: dict[int, int] = {}
        self._next_seq_id = 0

    def new_sequence(self) -> int:
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        self._caches[seq_id] = None
        self._lengths[seq_id] = 0
        return seq_id

    def fork(self, seq_id: int) -> int:
        self._check_capacity(self.seq_len(seq_id))
        child = self.new_sequence()
        self._caches[child] = copy.deepcopy(self._caches[seq_id])
        self._lengths[child] = self._lengths[seq_id]
        return child

    def seq_len(self, seq_id: int) -> int:
        try:
            return self._lengths[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id}") from None

    def truncate(self, seq_id: int, length: int) -> None:
        current = self.seq_len(seq_id)
        if not 0 <= length <= current:
            raise ValueError(f"cannot truncate sequence {seq_id} of length {current} to {length}")
        if length == 0:
            self._caches[seq_id] = None
        elif length < current:
            self._caches[seq_id].crop(length - current)  # a negative count removes that many tokens
        self._lengths[seq_id] = length

    def keep_tree_path(self, seq_id: int, node_indices: Sequence[int]) -> None:
        raise NotImplementedError("the HF fallback engine does not run token trees; use the native engine")

    def free(self, seq_id: int) -> None:
        self.seq_len(seq_id)
        del self._caches[seq_id], self._lengths[seq_id]

    def kv_usage(self) -> KvUsage:
        """The HF cache is not paged: a block is one token."""
        return KvUsage(1, self.max_kv_tokens, max(0, self.max_kv_tokens - self.num_cached_tokens))

    @property
    def num_cached_tokens(self) -> int:
        return sum(self._lengths.values())

    def _check_capacity(self, num_new: int) -> None:
        if self.num_cached_tokens + num_new > self.max_kv_tokens:
            raise OutOfBlocksError(
                f"KV cache full: {self.num_cached_tokens} + {num_new} tokens exceed {self.max_kv_tokens}"
            )

    def forward(self, batch: Sequence[SeqInput]) -> list[torch.Tensor]:
        if any(item.parents is not None for item in batch):
            raise NotImplementedError("the HF fallback engine does not run token trees; use the native engine")
        if len({item.seq_id for item in batch}) != len(batch):
            raise ValueError("a sequence appears twice in one batch")
        for item in batch:
            num_new = len(item.token_ids)
            if num_new == 0:
                raise ValueError(f"sequence {item.seq_id}: no new tokens")
            if self.seq_len(item.seq_id) + num_new > self.max_context:
                raise ContextLengthError(f"sequence {item.seq_id} would exceed the model's context {self.max_context}")
            if any(not 0 <= t < self.vocab_size for t in item.token_ids):
                raise ValueError(f"sequence {item.seq_id}: token id outside 0..{self.vocab_size - 1}")
            if any(not 0 <= i < num_new for i in item.logits_at):
                raise ValueError(f"sequence {item.seq_id}: logits_at outside 0..{num_new - 1}")
        self._check_capacity(sum(len(item.token_ids) for item in batch))
        results = []
        with torch.inference_mode():
            for item in batch:
                start = self._lengths[item.seq_id]
                ids = torch.tensor([item.token_ids], dtype=torch.long, device=self.device)
                logits, self._caches[item.seq_id] = self._run(item.seq_id, ids, start)
                self._lengths[item.seq_id] = start + ids.shape[1]
                results.append(logits[0, list(item.logits_at)].float())
        self.stats.num_forwards += 1
        self.stats.num_sequences_forwarded += len(batch)
        self.stats.num_tokens_forwarded += sum(len(item.token_ids) for item in batch)
        self.stats.num_attention_rows += len(batch)  # one sequence per model call: no shared rows
        return results

    def _run(self, seq_id: int, ids: torch.Tensor, start: int) -> tuple[torch.Tensor, Any]:
        """One model call: ids [1, num_new] after `start` cached tokens -> (logits [1, num_new, vocab],
        the sequence's cache). A subclass with other model inputs (encoder-decoder) overrides it."""
        from transformers import DynamicCache

        cache = self._caches[seq_id]
        if cache is None:
            cache = DynamicCache(config=self.model.config)
        positions = torch.arange(start, start + ids.shape[1], device=self.device)
        out = self.model(
            input_ids=ids,
            past_key_values=cache,
            position_ids=positions.unsqueeze(0),
            cache_position=positions,
            use_cache=True,
        )
        return out.logits, out.past_key_values
