"""Stage service: pb <-> specmesh types."""

from __future__ import annotations

import torch

from servicekit.convert import distributions_to_pb
from specmesh.cascade.stage_model import StageOutput
from specmesh.proto.v1 import stage_pb2


def verify_and_extend_response(out: StageOutput, return_q: bool, vocab_size: int, stage_ms: float,
                               ms_per_token: float | None = None,
                               ahead_forward_ms: float | None = None) -> stage_pb2.VerifyAndExtendResponse:
    response = stage_pb2.VerifyAndExtendResponse(
        num_accepted_tokens=out.num_accepted, proposal_token_ids=out.proposal, stage_ms=stage_ms, ms_per_token=ms_per_token,
        ahead_forward_ms=ahead_forward_ms,
        features=[stage_pb2.TokenFeatures(entropy_nats=f.entropy_nats, top1_prob=f.top1_prob, token_logprob=f.token_logprob)
                  for f in out.features])
    if return_q and out.q is not None:
        response.distributions.CopyFrom(distributions_to_pb(out.q, torch.float32, False, vocab_size))
    return response
