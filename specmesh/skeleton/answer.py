"""Skeleton-of-Thought, the whole sequence: plan, parse, check, schedule, fork, branches, merge.

    answer = SkeletonAnswer(request, tokenizer, links)       # links: `sessions.SkeletonLinks`
    async for event in answer.events():                       # `events.py`
        ...

One request, as data (each stream is the one speculation state, `speculative_stream_async`, with
the links' drafter):
    plan:     the skeleton conversation [+ forced prefix], decoded on a `KeptSession` over
              `links.plan_verifier`: the plan grammar masks every target row, so the plan is exact
              for the constrained model and ends on EOS within the grammar's token bound. Streamed
              as `PlanText`. The session stays open: branches fork from it.
    parse:    Direct (the model chose [DIRECT], an unusable plan, or a plan `plan_problem` rejects)
              -> the request's own prompt, decoded plainly, streamed as `AnswerText`, then
              `Merged`; done.
    schedule: `BranchScheduler` (longest first, max_parallel, dependencies, continuous admission).
    branch i: its prompt is the point conversation (`point_messages`, with its dependencies' texts
              and, for a <Search> point, passages from the documents), which starts with the plan
              session's tokens: a `BranchSession` forks the plan's session at the tokens they share,
              so the prompt is never prefilled again, and waits at a `RoundGate` each round so the
              siblings' rounds meet in one forward. Each branch is an asyncio task, sampled with
              `branch_seed(seed, i)`, cut at `branch_token_budget` tokens; streamed as `BranchText`
              (first: the point's header line), then `BranchEnd`. Once every point has started and
              opened, the plan's session is released (it only held KV).
    merge:    `Merged`: the points in plan order, the stats of every round, `SkeletonSummary`.

A branch that fails ends with `BranchEnd(error=...)`; its dependents still start (without its text)
and the merge keeps its title. An error in the plan or a direct answer ends the stream (raised).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from specmesh.decoding.async_driver import AsyncVerifier, speculative_stream_async
from specmesh.decoding.sampling import MAX_SEED, SamplingParams
from specmesh.decoding.state import FinishReason
from specmesh.decoding.stats import SpecStats
from specmesh.models.chat import chat_messages_ids
from specmesh.skeleton.automaton import SkeletonFormat, build_skeleton_automaton
from specmesh.skeleton.events import (
    MAIN_BRANCH,
    SKELETON_BRANCH,
    AnswerText,
    BranchEnd,
    BranchSummary,
    BranchText,
    Merged,
    PlanText,
    SkeletonEvent,
    SkeletonSummary,
)
from specmesh.skeleton.merge import merge, section_header
from specmesh.skeleton.parse import parse_skeleton
from specmesh.skeleton.prompts import common_prefix_length, point_messages, skeleton_messages
from specmesh.skeleton.quality import branch_token_budget, plan_problem
from specmesh.skeleton.rounds import RoundGate
from specmesh.skeleton.schedule import BranchScheduler, Launch
from specmesh.skeleton.sessions import BranchSession, KeptSession, SkeletonLinks
from specmesh.skeleton.tools import PassageIndex, passages_for
from specmesh.skeleton.types import Direct, Skeleton

FINISH_PRIORITY = (FinishReason.CONTEXT, FinishReason.LENGTH, FinishReason.STOP, FinishReason.EOS)
ROUND_GATE_MAX_WAIT_S = 1.0  # the longest a round waits for its siblings (a stall; forks and forwards take less)
Offload = Callable[..., Awaitable[Any]]  # offload(fn, *args): run blocking fn off the event loop


@functools.lru_cache(maxsize=16)
def max_skeleton_tokens(fmt: SkeletonFormat) -> int:
    """The grammar's bound on a plan's tokens, EOS included (every allowed token adds a byte)."""
    return build_skeleton_automaton(fmt).max_bytes + 1


def branch_seed(seed: int, branch_id: int) -> int:
    """Branch i samples from seed + i: streams of one request that do not repeat each other.

    >>> branch_seed(7, 2), branch_seed(MAX_SEED, 1)
    (9, 0)
    """
    return (seed + branch_id) % (MAX_SEED + 1)


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@dataclass
class SkeletonRequest:
    """What one skeleton-mode request asks for (made once, at the edge)."""

    question: str
    prompt_ids: list[int]  # the request's own prompt: a direct answer decodes it
    params: SamplingParams  # seed resolved; max_new_tokens bounds each branch
    fmt: SkeletonFormat
    max_parallel: int
    prefix: str = ""  # forced start of the plan
    documents: list[str] = field(default_factory=list)  # <Search> points read passages from them


@dataclass
class _Branch:
    start_ms: float
    end: BranchEnd | None = None
    end_ms: float = 0.0


class SkeletonAnswer:
    """One request's events (module docstring). `offload` runs blocking work (the grammar's bound,
    the passage index) off the event loop; `describe` turns a branch's exception into its error text."""

    def __init__(self, request: SkeletonRequest, tokenizer, links: SkeletonLinks, *,
                 offload: Offload = asyncio.to_thread, describe: Callable[[BaseException], str] = describe_error):
        self.request = request
        self.tokenizer = tokenizer
        self.links = links
        self.offload = offload
        self.describe = describe
        self.start_s = time.perf_counter()
        self.stats = SpecStats(seed=request.params.seed or 0)  # every round of the request
        self.summary = SkeletonSummary(max_parallel=request.max_parallel)
        self.branches: dict[int, _Branch] = {}

    def _ms(self) -> float:
        return (time.perf_counter() - self.start_s) * 1e3

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def _stream(self, verifier: AsyncVerifier, prompt_ids: Sequence[int], params: SamplingParams):
        return speculative_stream_async(verifier, self.links.drafter(), prompt_ids, params,
                                        k_policy=self.links.k_policy(), decode=self._decode)

    async def events(self) -> AsyncIterator[SkeletonEvent]:
        request = self.request
        prefix_ids = list(self.tokenizer.encode(request.prefix, add_special_tokens=False)) if request.prefix else []
        prompt = chat_messages_ids(self.tokenizer, skeleton_messages(request.question, request.fmt)) + prefix_ids
        plan = KeptSession(self.links.plan_verifier(request.fmt, len(prefix_ids)))
        try:
            plan_ids: list[int] = []
            async for plan_text in self._plan(plan, prompt, prefix_ids, plan_ids):
                yield plan_text
            skeleton_text = self.tokenizer.decode([*prefix_ids, *plan_ids], skip_special_tokens=True,
                                                  clean_up_tokenization_spaces=False)
            parsed = parse_skeleton(skeleton_text, max_points=request.fmt.max_points)
            problem = plan_problem(parsed, request.question) if isinstance(parsed, Skeleton) else None
            if problem:  # a plan that would lose to a plain answer: answer plainly, and say why
                parsed = Direct(skeleton_text, f"plan rejected, {problem}")
            self.summary.skeleton_ms = self._ms()
            self.summary.num_skeleton_tokens = len(plan_ids)
            if isinstance(parsed, Direct):
                await plan.release()
                self.summary.direct_reason = parsed.reason
                async for answer_event in self._direct():
                    yield answer_event
                return
            async for branch_event in self._branches(parsed, skeleton_text, plan):
                yield branch_event
        finally:
            await plan.release()

    async def _plan(self, plan: KeptSession, prompt: list[int], prefix_ids: list[int],
                    plan_ids: list[int]) -> AsyncIterator[PlanText]:
        """Decode the plan after `prompt` (the skeleton conversation and the forced prefix); fills
        `plan_ids` with the tokens the model wrote."""
        request = self.request
        max_tokens = await self.offload(max_skeleton_tokens, request.fmt)
        params = dataclasses.replace(request.params, max_new_tokens=max_tokens, ignore_eos=False, stop=[],
                                     seed=branch_seed(request.params.seed or 0, SKELETON_BRANCH))
        if prefix_ids:
            yield PlanText(SKELETON_BRANCH, request.prefix, prefix_ids)
        stream = self._stream(plan, prompt, params)
        try:
            async for event in stream:
                plan_ids.extend(event.token_ids)
                if event.finish_reason is not None:
                    assert event.stats is not None
                    self.stats.merge(event.stats)
                yield PlanText(SKELETON_BRANCH, event.text, list(event.token_ids), event.finish_reason, event.stats)
        finally:
            await stream.aclose()

    async def _direct(self) -> AsyncIterator[AnswerText | Merged]:
        """No plan: the request's own prompt, decoded as in the plain modes."""
        stream = self._stream(self.links.verifier(), self.request.prompt_ids, self.request.params)
        try:
            async for event in stream:
                if event.finish_reason is None:
                    yield AnswerText(MAIN_BRANCH, event.text, list(event.token_ids))
                    continue
                assert event.stats is not None
                self.stats.merge(event.stats)
                self.stats.wall_ms = self.summary.total_ms = self._ms()
                yield Merged(event.text, event.finish_reason, self.stats, self.summary, list(event.token_ids))
        finally:
            await stream.aclose()

    async def _branches(self, skeleton: Skeleton, skeleton_text: str, plan: KeptSession) -> AsyncIterator[SkeletonEvent]:
        """Run the plan's branches as tasks (scheduler admission), relaying their events; then the merge."""
        request = self.request
        index = await self.offload(PassageIndex, request.documents) if request.documents else None
        scheduler = BranchScheduler(skeleton.points, request.max_parallel)
        queue: asyncio.Queue[BranchText | BranchEnd] = asyncio.Queue()
        tasks: set[asyncio.Task] = set()
        gate = RoundGate(ROUND_GATE_MAX_WAIT_S)
        sessions: list[BranchSession] = []

        def start(launches: list[Launch]) -> None:
            for launch in launches:
                passages = [p.text for p in passages_for(launch.point, request.question, index)]
                messages = point_messages(request.question, skeleton_text, launch.point, launch.dependencies, passages,
                                          request.fmt)
                # token ids compared, not texts: the model may have spelled the plan in other tokens than
                # the chat template's tokenization of its text, and the session may hold tokens past its EOS
                ids = chat_messages_ids(self.tokenizer, messages)
                num_shared = common_prefix_length(plan.session_ids, ids)
                sessions.append(BranchSession(self.links.branch_verifier(), plan.kept, num_shared, gate, launch.point.id))
                task = asyncio.get_running_loop().create_task(self._branch(launch, ids, sessions[-1], queue))
                tasks.add(task)
                task.add_done_callback(tasks.discard)

        first_start_ms = self._ms()
        try:  # the plan's session stays open while a point may still fork from it
            start(scheduler.admit())
            while not scheduler.done:
                item = await queue.get()
                if plan.kept is not None and not scheduler.waiting and all(s.opened for s in sessions):
                    await plan.release()
                if isinstance(item, BranchEnd):
                    branch = self.branches[item.point_id]
                    branch.end, branch.end_ms = item, self._ms()
                    start(scheduler.fail(item.point_id, item.error) if item.error
                          else scheduler.finish(item.point_id, item.text))
                yield item
        finally:
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        self.summary.branches_ms = self._ms() - first_start_ms
        yield self._merged(skeleton)

    async def _branch(self, launch: Launch, prompt_ids: list[int], session: BranchSession,
                      queue: asyncio.Queue[BranchText | BranchEnd]) -> None:
        """One branch, start to end; its events and its end go to `queue` (never raises)."""
        point = launch.point
        self.branches[point.id] = _Branch(self._ms())
        params = dataclasses.replace(self.request.params, seed=branch_seed(self.request.params.seed or 0, point.id),
                                     max_new_tokens=branch_token_budget(point, self.request.params.max_new_tokens))
        await queue.put(BranchText(point.id, section_header(point) + "\n"))
        texts: list[str] = []
        end = BranchEnd(point.id)
        stream = self._stream(session, prompt_ids, params)
        try:
            async for event in stream:
                texts.append(event.text)
                if event.finish_reason is not None:
                    session.leave()  # no more rounds: the siblings stop waiting for this branch
                    end = BranchEnd(point.id, stats=event.stats, finish_reason=event.finish_reason)
                await queue.put(BranchText(point.id, event.text, list(event.token_ids), event.finish_reason, event.stats))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported in-band; the other branches go on
            end = dataclasses.replace(end, error=self.describe(exc))  # stats kept if it failed after finishing
        finally:
            session.leave()
            await stream.aclose()
            if session.prefilled:
                self.summary.num_prefilled_branches += 1
        await queue.put(end if end.error else dataclasses.replace(end, text="".join(texts)))

    def _merged(self, skeleton: Skeleton) -> Merged:
        """The last event: the whole answer, the summed stats, the summary."""
        finishes: list[FinishReason] = []
        sum_branch_ms = 0.0
        for point in skeleton.points:
            branch = self.branches.get(point.id)
            end = branch.end if branch else None
            summary = BranchSummary(point.id, point.title, point.est_tokens)
            if branch is not None:
                summary.start_ms, summary.wall_ms = branch.start_ms, branch.end_ms - branch.start_ms
                sum_branch_ms += summary.wall_ms
            if end is not None:
                summary.finish_reason, summary.error = end.finish_reason, end.error
                if end.stats is not None:
                    self.stats.merge(end.stats)
                    summary.num_tokens, summary.num_rounds = end.stats.num_generated_tokens, end.stats.num_target_forwards
                if end.finish_reason is not None:
                    finishes.append(end.finish_reason)
            self.summary.branches.append(summary)
        texts = {point_id: b.end.text for point_id, b in self.branches.items() if b.end is not None and not b.end.error}
        self.summary.total_ms = self._ms()
        self.summary.parallel_speedup_estimate = (self.summary.skeleton_ms + sum_branch_ms) / max(self.summary.total_ms, 1e-9)
        finish = next((f for f in FINISH_PRIORITY if f in finishes), FinishReason.EOS)
        self.stats.wall_ms = self._ms()
        return Merged(merge(skeleton, texts), finish, self.stats, self.summary)
