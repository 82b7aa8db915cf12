"""The skeleton grammar over a tokenizer's vocabulary: the exact set of allowed tokens per state.

`automaton.py` gives a byte-level DFA of the skeleton format. Here a token is allowed in a state iff
walking ALL its bytes from that state never hits DEAD_STATE — so multi-character tokens are judged
as a whole ("]\\n2." is refused after the last allowed point even though "]" alone is fine), and a
token carrying half a UTF-8 character is judged on its bytes. The walk is vectorised over the
vocabulary (tokens sorted by length, one numpy gather per byte position): about 1 ms per state for
SmolLM2's 49k vocabulary, then cached per state (bit-packed).

Special tokens are never allowed, except EOS once the skeleton is complete: in the accepting state
the mask is exactly the EOS ids, and EOS keeps the state accepting. Every allowed token adds at least
one byte, so a constrained generation ends within `max_tokens` tokens (EOS included).

Exactness of speculative decoding under the constraint: apply `constrain_logits` to the target's
rows AND the drafter's rows (same states, same masks) before the sampling processors, so p and q are
the masked, renormalised distributions; rejection sampling is then exact for the constrained model.
For a verify call over draft tokens x_0..x_{k-1} from committed state s, the row states are
`walk(s, draft)` = [s, s after x_0, ..., s after x_{k-1}]. A draft token the grammar refuses (an
unconstrained drafter) makes every later state DEAD_STATE; those rows are left unmasked, which is
harmless: the masked row before them gives the refused token probability 0, so it is rejected and
no later row is ever sampled from.

    grammar = SkeletonGrammar(tokenizer, max_points=6)
    state = grammar.initial_state()
    while not grammar.is_complete(state):
        logits = grammar.constrain_logits(model(...)[-1:], [state])
        token = sample(logits)
        state = grammar.advance(state, token)
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from specmesh.skeleton.automaton import (
    DEAD_STATE,
    DEFAULT_FORMAT,
    START_STATE,
    ByteAutomaton,
    SkeletonFormat,
    build_skeleton_automaton,
)
from specmesh.skeleton.tokens import token_bytes_table

__all__ = ["DEAD_STATE", "SkeletonGrammar"]

DEFAULT_MAX_CACHED_MASKS = 4096


class SkeletonGrammar:
    """Allowed-token masks for the skeleton format. States are ints; the object holds no per-request
    data, so one instance (per tokenizer and format) serves every session."""

    def __init__(self, tokenizer, *, max_points: int = 8, max_title_bytes: int = 60, max_est_digits: int = 3,
                 max_direct_bytes: int = 200, vocab_size: int | None = None,
                 eos_token_ids: Iterable[int] | None = None, max_cached_masks: int = DEFAULT_MAX_CACHED_MASKS):
        """`vocab_size`: the logits' width when the model pads its vocabulary (default len(tokenizer));
        `eos_token_ids`: default the tokenizer's EOS."""
        if eos_token_ids is None:
            eos_token_ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        fmt = SkeletonFormat(max_points, max_title_bytes, max_est_digits, max_direct_bytes)
        self._setup(token_bytes_table(tokenizer), list(eos_token_ids), fmt, vocab_size, max_cached_masks)

    @classmethod
    def from_token_bytes(cls, token_bytes: Sequence[bytes | None], eos_token_ids: Iterable[int],
                         fmt: SkeletonFormat = DEFAULT_FORMAT, vocab_size: int | None = None,
                         max_cached_masks: int = DEFAULT_MAX_CACHED_MASKS) -> SkeletonGrammar:
        """From a vocabulary given as bytes per id (None: a special token) — for tests and other tokenizers."""
        grammar = cls.__new__(cls)
        grammar._setup(list(token_bytes), list(eos_token_ids), fmt, vocab_size, max_cached_masks)
        return grammar

    def _setup(self, token_bytes: list[bytes | None], eos_token_ids: list[int], fmt: SkeletonFormat,
               vocab_size: int | None, max_cached_masks: int) -> None:
        self.vocab_size = len(token_bytes) if vocab_size is None else vocab_size
        if self.vocab_size < len(token_bytes):
            raise ValueError(f"vocab_size {self.vocab_size} is smaller than the tokenizer's {len(token_bytes)} tokens")
        if not eos_token_ids or any(not 0 <= t < self.vocab_size for t in eos_token_ids):
            raise ValueError(f"the grammar needs EOS ids inside the vocabulary to end on, got {eos_token_ids}")
        self.format = fmt
        self.eos_token_ids = frozenset(eos_token_ids)
        self._token_bytes = [None if i in self.eos_token_ids else b for i, b in enumerate(token_bytes)]
        single_bytes = [b[0] for b in self._token_bytes if b is not None and len(b) == 1]
        self.automaton: ByteAutomaton = build_skeleton_automaton(fmt, usable_bytes=single_bytes)
        self._flat_table = self.automaton.transitions.reshape(-1)
        ids = np.array([i for i, b in enumerate(self._token_bytes) if b], dtype=np.int64)
        lengths = np.array([len(self._token_bytes[i] or b"") for i in ids], dtype=np.int64)
        order = np.argsort(-lengths, kind="stable")
        self._sorted_ids = ids[order]  # [num_text_tokens], longest first
        sorted_lengths = lengths[order]
        everything = np.frombuffer(b"".join(self._token_bytes[i] or b"" for i in self._sorted_ids), dtype=np.uint8)
        starts = np.concatenate([[0], np.cumsum(sorted_lengths)[:-1]])
        # _columns[j]: byte j of every token longer than j bytes — a prefix of the sorted tokens
        self._columns = [everything[starts[:int((sorted_lengths > j).sum())] + j].astype(np.int32)
                         for j in range(int(sorted_lengths[0]))]
        self._masks: OrderedDict[int, np.ndarray] = OrderedDict()  # state -> packed mask [ceil(vocab / 8)] uint8
        self._max_cached_masks = max_cached_masks
        self._lock = threading.Lock()
        self._all_allowed = torch.ones(self.vocab_size, dtype=torch.bool)

    @property
    def max_tokens(self) -> int:
        """Upper bound on a constrained generation's length, EOS included: a max_new_tokens that
        always lets the skeleton finish."""
        return self.automaton.max_bytes + 1

    def initial_state(self) -> int:
        return START_STATE

    def is_complete(self, state: int) -> bool:
        return self.automaton.is_accepting(state)

    def is_dead(self, state: int) -> bool:
        return state == DEAD_STATE

    def advance(self, state: int, token_id: int) -> int:
        """The state after `token_id`; DEAD_STATE if the grammar refuses it."""
        self._check_state(state)
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary of {self.vocab_size}")
        if token_id in self.eos_token_ids:
            return state if self.is_complete(state) else DEAD_STATE
        data = self._token_bytes[token_id] if token_id < len(self._token_bytes) else None
        return DEAD_STATE if not data else self.automaton.walk(state, data)

    def walk(self, state: int, token_ids: Sequence[int]) -> list[int]:
        """[state, after token_ids[0], ..., after all]: len(token_ids) + 1 states (the row states of a
        verify call over a draft)."""
        states = [state]
        for token_id in token_ids:
            states.append(self.advance(states[-1], int(token_id)))
        return states

    def allowed_mask(self, state: int) -> torch.Tensor:
        """BoolTensor [vocab_size] on the CPU: True where the token is allowed. Masks are cached per
        state bit-packed (vocab_size / 8 bytes each), so every call returns a fresh tensor."""
        self._check_state(state)
        with self._lock:
            packed = self._masks.get(state)
            if packed is not None:
                self._masks.move_to_end(state)
        if packed is None:
            packed = np.packbits(self._compute_mask(state))
            with self._lock:
                self._masks[state] = packed
                if len(self._masks) > self._max_cached_masks:
                    self._masks.popitem(last=False)
        return torch.from_numpy(np.unpackbits(packed, count=self.vocab_size).view(bool))

    def row_masks(self, states: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
        """BoolTensor [len(states), vocab_size]: the mask per row; DEAD rows allow everything (see the
        module docstring: they follow a refused draft token and are never sampled from)."""
        rows = [self._all_allowed if s == DEAD_STATE else self.allowed_mask(s) for s in states]
        if not rows:
            return torch.ones((0, self.vocab_size), dtype=torch.bool, device=device)
        return torch.stack(rows).to(device)

    def constrain_logits(self, logits: torch.Tensor, states: Sequence[int]) -> torch.Tensor:
        """logits [n, vocab_size], one state per row -> new logits with refused tokens at -inf."""
        if logits.dim() != 2 or logits.shape[0] != len(states) or logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits must be [{len(states)}, {self.vocab_size}], got {tuple(logits.shape)}")
        return logits.masked_fill(~self.row_masks(states, logits.device), float("-inf"))

    def decode(self, token_ids: Iterable[int]) -> str:
        """The text of the tokens (special tokens and EOS skipped); strict UTF-8."""
        parts = [self._token_bytes[t] if t < len(self._token_bytes) else None for t in token_ids]
        return b"".join(p for p in parts if p).decode("utf-8")

    def _check_state(self, state: int) -> None:
        if not 0 <= state < self.automaton.num_states:
            raise ValueError(f"grammar state {state} does not exist (0..{self.automaton.num_states - 1})")

    def _compute_mask(self, state: int) -> np.ndarray:
        mask = np.zeros(self.vocab_size, dtype=bool)
        if state != DEAD_STATE:
            current = np.full(len(self._sorted_ids), state, dtype=np.int32)
            for column in self._columns:
                active = current[:len(column)]
                active[:] = self._flat_table[active * 256 + column]
                if not active.any():
                    break
            mask[self._sorted_ids[current != DEAD_STATE]] = True
            if self.is_complete(state):
                mask[list(self.eos_token_ids)] = True
        return mask
