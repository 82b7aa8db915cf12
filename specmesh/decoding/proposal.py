"""What every drafter offers the coordinator: open a session, propose drafts, close it.

A proposal is a chain (parents None) or a tree of draft tokens plus, for a sampling drafter, the
exact processed distributions q the tokens were drawn from — what `specmesh.decoding.rejection` /
`specmesh.decoding.tree` need for exact verification. A deterministic drafter (n-gram lookup)
returns q = None, meaning one-hot q at each drafted token, which keeps verification lossless.

`unverified=True` (lossy, opt-in: an adaptive cascade that stopped below the target) marks a chunk to
emit as it is, WITHOUT the target's verification: the driver commits it (`SpeculationState.
record_unverified`, `TargetVerifier.append_unverified`) and the target feeds it as context in its
next forward. A verifier refuses to verify such a proposal, so a driver that does not know the flag
fails loudly instead of quietly verifying a chunk whose stats say it was not.

q is kept in the dtype it was stored in. A drafter whose q travels rounded (float16 / bfloat16 on the
wire, see `specmesh.drafters.wire_q`) samples from `normalize_q(rounded)` and returns the rounded rows:
every process that verifies them computes the same float32 probabilities from the same values.

Session flow (the coordinator's loop):
    state = drafter.open(prompt_ids)
    proposal = drafter.propose(state, [first_token], k, params, generator)
    ... verify ...
    proposal = drafter.propose(state, outcome.token_ids, k, params, generator)  # accepted + final
    drafter.close(state)
`accepted_since_last` is every token the sequence grew by since the previous call (the accepted
drafts and the target's recovered/bonus token; after prefill, the target's first token). The drafter
forgets whatever it speculated beyond them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch

from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.tree import chain_parents, validate_parents
from specmesh.decoding.types import NO_PARENT

DrafterState = TypeVar("DrafterState")


def normalize_q(q: torch.Tensor) -> torch.Tensor:
    """Stored q [..., vocab] -> the float32 probabilities the draft tokens were drawn from, on the CPU.

    float32 passes through unchanged; rounded dtypes are renormalised deterministically (float64 sum
    on the CPU, then float32), so every process computes the same bits from the same values.

    >>> normalize_q(torch.tensor([[1.0, 3.0]], dtype=torch.float16)).tolist()
    [[0.25, 0.75]]
    """
    q = q.detach().cpu()
    if q.dtype == torch.float32:
        return q
    wide = q.double()
    return (wide / wide.sum(dim=-1, keepdim=True)).float()


@dataclass
class DraftProposal:
    """Draft tokens for one sequence; an empty proposal (k = 0) means "decode one token plainly"."""

    token_ids: list[int]  # [k]
    q: torch.Tensor | None = None  # [k, vocab] token_ids[i] was drawn from normalize_q(q)[i]; None = one-hot
    parents: list[int] | None = None  # [k] tree parents (NO_PARENT = off the last token); None = chain
    unverified: bool = False  # lossy: commit token_ids as output without verifying them (module docstring)
    # the drafter's own estimate that its first token is accepted (None: it has none); an adaptive k
    # policy withholds a draft whose first token is unlikely to pay for its verification (SpeculationState.gate)
    acceptance: float | None = field(default=None, repr=False, compare=False)
    # the drafter drafts the next round while this one is verified, each forward taking this long now (ms):
    # an adaptive k policy prices rounds by what that hides (`AdaptiveK.set_drafting_ahead`); None: it does not
    ahead_forward_ms: float | None = field(default=None, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    def probs_q(self) -> torch.Tensor | None:
        """[k, vocab] float32 (CPU) q as the verifier uses it, or None (one-hot)."""
        return None if self.q is None else normalize_q(self.q)

    def tree_parents(self) -> list[int]:
        """[k] parents, also for a chain ([NO_PARENT, 0, 1, ...])."""
        return list(self.parents) if self.parents is not None else chain_parents(self.num_tokens)

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError if the proposal is malformed (it may have come over the wire)."""
        if any(not 0 <= t < vocab_size for t in self.token_ids):
            raise ValueError(f"draft token ids must lie in [0, {vocab_size})")
        if self.q is not None:
            if tuple(self.q.shape) != (self.num_tokens, vocab_size):
                raise ValueError(f"q must be [k={self.num_tokens}, vocab={vocab_size}], got {tuple(self.q.shape)}")
            if self.num_tokens and bool((self.q[torch.arange(self.num_tokens), self.token_ids] <= 0).any()):
                raise ValueError("every draft token must have q > 0 under the distribution it was drawn from")
        if self.parents is not None:
            validate_parents(self.parents, self.num_tokens)

    def capped(self, max_depth: int) -> tuple[DraftProposal, list[int]]:
        """The proposal without the draft tokens deeper than `max_depth` (a chain: its first
        `max_depth` tokens), and the kept tokens' indices in this proposal (ascending).

        >>> DraftProposal([7, 8, 9], parents=[-1, 0, -1]).capped(1)
        (DraftProposal(token_ids=[7, 9], q=None, parents=[-1, -1], unverified=False), [0, 2])
        """
        if not self.is_tree:
            kept = list(range(min(self.num_tokens, max(0, max_depth))))
            return (self if len(kept) == self.num_tokens else
                    DraftProposal(self.token_ids[:len(kept)], None if self.q is None else self.q[:len(kept)])), kept
        depths: list[int] = []
        for parent in self.tree_parents():
            depths.append(1 if parent == NO_PARENT else depths[parent] + 1)
        kept = [i for i, depth in enumerate(depths) if depth <= max_depth]
        if len(kept) == self.num_tokens:
            return self, kept
        new_index = {old: new for new, old in enumerate(kept)}
        parents = [NO_PARENT if self.tree_parents()[i] == NO_PARENT else new_index[self.tree_parents()[i]] for i in kept]
        q = None if self.q is None else self.q[kept]
        return DraftProposal([self.token_ids[i] for i in kept], q, parents), kept

    @classmethod
    def make_dummy(cls, k: int, vocab_size: int, *, with_q: bool = False, tree: bool = False) -> DraftProposal:
        """A well-formed proposal for tests: tokens 0..k-1 (mod vocab), uniform q, a star tree."""
        token_ids = [i % vocab_size for i in range(k)]
        q = torch.full((k, vocab_size), 1.0 / vocab_size) if with_q else None
        parents = [-1] * k if tree else None
        return cls(token_ids=token_ids, q=q, parents=parents)


