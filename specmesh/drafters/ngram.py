"""Model-free drafters that copy continuations from the text seen so far.

Both are deterministic: a proposal's q is None (one-hot at each drafted token), so rejection
sampling accepts draft token x with probability p(x) and the output still follows the target exactly.
Neither needs torch; the per-session indexes are plain dicts updated in O(new tokens).

- `PromptLookupIndex` / `PromptLookupDrafter` (prompt lookup decoding): find the longest suffix
  n-gram (max_n down to min_n) that occurred earlier in prompt + generated text, and propose what
  followed its most recent earlier occurrence.
- `NgramStore` / `NgramStoreDrafter` (multi-level n-gram store): count, for every context of
  min_n..max_n tokens, which token followed it; propose the most frequent continuation of the
  highest-order context that has been seen, and optionally a tree of the best few alternatives.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

import torch

from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.types import NO_PARENT

# Beta prior (hits, misses) of a match order's acceptance before its matches have been scored: a mean
# of 1/6, which the draft gate (`AdaptiveK.pays`: acceptance above beta, what a verified draft token adds
# to a step) sets between the default model's two targets on a CPU: the fp32 target's beta reads 0.08-0.15
# (its fit moves with the machine's noise), so its drafts are verified from the start; the Q4_1 target's
# reads 0.21-0.26, so drafts wait until their order has been right. A prior mean of 0.11 (1, 8), as
# before, sat inside the fp32 target's range: whether a request's first drafts were verified turned on
# the fit's noise, and on the demo's passage prompt the Verify service (its fit at beta 0.148) withheld
# three drafts that in-process (0.100-0.106) verified and were all accepted: 7 rounds against 4, the
# cluster 1.18-1.23x the in-process time. Scored over the default model's greedy outputs (Q4_1 target,
# bench/lowbit.py's prompts, 64 tokens): on chat prompts one-token matches were right 10 times in 78,
# two-token ones 1 in 10; on input-grounded prompts four-token matches 153 times in 159. An A/B on the
# held-out prompts and the demo's two (3 runs, 64 tokens, in-process, both priors in one run): fp32 n-gram
# vs plain median 1.055x / lowest 0.985x with (1, 8), 1.066x / 0.990x with (1.5, 7.5); Q4_1 1.033x / 0.983x
# against 1.027x / 0.988x.
ACCEPTANCE_PRIOR = (1.5, 7.5)


def _check_orders(min_n: int, max_n: int) -> None:
    if not 1 <= min_n <= max_n:
        raise ValueError(f"n-gram orders need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")


class PromptLookupIndex:
    """Latest continuation start of every n-gram (min_n <= n <= max_n) in a growing token list.

    Appending token t at position i records, for each n, that the n-gram ending just before i
    continues at i. The current suffix therefore never matches itself: it has no continuation yet.

    Worked example: the suffix [5, 6] occurred at positions 0-1 and continued with 7, 8, 5.
    >>> index = PromptLookupIndex(min_n=1, max_n=3)
    >>> index.extend([5, 6, 7, 8, 5, 6])
    >>> index.propose(max_tokens=3)
    [7, 8, 5]

    A match close to the end keeps copying its own draft, so a repeating pattern extends itself:
    >>> index = PromptLookupIndex(min_n=2, max_n=2)
    >>> index.extend([1, 2, 1, 2])
    >>> index.propose(max_tokens=5)   # [1, 2] continued at position 2: 1, 2, then the draft's own 1, 2, 1
    [1, 2, 1, 2, 1]
    >>> index.extend([9])
    >>> index.propose(max_tokens=5)   # no earlier [2, 9] (n = 2 only): nothing to propose
    []
    """

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        _check_orders(min_n, max_n)
        self.min_n = min_n
        self.max_n = max_n
        self.token_ids: list[int] = []
        self._continuation_start: dict[tuple[int, ...], int] = {}  # n-gram -> index after its latest occurrence
        # per match order n: (first tokens it predicted right, predictions) over the scored tokens
        self._scores: dict[int, tuple[int, int]] = {}

    def extend(self, token_ids: Sequence[int], score: bool = False) -> None:
        """Append tokens; O(len(token_ids) * (max_n - min_n + 1)) work. With `score`, each token is
        first checked against what the index would have proposed right before it (free: nothing is
        verified), which is how `acceptance` learns how often a match of each order is right."""
        for token in token_ids:
            token = int(token)
            position = len(self.token_ids)
            if score:
                order, start = self._match()
                if order:
                    hits, predictions = self._scores.get(order, (0, 0))
                    self._scores[order] = (hits + (self.token_ids[start] == token), predictions + 1)
            for n in range(self.min_n, min(self.max_n, position) + 1):
                self._continuation_start[tuple(self.token_ids[position - n:position])] = position
            self.token_ids.append(token)

    def _match(self) -> tuple[int, int]:
        """(order, continuation start) of the longest earlier match of the current suffix; (0, -1) if none."""
        length = len(self.token_ids)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            start = self._continuation_start.get(tuple(self.token_ids[length - n:]))
            if start is not None:
                return n, start
        return 0, -1

    def propose(self, max_tokens: int) -> list[int]:
        """Up to max_tokens tokens following the longest earlier match of the current suffix."""
        order, start = self._match()
        if not order:
            return []
        length = len(self.token_ids)
        draft: list[int] = []
        for offset in range(max_tokens):
            source = start + offset  # < length + offset, so already known
            draft.append(self.token_ids[source] if source < length else draft[source - length])
        return draft

    def acceptance(self) -> float | None:
        """Estimated probability that the current match's next token is right: the scored record of
        matches of its order, under a prior of ACCEPTANCE_PRIOR (hits, misses) that expects little
        of a match until its order has proved itself. None when nothing matches."""
        order, _ = self._match()
        if not order:
            return None
        hits, predictions = self._scores.get(order, (0, 0))
        prior_hits, prior_misses = ACCEPTANCE_PRIOR
        return (hits + prior_hits) / (predictions + prior_hits + prior_misses)


class NgramStore:
    """Counts of next tokens after every context of min_n..max_n tokens, updated online.

    Candidates for a context come from its highest-order suffix that has been seen (backoff),
    ordered by count, then by recency.

    Worked example: after [1, 2] came 3 twice and 4 once.
    >>> store = NgramStore(min_n=1, max_n=2)
    >>> store.extend([1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2])
    >>> store.continuations([1, 2])
    [(3, 2), (4, 1)]
    >>> store.propose_tree(max_tokens=3, max_branching=1)   # (1,2)->3, (2,3)->1, (3,1)->2
    ([3, 1, 2], [-1, 0, 1])
    >>> store.continuations([7, 2])   # (7, 2) unseen: back off to (2,)
    [(3, 2), (4, 1)]

    A tree: after [1, 2] came 3 once and 4 once (4 more recently), so both branches are kept.
    >>> store = NgramStore(min_n=1, max_n=2)
    >>> store.extend([1, 2, 3, 1, 2, 4, 1, 2])
    >>> store.propose_tree(max_tokens=4, max_branching=2)   # root -> 4 -> 1,  root -> 3 -> 1
    ([4, 3, 1, 1], [-1, -1, 0, 1])
    """

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        _check_orders(min_n, max_n)
        self.min_n = min_n
        self.max_n = max_n
        self.token_ids: list[int] = []
        # context -> next token -> (count, position of the latest occurrence)
        self._next: dict[tuple[int, ...], dict[int, tuple[int, int]]] = {}

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append tokens and count them after each of their contexts; O(new tokens * orders)."""
        for token in token_ids:
            token = int(token)
            position = len(self.token_ids)
            for n in range(self.min_n, min(self.max_n, position) + 1):
                followers = self._next.setdefault(tuple(self.token_ids[position - n:position]), {})
                count, _ = followers.get(token, (0, 0))
                followers[token] = (count + 1, position)
            self.token_ids.append(token)

    def continuations(self, context: Sequence[int]) -> list[tuple[int, int]]:
        """(token, count) pairs seen after the longest known suffix of `context`, best first."""
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            followers = self._next.get(tuple(context[len(context) - n:]))
            if followers:
                ranked = sorted(followers.items(), key=lambda item: (-item[1][0], -item[1][1]))
                return [(token, count) for token, (count, _) in ranked]
        return []

    def propose_tree(self, max_tokens: int, max_branching: int = 1) -> tuple[list[int], list[int]]:
        """Best-first tree of at most max_tokens nodes, each node with at most max_branching children.

        A node's score is the product of relative counts along its path; the highest-scoring
        frontier node is added next (ties: first pushed). Returns (token_ids [N], parents [N]) with
        parents before children. With max_branching = 1 it is the greedy most-frequent chain.
        """
        token_ids: list[int] = []
        parents: list[int] = []
        frontier: list[tuple[float, int, int, int, list[int]]] = []  # (-score, order, parent, token, path)
        order = itertools.count()
        history = self.token_ids[-self.max_n:]

        def push_children(parent: int, path: list[int], score: float) -> None:
            candidates = self.continuations((history + path)[-self.max_n:])
            total = sum(count for _, count in candidates)
            for token, count in candidates[:max_branching]:
                heapq.heappush(frontier, (-score * count / total, next(order), parent, token, path))

        push_children(NO_PARENT, [], 1.0)
        while frontier and len(token_ids) < max_tokens:
            neg_score, _, parent, token, path = heapq.heappop(frontier)
            node = len(token_ids)
            token_ids.append(token)
            parents.append(parent)
            push_children(node, [*path, token], -neg_score)
        return token_ids, parents


