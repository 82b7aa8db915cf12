"""Grammar-constrained Verify sessions: the Skeleton-of-Thought plan format on the target's rows.

`SkeletonGrammars` keeps one `SkeletonGrammar` per format for the whole service (compiled once from
the service's tokenizer, off the event loop; masks are cached inside the grammar and shared by every
session). A constrained session holds a `GrammarConstraint`: the grammar state after its committed
tokens, which `TargetVerifier.verify_many` asks for the row masks of each round and tells what the
round emitted (`specmesh.decoding.verifier.LogitsConstraint`).

Row states, worked example (committed state s, a chain draft [a, b]): rows [pending, a, b] get the
states walk(s, [a, b]) = [s, s·a, s·a·b]. A tree draft with parents [-1, 0, 0] and tokens [a, b, c]
gets [s, s·a, s·a·b, s·a·c]: each node's row continues from its parent's state. A token the grammar
refuses gives DEAD_STATE to its row and every row below it; those rows stay unmasked and are never
sampled from (the row above gives the refused token probability 0, so it is rejected there).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.types import NO_PARENT
from specmesh.skeleton.automaton import SkeletonFormat
from specmesh.skeleton.grammar import SkeletonGrammar


class GrammarConstraint:
    """One session's grammar state (a `LogitsConstraint`); used on the engine thread only."""

    def __init__(self, grammar: SkeletonGrammar, state: int):
        self.grammar = grammar
        self.state = state  # after every token the session emitted (the pending one included)

    def row_states(self, proposal: DraftProposal) -> list[int]:
        """[1 + k] the grammar state of each verify row (module docstring)."""
        states = [self.state]
        parents = proposal.tree_parents() if proposal.is_tree else range(-1, proposal.num_tokens - 1)
        for token_id, parent in zip(proposal.token_ids, parents):
            states.append(self.grammar.advance(states[0 if parent == NO_PARENT else parent + 1], int(token_id)))
        return states

    def constrain(self, rows: torch.Tensor, proposal: DraftProposal) -> torch.Tensor:
        return self.grammar.constrain_logits(rows, self.row_states(proposal))

    def commit(self, token_ids: Sequence[int]) -> None:
        self.state = self.grammar.walk(self.state, token_ids)[-1]


class SkeletonGrammars:
    """The service's compiled grammars, one per format, at most `max_cached` (least recently used
    dropped). `get` blocks while compiling (a fraction of a second for the default format on a 49k
    vocabulary): call it in a worker thread. Thread-safe; a format compiles once however many
    sessions ask for it at the same time."""

    def __init__(self, model_folder: str, vocab_size: int, eos_token_ids: Sequence[int], max_cached: int = 8):
        self.model_folder = model_folder
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_cached = max_cached
        self._tokenizer: Any = None  # transformers tokenizer, loaded at the first compile
        self._grammars: OrderedDict[SkeletonFormat, SkeletonGrammar] = OrderedDict()
        self._building: dict[SkeletonFormat, threading.Lock] = {}
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()

    def get(self, fmt: SkeletonFormat) -> SkeletonGrammar:
        with self._lock:
            grammar = self._grammars.get(fmt)
            if grammar is not None:
                self._grammars.move_to_end(fmt)
                return grammar
            building = self._building.setdefault(fmt, threading.Lock())
        with building:
            with self._lock:
                grammar = self._grammars.get(fmt)
            if grammar is None:
                grammar = self._compile(fmt)
                with self._lock:
                    self._grammars[fmt] = grammar
                    while len(self._grammars) > self.max_cached:
                        self._grammars.popitem(last=False)
            with self._lock:
                self._building.pop(fmt, None)
        return grammar

    def _compile(self, fmt: SkeletonFormat) -> SkeletonGrammar:
        if not self.eos_token_ids:
            raise ValueError("the model has no EOS token for a constrained session to end on")
        with self._tokenizer_lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.model_folder)
        return SkeletonGrammar(self._tokenizer, max_points=fmt.max_points, max_title_bytes=fmt.max_title_bytes,
                               max_est_digits=fmt.max_est_digits, max_direct_bytes=fmt.max_direct_bytes,
                               vocab_size=self.vocab_size, eos_token_ids=self.eos_token_ids)