class Drafter(Protocol[DrafterState]):
    """Implemented by the n-gram drafters and the model drafter (`specmesh.drafters`)."""

    name: str  # "model", "prompt_lookup", ... (reported in stats and GetInfo)
    device: torch.device  # where the generators passed to `propose` must live

    def open(self, prompt_ids: Sequence[int]) -> DrafterState:
        """Start a session on the prompt; returns the drafter's per-session state."""
        ...

    def check_call(self, state: DrafterState, accepted_since_last: Sequence[int], max_tokens: int) -> None:
        """Raise ValueError if `propose` could not serve this call; changes nothing. A service checks
        every call before it joins a batch, so one bad call cannot fail the others' draft."""
        ...

    def propose(
        self,
        state: DrafterState,
        accepted_since_last: Sequence[int],
        max_tokens: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> DraftProposal:
        """Append accepted_since_last to the session, then propose up to max_tokens draft tokens
        (the whole tree counts), drawing any randomness from `generator` only."""
        ...

    def propose_many(
        self,
        states: Sequence[DrafterState],
        accepted: Sequence[Sequence[int]],
        max_tokens: Sequence[int],
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator],
    ) -> list[DraftProposal]:
        """`propose` for several sessions at once (a model drafter runs one forward per position)."""
        ...

    def close(self, state: DrafterState) -> None:
        """Release what the session holds (KV blocks, indexes)."""
        ...
