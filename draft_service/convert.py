"""Draft service: pb <-> specmesh types."""

from __future__ import annotations

import torch

from servicekit.convert import distributions_to_pb
from specmesh.drafters.base import DraftProposal
from specmesh.proto.v1 import draft_pb2


def propose_response(
    proposal: DraftProposal,
    raw_q: torch.Tensor | None,  # [k, vocab] in the wire dtype: the values the draft was sampled from
    request: draft_pb2.ProposeRequest,
    q_dtype: torch.dtype,
    vocab_size: int,
    draft_ms: float,
) -> draft_pb2.ProposeResponse:
    response = draft_pb2.ProposeResponse(draft_token_ids=proposal.token_ids, draft_ms=draft_ms)
    if proposal.parents is not None:
        response.tree_parents.extend(proposal.parents)
    if request.return_distributions and raw_q is not None and proposal.num_tokens:
        response.distributions.CopyFrom(distributions_to_pb(raw_q, q_dtype, request.sparse_distributions, vocab_size))
    return response
