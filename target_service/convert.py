"""Verify service: pb <-> specmesh types."""

from __future__ import annotations

from servicekit.convert import FINISH_TO_PB, distributions_from_pb, token_ids_from_pb
from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.state import FinishReason
from specmesh.decoding.types import VerifyOutcome
from specmesh.proto.v1 import verify_pb2
from specmesh.skeleton.automaton import DEFAULT_FORMAT, SkeletonFormat
from target_service.batcher import VerifyResult


def proposal_from_pb(request: verify_pb2.VerifyRequest, vocab_size: int) -> DraftProposal:
    """The draft of a VerifyRequest, validated (ids, q shape and support, tree parents)."""
    token_ids = token_ids_from_pb(request.draft_token_ids, vocab_size, "draft_token_ids")
    q = distributions_from_pb(request.distributions, len(token_ids), vocab_size) if request.HasField("distributions") else None
    parents = list(request.tree_parents) or None
    proposal = DraftProposal(token_ids=token_ids, q=q, parents=parents)
    proposal.validate(vocab_size)
    return proposal


def verify_response(session_id: str, outcome: VerifyOutcome, is_tree: bool, result: VerifyResult,
                    finish: FinishReason | None) -> verify_pb2.VerifyResponse:
    response = verify_pb2.VerifyResponse(
        session_id=session_id, num_accepted_tokens=outcome.num_accepted, accepted_token_ids=outcome.token_ids,
        accepted_tree_nodes=outcome.accepted_nodes if is_tree else [], batch_size=result.batch_size,
        verify_ms=result.verify_ms, batch_tokens=result.batch_tokens, finish_reason=FINISH_TO_PB[finish],
    )
    if result.cost is not None:
        response.forward_fixed_ms = result.cost.fixed_ms
        response.forward_ms_per_token = result.cost.ms_per_token
    return response


def skeleton_format_from_pb(pb: verify_pb2.SkeletonConstraint, max_points: int, max_title_bytes: int,
                            max_direct_bytes: int) -> SkeletonFormat:
    """The plan format a constraint asks for (0 = the default bound), within what this service compiles."""
    fmt = SkeletonFormat(max_points=pb.max_points or DEFAULT_FORMAT.max_points,
                         max_title_bytes=pb.max_title_bytes or DEFAULT_FORMAT.max_title_bytes,
                         max_est_digits=pb.max_est_digits or DEFAULT_FORMAT.max_est_digits,
                         max_direct_bytes=pb.max_direct_bytes or DEFAULT_FORMAT.max_direct_bytes)
    fmt.validate()
    for name, value, limit in (("max_points", fmt.max_points, max_points), ("max_title_bytes", fmt.max_title_bytes, max_title_bytes),
                               ("max_direct_bytes", fmt.max_direct_bytes, max_direct_bytes)):
        if value > limit:
            raise ValueError(f"skeleton {name} {value} exceeds this service's limit of {limit}")
    return fmt
