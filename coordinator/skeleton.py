"""Skeleton-of-Thought in the Coordinator: plan, fan out, merge, over the Verify (and Draft) services.

One request (GENERATION_MODE_SKELETON, or chosen by `coordinator.mode_choice`), as data:

    route_reason                                      why SoT runs ("requested", or the router's rule)
    skeleton: Verify.OpenSession(skeleton prompt [+ forced prefix], SkeletonConstraint)
              decoded by the one speculation state (`speculative_stream_async`) with the request's
              drafter; the service masks every target row with the plan grammar, so the plan is
              exact for the constrained model and ends on EOS within the grammar's token bound.
              Streamed as branch 0. The session stays open: branches fork from it.
    parse:    Direct (the model chose [DIRECT], or an unusable plan) -> the request's own prompt,
              decoded plainly (speculatively) and streamed on -1; done.
    schedule: `BranchScheduler` (longest first, max_parallel, dependencies, continuous admission).
    branch i: its prompt is the point conversation (`point_messages`, chat template applied), which
              starts with the skeleton session's tokens: Verify.Fork(skeleton session,
              num_prefix_tokens = the tokens they share, append_token_ids = the rest), so the prompt
              is never prefilled again; then the one speculation state over the child session, as
              an asyncio task beside its siblings. A `RoundGate` sends the siblings' Verify calls
              together each round, so they meet in one forward of the batcher instead of drifting
              into groups whose forwards alternate. Streamed as branch i (first message: the
              point's header line). Branches launched together fork in one Fork RPC, and the
              rounds the gate releases leave as one VerifyBatch RPC per replica
              (`coordinator.siblings`). Once every point has started and forked, the
              skeleton session is closed (it only held KV, and counted as a session the batcher
              waits for).
    merge:    one -1 message: the merged answer, the stats of every round, `SkeletonStats`.

Layouts (`SkeletonRequest.layout`, common.proto BranchLayout), the same text either way:
    batching:      each branch is a sequence of its own; sibling rounds are rows of one forward.
    one_sequence:  the Fork asks the Verify service to lay the branches side by side after the
                   skeleton's prefix in ONE sequence (specmesh/models/engine.py: layouts): each round
                   of the siblings is one attention row over [prefix | region 1 | region 2 | ...]
                   with a block mask, and a rejected draft rolls back inside its branch's region.
A branch's dependencies reach it as text in its point prompt in both layouts (`point_request`), so
a region sees the prefix and itself; each branch then equals target-only decoding of its own full
prompt, whichever the layout.

A branch that fails is reported in-band (its last message has error_message); its dependents still
start (without its text) and the merge keeps its title. A fork that cannot happen (the skeleton's
replica died, its session expired) falls back to a full prefill of the branch prompt on a healthy
replica (counted in `num_prefilled_branches`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from coordinator.driver import Calls, FailoverDrafter, Failovers, FailoverVerifier, VerifyHandle, replica_failed
from coordinator.pools import ServicePool
from coordinator.siblings import SiblingCalls
from servicekit.convert import FINISH_TO_PB, sampling_to_pb, stats_to_pb
from servicekit.engine_thread import run_aside
from servicekit.remote import RemoteVerifier
from specmesh.decoding.adaptive import KPolicy
from specmesh.decoding.async_driver import TargetInfo, speculative_stream_async
from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.sampling import MAX_SEED, SamplingParams
from specmesh.decoding.state import FinishReason
from specmesh.decoding.stats import SpecStats
from specmesh.decoding.types import VerifyOutcome
from specmesh.models.chat import chat_messages_ids
from specmesh.proto.v1 import common_pb2, coordinator_pb2, verify_pb2
from specmesh.skeleton.automaton import SkeletonFormat, build_skeleton_automaton
from specmesh.skeleton.merge import merge, section_header
from specmesh.skeleton.parse import parse_skeleton
from specmesh.skeleton.prompts import common_prefix_length, point_messages, skeleton_messages
from specmesh.skeleton.quality import branch_token_budget, plan_problem
from specmesh.skeleton.rounds import RoundGate
from specmesh.skeleton.schedule import BranchScheduler, Launch
from specmesh.skeleton.tools import PassageIndex, passages_for
from specmesh.skeleton.types import Direct, Skeleton

MAIN_BRANCH = -1  # the answer: the merged text, or a direct answer
SKELETON_BRANCH = 0  # the plan; points are 1-based
FINISH_PRIORITY = (FinishReason.CONTEXT, FinishReason.LENGTH, FinishReason.STOP, FinishReason.EOS)
ROUND_GATE_MAX_WAIT_S = 1.0  # the longest a round waits for its siblings (a stall; forks and forwards take less)


@functools.lru_cache(maxsize=16)
def max_skeleton_tokens(fmt: SkeletonFormat) -> int:
    """The grammar's bound on a plan's tokens, EOS included (every allowed token adds a byte)."""
    return build_skeleton_automaton(fmt).max_bytes + 1


def branch_seed(seed: int, branch_id: int) -> int:
    """Branch i samples from seed + i: streams of one request that do not repeat each other."""
    return (seed + branch_id) % (MAX_SEED + 1)


def branch_prompt(tokenizer, session_ids: Sequence[int], messages: list[dict[str, str]]) -> tuple[list[int], int]:
    """(the branch's prompt ids, how many leading ones it shares with the skeleton session's tokens).
    Token ids are compared, not texts: the model may have spelled the plan in other tokens than the
    chat template's tokenization of its text gives, and the session may hold tokens past its EOS."""
    ids = chat_messages_ids(tokenizer, messages)
    return ids, common_prefix_length(session_ids, ids)


