"""Draft service: pb <-> specmesh types."""

from __future__ import annotations

from servicekit.convert import distributions_to_pb
from specmesh.decoding.proposal import DraftProposal
from specmesh.proto.v1 import draft_pb2


def propose_response(proposal: DraftProposal, request: draft_pb2.ProposeRequest, vocab_size: int,
                     draft_ms: float) -> draft_pb2.ProposeResponse:
    """q travels in the dtype the drafter stored it in: the values it sampled from."""
    response = draft_pb2.ProposeResponse(draft_token_ids=proposal.token_ids, draft_ms=draft_ms)
    if proposal.parents is not None:
        response.tree_parents.extend(proposal.parents)
    if proposal.acceptance is not None:
        response.first_token_acceptance = proposal.acceptance
    if request.return_distributions and proposal.q is not None and proposal.num_tokens:
        response.distributions.CopyFrom(
            distributions_to_pb(proposal.q, proposal.q.dtype, request.sparse_distributions, vocab_size))
    return response