class PromptLookupDrafter:
    """Drafter over a `PromptLookupIndex` per session (chain proposals, q = None)."""

    name = "prompt_lookup"
    device = torch.device("cpu")  # needs no generator; sampling drafts are deterministic
    uses_engine = False  # table lookups: a service may run it on its event loop, no engine-thread hop

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        _check_orders(min_n, max_n)
        self.min_n = min_n
        self.max_n = max_n

    def open(self, prompt_ids: Sequence[int]) -> PromptLookupIndex:
        index = PromptLookupIndex(self.min_n, self.max_n)
        index.extend(prompt_ids)
        return index

    def propose(
        self,
        state: PromptLookupIndex,
        accepted_since_last: Sequence[int],
        max_tokens: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> DraftProposal:
        """The draft ignores params and generator: it is deterministic, hence lossless under sampling.
        It carries the index's estimate of its first token's acceptance (`SpeculationState.gate`)."""
        state.extend(accepted_since_last, score=True)
        draft = state.propose(max_tokens)
        return DraftProposal(token_ids=draft, acceptance=state.acceptance() if draft else None)

    def propose_many(self, states, accepted, max_tokens, params, generators) -> list[DraftProposal]:
        return [self.propose(*call) for call in zip(states, accepted, max_tokens, params, generators)]

    def check_call(self, state, accepted_since_last: Sequence[int], max_tokens: int) -> None:
        """Every call is servable: the index takes any tokens, and a miss proposes nothing."""

    def close(self, state: PromptLookupIndex) -> None:
        """Nothing to release: the index is plain Python and dies with the state."""


class NgramStoreDrafter:
    """Drafter over an `NgramStore` per session; a tree when max_branching > 1 (q = None)."""

    name = "ngram_store"
    device = torch.device("cpu")
    uses_engine = False

    def __init__(self, min_n: int = 1, max_n: int = 4, max_branching: int = 1) -> None:
        _check_orders(min_n, max_n)
        if max_branching < 1:
            raise ValueError(f"max_branching must be >= 1, got {max_branching}")
        self.min_n = min_n
        self.max_n = max_n
        self.max_branching = max_branching

    def open(self, prompt_ids: Sequence[int]) -> NgramStore:
        store = NgramStore(self.min_n, self.max_n)
        store.extend(prompt_ids)
        return store

    def propose(
        self,
        state: NgramStore,
        accepted_since_last: Sequence[int],
        max_tokens: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> DraftProposal:
        state.extend(accepted_since_last)
        token_ids, parents = state.propose_tree(max_tokens, self.max_branching)
        return DraftProposal(token_ids=token_ids, parents=parents if self.max_branching > 1 else None)

    def propose_many(self, states, accepted, max_tokens, params, generators) -> list[DraftProposal]:
        return [self.propose(*call) for call in zip(states, accepted, max_tokens, params, generators)]

    def check_call(self, state, accepted_since_last: Sequence[int], max_tokens: int) -> None:
        """Every call is servable: the index takes any tokens, and a miss proposes nothing."""

    def close(self, state: NgramStore) -> None:
        """Nothing to release: the store is plain Python and dies with the state."""
