"""Skeleton-of-Thought in the Coordinator: the library's sequence over the Verify (and Draft) services.

The sequence (plan -> parse -> plan check -> schedule -> fork -> branches -> merge) is
`specmesh.skeleton.answer`, an event producer; its sessions come from `coordinator.skeleton_links`
(the constrained plan session, the Forks, failover, sibling batching). This module is the edge:
the servicer's `SkeletonRequest` in, `GenerateResponse`s out, one per event:

    PlanText     -> branch 0 (the plan as it is written; its last message has the plan's stats)
    BranchText   -> branch i (first message: the point's header line; last: finish reason and stats)
    BranchEnd    -> only for a failed branch: a branch-i message with error_message (FINISH_REASON_ERROR)
    AnswerText   -> branch -1 (a direct answer)
    Merged       -> the last -1 message: the merged answer, the stats of every round, `SkeletonStats`

Layouts (`SkeletonRequest.layout`, common.proto BranchLayout), the same text either way:
    batching:      each branch is a sequence of its own; sibling rounds are rows of one forward.
    one_sequence:  the Fork asks the Verify service to lay the branches side by side after the
                   plan's prefix in ONE sequence (specmesh/models/engine.py: layouts): each round
                   of the siblings is one attention row over [prefix | region 1 | region 2 | ...]
                   with a block mask, and a rejected draft rolls back inside its branch's region.
A branch's dependencies reach it as text in its point prompt in both layouts (`point_request`), so
a region sees the prefix and itself; each branch then equals target-only decoding of its own full
prompt, whichever the layout.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from coordinator.skeleton_links import Links, describe_error
from servicekit.convert import FINISH_TO_PB, stats_to_pb
from servicekit.engine_thread import run_aside
from specmesh.decoding.stats import SpecStats
from specmesh.proto.v1 import common_pb2, coordinator_pb2
from specmesh.skeleton import answer
from specmesh.skeleton.events import BranchEnd, Merged, SkeletonEvent, SkeletonSummary, TextDelta

__all__ = ["Links", "SkeletonAnswer", "SkeletonRequest"]


@dataclass
class SkeletonRequest(answer.SkeletonRequest):
    """What one skeleton-mode request asks for, and how the Coordinator runs it."""

    route_reason: str = "requested"  # why SoT runs (`coordinator.mode_choice`), reported in SkeletonStats
    layout: int = common_pb2.BRANCH_LAYOUT_BATCHING  # how the Verify service lays out the branches (BranchLayout)


class SkeletonAnswer:
    """One skeleton-mode request: `responses()` is its GenerateResponse stream (module docstring).
    `final_stats(stats)` turns the request's summed stats into the last message's stats."""

    def __init__(self, request: SkeletonRequest, tokenizer, links: Links,
                 final_stats: Callable[[SpecStats], common_pb2.SpeculationStats]):
        self.request = request
        self.links = links
        links.layout = request.layout  # the Forks ask for the request's layout
        self.final_stats = final_stats
        self.answer = answer.SkeletonAnswer(request, tokenizer, links, offload=run_aside, describe=describe_error)

    async def responses(self) -> AsyncGenerator[coordinator_pb2.GenerateResponse, None]:
        events = self.answer.events()
        try:
            async for event in events:
                response = self._response(event)
                if response is not None:
                    yield response
        finally:
            await events.aclose()

    def _response(self, event: SkeletonEvent) -> coordinator_pb2.GenerateResponse | None:
        if isinstance(event, TextDelta):
            response = coordinator_pb2.GenerateResponse(text=event.text, token_ids=event.token_ids, branch_id=event.branch_id)
            if event.finish_reason is not None:
                assert event.stats is not None
                response.finish_reason = FINISH_TO_PB[event.finish_reason]
                response.stats.CopyFrom(stats_to_pb(event.stats))
            return response
        if isinstance(event, BranchEnd):
            if not event.error:
                return None  # its last BranchText said it all
            return coordinator_pb2.GenerateResponse(branch_id=event.point_id, error_message=event.error,
                                                    finish_reason=common_pb2.FINISH_REASON_ERROR)
        assert isinstance(event, Merged)
        return coordinator_pb2.GenerateResponse(text=event.text, token_ids=event.token_ids, branch_id=answer.MAIN_BRANCH,
                                                finish_reason=FINISH_TO_PB[event.finish_reason],
                                                stats=self.final_stats(event.stats), skeleton=self._summary(event.summary))

    def _summary(self, summary: SkeletonSummary) -> coordinator_pb2.SkeletonStats:
        siblings = self.links.siblings
        return coordinator_pb2.SkeletonStats(
            route_reason=self.request.route_reason, direct_reason=summary.direct_reason, skeleton_ms=summary.skeleton_ms,
            num_skeleton_tokens=summary.num_skeleton_tokens, branches_ms=summary.branches_ms, total_ms=summary.total_ms,
            max_parallel=summary.max_parallel, parallel_speedup_estimate=summary.parallel_speedup_estimate,
            num_prefilled_branches=summary.num_prefilled_branches, layout=self.request.layout,
            num_verify_batches=siblings.num_verify_batches, num_batched_rounds=siblings.num_batched_rounds,
            num_fork_rpcs=siblings.num_fork_rpcs,
            branches=[coordinator_pb2.BranchStats(
                point_id=b.point_id, title=b.title, est_tokens=b.est_tokens, num_tokens=b.num_tokens,
                num_rounds=b.num_rounds, start_ms=b.start_ms, wall_ms=b.wall_ms, error_message=b.error,
                finish_reason=FINISH_TO_PB[b.finish_reason] if b.finish_reason else
                (common_pb2.FINISH_REASON_ERROR if b.error else common_pb2.FINISH_REASON_UNSPECIFIED))
                for b in summary.branches])