@dataclass
class Links:
    """How one request reaches the services (made by the servicer per request)."""

    verify: ServicePool
    draft: ServicePool
    info: TargetInfo
    calls: Calls
    failovers: Failovers
    drafter_kind: str  # "service" (the Draft service), "ngram" (in the coordinator) or "none" (target only)
    q_dtype: Any  # torch dtype of q on the wire
    sparse_q: bool
    k_policy: Callable[[], KPolicy | None]  # a fresh policy per stream (None: adaptive)
    drafters: list[FailoverDrafter] = field(default_factory=list)  # every drafter made, for the stats

    def drafter(self) -> FailoverDrafter | None:
        if self.drafter_kind == "none":
            return None
        drafter = FailoverDrafter(self.draft, self.calls, self.failovers, use_service=self.drafter_kind == "service",
                                  q_dtype=self.q_dtype, sparse_q=self.sparse_q)
        self.drafters.append(drafter)
        return drafter

    @property
    def drafter_names(self) -> str:
        """The drafters that finished the streams, e.g. "draft-service" or "draft-service,ngram"."""
        return ",".join(sorted({d.current for d in self.drafters}))


class PlanVerifier(FailoverVerifier):
    """The skeleton's Verify session: opened with the plan grammar, and kept open when the stream
    ends (`close`) so that branches can fork from it; `release` closes it."""

    def __init__(self, links: Links, fmt: SkeletonFormat, num_forced_tokens: int):
        super().__init__(links.verify, links.info, links.calls, links.failovers, sparse_q=links.sparse_q)
        self.fmt = fmt
        self.num_forced_tokens = num_forced_tokens
        self.handle: VerifyHandle | None = None

    async def _open_on(self, remote: RemoteVerifier, prompt: list[int], params: SamplingParams) -> tuple[str, int]:
        # a re-opened session's prompt ends with the tokens emitted so far: plan output too
        num_forced = self.num_forced_tokens + len(prompt) - len(self._prompt)
        constraint = verify_pb2.SkeletonConstraint(
            max_points=self.fmt.max_points, max_title_bytes=self.fmt.max_title_bytes, max_est_digits=self.fmt.max_est_digits,
            max_direct_bytes=self.fmt.max_direct_bytes, num_forced_tokens=num_forced)
        response = await remote.stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(
            prompt_token_ids=prompt, sampling=_token_level(params), skeleton=constraint),
            timeout=remote.timeout_s, metadata=remote.metadata)
        return response.session_id, response.first_token_id

    @property
    def session_ids(self) -> list[int]:
        """Every token the skeleton session holds (prompt, plan, EOS, and any token emitted after it)."""
        return [*self._prompt, *(self.handle.emitted if self.handle else [])]

    async def close(self, handle: VerifyHandle) -> None:
        self.handle = handle

    async def release(self) -> None:
        if self.handle is not None:
            handle, self.handle = self.handle, None
            await super().close(handle)


