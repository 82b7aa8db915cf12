"""Typed contracts between the verifier, the coordinator and the wire conversion code.

Words (`accepted`, `recovered`, `bonus`) are defined once, in the glossary of
`specmesh.decoding.rejection`; proto fields use the same words.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from specmesh.decoding.adaptive import ForwardCost
from specmesh.models.engine import NO_PARENT

__all__ = [
    "NO_PARENT",
    "PLACEHOLDER_TOKEN_ID",
    "FinalTokenKind",
    "VerifyOutcome",
    "BatchVerifyOutcome",
    "SparseProbs",
]

PLACEHOLDER_TOKEN_ID = -1  # padding in fixed-width token tensors; never a real token id


class FinalTokenKind(enum.Enum):
    """Where the one target token that ends every verification came from."""

    RECOVERED = "recovered"  # drawn from the residual after a rejection
    BONUS = "bonus"  # drawn from p after every draft on the path was accepted (or none was offered)


@dataclass
class VerifyOutcome:
    """The result of verifying one sequence's draft (chain or tree).

    The sequence grows by `token_ids` = accepted draft tokens followed by the final token.
    For a chain `accepted_nodes` is `[0, 1, ..., num_accepted - 1]`; for a tree it is the accepted
    root-to-node path (indices into the draft's nodes, parents before children).
    """

    accepted_nodes: list[int]  # [num_accepted] draft node indices, root to leaf
    accepted_token_ids: list[int]  # [num_accepted]
    final_token_id: int  # the recovered or bonus token
    final_kind: FinalTokenKind
    logits: torch.Tensor | None = None  # [num_accepted + 1, vocab] the target's logits that judged each emitted token (on request)
    cost: ForwardCost | None = None  # what the forward it rode in cost, where a batched service reports it

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes)

    @property
    def token_ids(self) -> list[int]:
        """[num_accepted + 1] what the sequence grows by."""
        return [*self.accepted_token_ids, self.final_token_id]

    @property
    def judging_rows(self) -> list[int]:
        """[num_accepted + 1] which row of the verify forward's logits (row 0 = after the pending
        token, row 1 + i = after draft node i) judged each emitted token.

        >>> VerifyOutcome([1, 3], [6, 8], 2, FinalTokenKind.BONUS).judging_rows
        [0, 2, 4]
        """
        return [0, *(node + 1 for node in self.accepted_nodes)]


@dataclass
class BatchVerifyOutcome:
    """Vectorised chain verification of B sequences that each offered k draft tokens."""

    num_accepted: torch.Tensor  # [B] int64 in 0..k
    final_token_ids: torch.Tensor  # [B] int64, recovered (num_accepted < k) or bonus (== k)

    def token_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """[B, k + 1] accepted drafts, then the final token, then PLACEHOLDER_TOKEN_ID padding."""
        batch_size, k = draft_ids.shape
        out = torch.full((batch_size, k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.long,
                         device=draft_ids.device)
        positions = torch.arange(k + 1, device=draft_ids.device)[None, :]  # [1, k + 1]
        keep = positions < self.num_accepted[:, None]  # [B, k + 1]
        out[:, :k] = torch.where(keep[:, :k], draft_ids.long(), out[:, :k])
        out.scatter_(1, self.num_accepted[:, None], self.final_token_ids[:, None])
        return out


@dataclass
class SparseProbs:
    """One distribution stored as its support only — exact, because every dropped entry is 0.

    Top-k / top-p / greedy distributions have small supports, so this is how q travels on the wire.
    `to_dense` restores the dense row bit-for-bit.
    """

    token_ids: torch.Tensor  # [m] int64, ascending, the tokens with probability > 0
    probs: torch.Tensor  # [m] the dense row's values at token_ids, unchanged

    @property
    def support_size(self) -> int:
        return int(self.token_ids.numel())