class BranchVerifier(FailoverVerifier):
    """A branch's Verify session: `open` forks the skeleton session (sharing `num_shared` tokens, the
    rest of the prompt appended); without a skeleton session to fork, a plain open (a prefill).
    Each round waits at `gate` for the siblings' (joined as `member` at launch; `leave` at the end);
    its fork and its rounds go out through `siblings`, with those of the siblings in the same turn
    (`coordinator.siblings`). `layout` is the request's BranchLayout."""

    def __init__(self, links: Links, parent: VerifyHandle | None, num_shared: int, gate: RoundGate, member: int,
                 layout: int, siblings: SiblingCalls):
        super().__init__(links.verify, links.info, links.calls, links.failovers, sparse_q=links.sparse_q)
        self.parent = parent
        self.num_shared = num_shared
        self.layout = layout
        self.siblings = siblings
        self.prefilled = False
        self.opened = False  # the open (fork or prefill) is over, however it went
        self.gate, self.member = gate, member
        gate.join(member)

    def leave(self) -> None:
        self.gate.leave(self.member)

    async def verify(self, handle: VerifyHandle, proposal: DraftProposal) -> tuple[VerifyOutcome, FinishReason | None]:
        await self.gate.arrive(self.member)
        return await super().verify(handle, proposal)

    async def _send_verify(self, handle: VerifyHandle, proposal: DraftProposal) -> tuple[VerifyOutcome, FinishReason | None]:
        return await self.siblings.verify(handle.remote, handle.session_id, proposal)

    async def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> tuple[VerifyHandle, int]:
        try:
            return await self._fork_or_prefill(prompt_ids, params)
        finally:
            self.opened = True

    async def _fork_or_prefill(self, prompt_ids: Sequence[int], params: SamplingParams) -> tuple[VerifyHandle, int]:
        parent = self.parent
        if parent is None or not 0 < self.num_shared < len(prompt_ids):
            self.prefilled = True
            return await super().open(prompt_ids, params)
        self._prompt, self._params = list(prompt_ids), params
        try:  # siblings forking in the same turn share one Fork; a child whose caller is gone is closed
            child_id, first = await self.siblings.fork(parent.remote, parent.session_id, self.num_shared,
                                                  self._prompt[self.num_shared:], _token_level(params), self.layout,
                                                  self.calls.timeout_s)
        except grpc.aio.AioRpcError as exc:
            if not replica_failed(exc):
                raise
            self.failovers.add(f"fork on verify {parent.replica.id} failed ({exc.code().name}) -> prefill")
            self.prefilled = True
            return await super().open(prompt_ids, params)
        self.pool.replicas.start(parent.replica)
        return VerifyHandle(parent.replica, parent.remote, child_id, [first]), first


@dataclass
class BranchEnd:
    """A branch task's last word to the request's loop."""

    point_id: int
    text: str = ""
    error: str = ""


@dataclass
class BranchRecord:
    point_id: int
    start_ms: float
    stats: SpecStats | None = None
    finish: FinishReason | None = None
    end_ms: float = 0.0
    error: str = ""
    text: str = ""


@dataclass
class SkeletonRequest:
    """What one skeleton-mode request asks for."""

    question: str
    prompt_ids: list[int]  # the request's own prompt: a direct answer decodes it
    params: SamplingParams  # seed resolved; max_new_tokens bounds each branch
    fmt: SkeletonFormat
    max_parallel: int
    prefix: str = ""  # forced start of the plan
    documents: list[str] = field(default_factory=list)
    route_reason: str = "requested"  # why SoT runs (`coordinator.mode_choice`), reported in SkeletonStats
    layout: int = common_pb2.BRANCH_LAYOUT_BATCHING  # how the Verify service lays out the branches (BranchLayout)


class SkeletonAnswer:
    """One skeleton-mode request: `responses()` is its GenerateResponse stream (module docstring).
    `final_stats(stats)` turns the request's summed stats into the last message's stats."""

    def __init__(self, request: SkeletonRequest, tokenizer, links: Links,
                 final_stats: Callable[[SpecStats], common_pb2.SpeculationStats]):
        self.request = request
        self.tokenizer = tokenizer
        self.links = links
        self.final_stats = final_stats
        self.start_s = time.perf_counter()
        self.stats = SpecStats(seed=request.params.seed or 0)  # every round of the request
        self.summary = coordinator_pb2.SkeletonStats(max_parallel=request.max_parallel, layout=request.layout)
        self.branches: dict[int, BranchRecord] = {}

    def _ms(self) -> float:
        return (time.perf_counter() - self.start_s) * 1e3

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    async def responses(self) -> AsyncGenerator[coordinator_pb2.GenerateResponse, None]:
        request = self.request
        self.summary.route_reason = request.route_reason
        prefix_ids = list(self.tokenizer.encode(request.prefix, add_special_tokens=False)) if request.prefix else []
        prompt = chat_messages_ids(self.tokenizer, skeleton_messages(request.question, request.fmt)) + prefix_ids
        plan_verifier = PlanVerifier(self.links, request.fmt, len(prefix_ids))
        try:
            plan_ids: list[int] = []
            async for response in self._plan(plan_verifier, prompt, prefix_ids, plan_ids):
                yield response
            skeleton_text = self.tokenizer.decode([*prefix_ids, *plan_ids], skip_special_tokens=True,
                                                  clean_up_tokenization_spaces=False)
            parsed = parse_skeleton(skeleton_text, max_points=request.fmt.max_points)
            problem = plan_problem(parsed, request.question) if isinstance(parsed, Skeleton) else None
            if problem:  # a plan that would lose to a plain answer: answer plainly, and say why
                parsed = Direct(skeleton_text, f"plan rejected, {problem}")
            self.summary.skeleton_ms = self._ms()
            self.summary.num_skeleton_tokens = len(plan_ids)
            if isinstance(parsed, Direct):
                await plan_verifier.release()
                self.summary.direct_reason = parsed.reason
                async for response in self._direct():
                    yield response
                return
            async for response in self._branches(parsed, skeleton_text, plan_verifier):
                yield response
        finally:
            await plan_verifier.release()

    async def _plan(self, verifier: PlanVerifier, prompt: list[int], prefix_ids: list[int],
                    plan_ids: list[int]) -> AsyncIterator[coordinator_pb2.GenerateResponse]:
        """Decode the plan after `prompt` (the skeleton conversation and the forced prefix), streamed as
        branch 0; fills `plan_ids` with the tokens the model wrote."""
        request = self.request
        max_tokens = await run_aside(max_skeleton_tokens, request.fmt)
        params = dataclasses.replace(request.params, max_new_tokens=max_tokens, ignore_eos=False, stop=[],
                                     seed=branch_seed(request.params.seed or 0, SKELETON_BRANCH))
        if prefix_ids:
            yield coordinator_pb2.GenerateResponse(text=request.prefix, token_ids=prefix_ids, branch_id=SKELETON_BRANCH)
        stream = speculative_stream_async(verifier, self.links.drafter(), prompt, params, k_policy=self.links.k_policy(),
                                          decode=self._decode)
        try:
            async for event in stream:
                plan_ids.extend(event.token_ids)
                response = coordinator_pb2.GenerateResponse(text=event.text, token_ids=event.token_ids, branch_id=SKELETON_BRANCH)
                if event.finish_reason is not None:
                    assert event.stats is not None
                    self.stats.merge(event.stats)
                    response.finish_reason = FINISH_TO_PB[event.finish_reason]
                    response.stats.CopyFrom(stats_to_pb(event.stats))
                yield response
        finally:
            await stream.aclose()

    async def _direct(self) -> AsyncIterator[coordinator_pb2.GenerateResponse]:
        """No plan: the request's own prompt, decoded as in the plain modes, streamed on -1."""
        links = self.links
        verifier = FailoverVerifier(links.verify, links.info, links.calls, links.failovers, sparse_q=links.sparse_q)
        stream = speculative_stream_async(verifier, links.drafter(), self.request.prompt_ids, self.request.params,
                                          k_policy=links.k_policy(), decode=self._decode)
        try:
            async for event in stream:
                response = coordinator_pb2.GenerateResponse(text=event.text, token_ids=event.token_ids, branch_id=MAIN_BRANCH)
                if event.finish_reason is not None:
                    assert event.stats is not None
                    self.stats.merge(event.stats)
                    response.finish_reason = FINISH_TO_PB[event.finish_reason]
                    response.stats.CopyFrom(self._total_stats())
                    self.summary.total_ms = self._ms()
                    response.skeleton.CopyFrom(self.summary)
                yield response
        finally:
            await stream.aclose()

    async def _branches(self, skeleton: Skeleton, skeleton_text: str,
                        plan_verifier: PlanVerifier) -> AsyncIterator[coordinator_pb2.GenerateResponse]:
        """Run the plan's branches as tasks (scheduler admission), relaying their messages; then the merge."""
        request = self.request
        index = await run_aside(PassageIndex, request.documents) if request.documents else None
        scheduler = BranchScheduler(skeleton.points, request.max_parallel)
        queue: asyncio.Queue[coordinator_pb2.GenerateResponse | BranchEnd] = asyncio.Queue()
        tasks: set[asyncio.Task] = set()
        gate = RoundGate(ROUND_GATE_MAX_WAIT_S)
        siblings = SiblingCalls()  # forks of one turn leave as one Fork, rounds the gate releases as one VerifyBatch
        verifiers: list[BranchVerifier] = []

        async def start(launches: list[Launch]) -> None:
            for launch in launches:
                passages = [p.text for p in passages_for(launch.point, request.question, index)]
                messages = point_messages(request.question, skeleton_text, launch.point, launch.dependencies, passages,
                                          request.fmt)
                ids, num_shared = branch_prompt(self.tokenizer, plan_verifier.session_ids, messages)
                verifiers.append(BranchVerifier(self.links, plan_verifier.handle, num_shared, gate, launch.point.id,
                                                request.layout, siblings))
                task = asyncio.get_running_loop().create_task(self._branch(launch, ids, verifiers[-1], queue))
                tasks.add(task)
                task.add_done_callback(tasks.discard)

        first_start_ms = self._ms()
        try:  # the skeleton session stays open while a point may still fork from it
            await start(scheduler.admit())
            while not scheduler.done:
                item = await queue.get()
                if plan_verifier.handle is not None and not scheduler.waiting and all(v.opened for v in verifiers):
                    await plan_verifier.release()
                if isinstance(item, BranchEnd):
                    record = self.branches[item.point_id]
                    record.end_ms, record.text, record.error = self._ms(), item.text, item.error
                    await start(scheduler.fail(item.point_id, item.error) if item.error
                                else scheduler.finish(item.point_id, item.text))
                else:
                    yield item
            while not queue.empty():  # nothing is left after the last BranchEnd; kept for safety
                item = queue.get_nowait()
                if not isinstance(item, BranchEnd):
                    yield item
        finally:
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        self.summary.branches_ms = self._ms() - first_start_ms
        self.summary.num_verify_batches, self.summary.num_batched_rounds = siblings.num_verify_batches, siblings.num_batched_rounds
        self.summary.num_fork_rpcs = siblings.num_fork_rpcs
        yield self._merged(skeleton)

    async def _branch(self, launch: Launch, prompt_ids: list[int], verifier: BranchVerifier,
                      queue: asyncio.Queue) -> None:
        """One branch, start to end; every message and its end go to `queue` (never raises)."""
        point = launch.point
        record = self.branches[point.id] = BranchRecord(point.id, self._ms())
        params = dataclasses.replace(self.request.params, seed=branch_seed(self.request.params.seed or 0, point.id),
                                     max_new_tokens=branch_token_budget(point, self.request.params.max_new_tokens))
        await queue.put(coordinator_pb2.GenerateResponse(text=section_header(point) + "\n", branch_id=point.id))
        text: list[str] = []
        stream = speculative_stream_async(verifier, self.links.drafter(), prompt_ids, params,
                                          k_policy=self.links.k_policy(), decode=self._decode)
        try:
            async for event in stream:
                text.append(event.text)
                response = coordinator_pb2.GenerateResponse(text=event.text, token_ids=event.token_ids, branch_id=point.id)
                if event.finish_reason is not None:
                    assert event.stats is not None
                    verifier.leave()  # no more rounds: the siblings stop waiting for this branch
                    record.stats, record.finish = event.stats, event.finish_reason
                    response.finish_reason = FINISH_TO_PB[event.finish_reason]
                    response.stats.CopyFrom(stats_to_pb(event.stats))
                await queue.put(response)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported in-band; the other branches go on
            error = _describe(exc)
            await queue.put(coordinator_pb2.GenerateResponse(branch_id=point.id, error_message=error,
                                                             finish_reason=common_pb2.FINISH_REASON_ERROR))
            await queue.put(BranchEnd(point.id, error=error))
            return
        finally:
            verifier.leave()
            await stream.aclose()
            if verifier.prefilled:
                self.summary.num_prefilled_branches += 1
        await queue.put(BranchEnd(point.id, text="".join(text)))

    def _merged(self, skeleton: Skeleton) -> coordinator_pb2.GenerateResponse:
        """The last message: the whole answer, the summed stats, SkeletonStats."""
        finishes = []
        sum_branch_ms = 0.0
        for point in skeleton.points:
            record = self.branches.get(point.id)
            stats = record.stats if record else None
            if stats is not None:
                self.stats.merge(stats)
            if record is not None:
                sum_branch_ms += record.end_ms - record.start_ms
                if record.finish is not None:
                    finishes.append(record.finish)
            self.summary.branches.append(coordinator_pb2.BranchStats(
                point_id=point.id, title=point.title, est_tokens=point.est_tokens,
                num_tokens=stats.num_generated_tokens if stats else 0, num_rounds=stats.num_target_forwards if stats else 0,
                start_ms=record.start_ms if record else 0.0, wall_ms=record.end_ms - record.start_ms if record else 0.0,
                finish_reason=FINISH_TO_PB[record.finish] if record and record.finish else
                (common_pb2.FINISH_REASON_ERROR if record and record.error else common_pb2.FINISH_REASON_UNSPECIFIED),
                error_message=record.error if record else ""))
        texts = {point_id: record.text for point_id, record in self.branches.items() if not record.error}
        self.summary.total_ms = self._ms()
        self.summary.parallel_speedup_estimate = (self.summary.skeleton_ms + sum_branch_ms) / max(self.summary.total_ms, 1e-9)
        finish = next((f for f in FINISH_PRIORITY if f in finishes), FinishReason.EOS)
        return coordinator_pb2.GenerateResponse(text=merge(skeleton, texts), branch_id=MAIN_BRANCH,
                                                finish_reason=FINISH_TO_PB[finish], stats=self._total_stats(),
                                                skeleton=self.summary)

    def _total_stats(self) -> common_pb2.SpeculationStats:
        self.stats.wall_ms = self._ms()
        return self.final_stats(self.stats)


def _token_level(params: SamplingParams) -> common_pb2.SamplingParams:
    """Params as a Verify session takes them: stop strings stay with the driver, which decodes text."""
    return sampling_to_pb(dataclasses.replace(params, stop=[]))


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"
