"""The Skeleton-of-Thought sequence (`specmesh.skeleton.answer`) without protobuf, gRPC or a model.

The target is scripted: a session's reply is fixed by what its prompt asks for (the plan, point i,
or the question itself), so every event can be checked exactly. The drafter is None (plain rounds)
or proposes the script with every second token wrong (accepted and rejected tokens both happen).
The tokenizer is the tiny model's (ChatML template), so prompts and forks are the real ones.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from specmesh.decoding.async_driver import TargetInfo
from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.state import FinishReason
from specmesh.decoding.types import FinalTokenKind, VerifyOutcome
from specmesh.skeleton.answer import SkeletonAnswer, SkeletonRequest, branch_seed, max_skeleton_tokens
from specmesh.skeleton.automaton import SkeletonFormat
from specmesh.skeleton.events import (
    MAIN_BRANCH,
    SKELETON_BRANCH,
    AnswerText,
    BranchEnd,
    BranchText,
    Merged,
    PlanText,
)
from specmesh.skeleton.merge import merge, section_header
from specmesh.skeleton.parse import parse_skeleton
from specmesh.skeleton.quality import branch_token_budget
from specmesh.skeleton.sessions import ForkUnavailable
from specmesh.skeleton.types import DIRECT_BY_MODEL, Skeleton

QUESTION = "What are some tips for better sleep?"
PLAN = "[PLAN]\n1.<12><None>[-]Sleep\n2.<30><None>[-]Food\n3.<12><None>[1]Move\n[END]"
REPLIES = {1: " Keep a dark room.", 2: " Eat light at night, and skip late coffee.", 3: " Walk in the morning."}
DIRECT_REPLY = "Sleep more, worry less."
FMT = SkeletonFormat(max_points=8)
MAX_NEW_TOKENS = 40
SEED = 11
SLOW_ROUND_S = 0.005  # far below the gate's time bound (ROUND_GATE_MAX_WAIT_S)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir("llama"))


@dataclass
class Session:
    prompt_ids: list[int]
    reply_ids: list[int]  # what the target writes, EOS last (past it: EOS again)
    params: SamplingParams
    point_id: int | None  # the point its prompt asks for (None: the plan or the question)
    num_emitted: int = 1  # the first token, at open
    closed: bool = False

    @property
    def token_ids(self) -> list[int]:
        return [*self.prompt_ids, *(self.reply_ids[:self.num_emitted])]

    def token(self, position: int) -> int:
        return self.reply_ids[min(position, len(self.reply_ids) - 1)]


@dataclass
class Target:
    """The scripted target all verifiers share: its sessions, and what was asked of it."""

    tokenizer: object
    plan: str = PLAN
    failing_points: set[int] = field(default_factory=set)  # their rounds raise
    fork_unavailable: bool = False
    slow_points: set[int] = field(default_factory=set)  # each of their rounds takes SLOW_ROUND_S
    rounds: list[int] = field(default_factory=list)  # the point of each branch round, in the order they reach the target
    sessions: list[Session] = field(default_factory=list)
    forks: list[tuple[Session, int, Session]] = field(default_factory=list)  # (parent, shared tokens, child)
    plan_opens: list[tuple[SkeletonFormat, int]] = field(default_factory=list)  # (format, forced tokens)
    max_open_branches: int = 0

    @property
    def eos_id(self) -> int:
        return self.tokenizer.convert_tokens_to_ids("<|im_end|>")

    def session(self, prompt_ids: Sequence[int], params: SamplingParams) -> Session:
        text = self.tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
        asked = re.findall(r'Point (\d+): "', text)
        if asked:
            point_id: int | None = int(asked[-1])
            reply = REPLIES[int(asked[-1])]
        elif "Do not answer yet" in text:  # the plan; a forced prefix is already in the prompt
            point_id, forced = None, text.rsplit("<|im_start|>assistant\n", 1)[1]
            assert self.plan.startswith(forced)
            reply = self.plan[len(forced):]
        else:
            point_id, reply = None, DIRECT_REPLY
        reply_ids = list(self.tokenizer.encode(reply, add_special_tokens=False)) + [self.eos_id]
        session = Session(list(prompt_ids), reply_ids, params, point_id)
        self.sessions.append(session)
        self.max_open_branches = max(self.max_open_branches, len(self.open_branches()))
        return session

    def open_branches(self) -> list[Session]:
        return [s for s in self.sessions if s.point_id is not None and not s.closed]


class Verifier:
    """A `ForkVerifier` over the scripted target (greedy: a draft token is accepted iff it is the script's)."""

    def __init__(self, target: Target):
        self.target = target

    async def info(self) -> TargetInfo:
        return TargetInfo(vocab_size=len(self.target.tokenizer), max_context=4096, eos_token_ids=(self.target.eos_id,))

    async def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> tuple[Session, int]:
        await asyncio.sleep(0)
        session = self.target.session(prompt_ids, params)
        return session, session.token(0)

    async def fork(self, parent: Session, num_shared_tokens: int, prompt_ids: Sequence[int],
                   params: SamplingParams) -> tuple[Session, int]:
        assert not parent.closed and 0 < num_shared_tokens < len(prompt_ids)
        assert list(prompt_ids[:num_shared_tokens]) == parent.token_ids[:num_shared_tokens]
        if self.target.fork_unavailable:
            raise ForkUnavailable("the parent's replica is gone")
        child, first = await self.open(prompt_ids, params)
        self.target.forks.append((parent, num_shared_tokens, child))
        return child, first

    async def verify(self, session: Session, proposal: DraftProposal) -> tuple[VerifyOutcome, FinishReason | None]:
        await asyncio.sleep(0)
        if session.point_id in self.target.failing_points:
            raise RuntimeError(f"the replica of point {session.point_id} is on fire")
        if session.point_id is not None:
            self.target.rounds.append(session.point_id)
        if session.point_id in self.target.slow_points:
            await asyncio.sleep(SLOW_ROUND_S)
        accepted: list[int] = []
        for token in proposal.token_ids:
            if token != session.token(session.num_emitted + len(accepted)):
                break
            accepted.append(token)
        final = session.token(session.num_emitted + len(accepted))
        session.num_emitted += len(accepted) + 1
        kind = FinalTokenKind.BONUS if len(accepted) == len(proposal.token_ids) else FinalTokenKind.RECOVERED
        return VerifyOutcome(list(range(len(accepted))), accepted, final, kind), None

    async def commit(self, session: Session, token_ids: Sequence[int]) -> None:
        raise AssertionError("no lossy cascade here")

    async def close(self, session: Session) -> None:
        assert not session.closed
        session.closed = True


class HalfRightDrafter:
    """Drafts the script with every second token wrong."""

    def __init__(self, target: Target):
        self.target = target

    async def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> list:
        return [list(prompt_ids), 0]  # (opened beside the verifier's session) its prompt; tokens told so far

    async def propose(self, state: list, accepted_since_last: Sequence[int], max_tokens: int) -> DraftProposal:
        if isinstance(state[0], list):  # the verifier's session of this prompt: the last one opened
            state[0] = next(s for s in reversed(self.target.sessions) if s.prompt_ids == state[0] and not s.closed)
        session, told = state
        state[1] = told = told + len(accepted_since_last)
        tokens = [session.token(told + i) + (i % 2) for i in range(max_tokens)]
        return DraftProposal(token_ids=tokens)

    async def close(self, state: list) -> None:
        pass


class Links:
    def __init__(self, target: Target, drafting: bool):
        self.target, self.drafting = target, drafting

    def plan_verifier(self, fmt: SkeletonFormat, num_forced_tokens: int) -> Verifier:
        self.target.plan_opens.append((fmt, num_forced_tokens))
        return Verifier(self.target)

    def branch_verifier(self) -> Verifier:
        return Verifier(self.target)

    def verifier(self) -> Verifier:
        return Verifier(self.target)

    def drafter(self) -> HalfRightDrafter | None:
        return HalfRightDrafter(self.target) if self.drafting else None

    def k_policy(self) -> None:
        return None


def run(tokenizer, target: Target, *, drafting: bool = False, max_parallel: int = 2, prefix: str = "",
        documents: Sequence[str] = ()) -> list:
    request = SkeletonRequest(QUESTION, list(tokenizer.encode(QUESTION, add_special_tokens=False)),
                              SamplingParams(temperature=0, seed=SEED, max_new_tokens=MAX_NEW_TOKENS), FMT, max_parallel,
                              prefix, list(documents))

    async def collect() -> list:
        return [event async for event in SkeletonAnswer(request, tokenizer, Links(target, drafting)).events()]

    return asyncio.run(collect())


def texts_by_branch(events: list) -> dict[int, str]:
    texts: dict[int, str] = {}
    for event in events:
        if isinstance(event, (PlanText, BranchText, AnswerText)):
            texts[event.branch_id] = texts.get(event.branch_id, "") + event.text
    return texts


@pytest.mark.parametrize("drafting", [False, True], ids=["target-only", "half-right-drafter"])
def test_a_plan_fans_out_into_forked_branches_and_merges(tokenizer, drafting):
    target = Target(tokenizer)
    events = run(tokenizer, target, drafting=drafting)
    skeleton = parse_skeleton(PLAN)
    assert isinstance(skeleton, Skeleton)

    assert isinstance(events[0], PlanText) and isinstance(events[-1], Merged)
    texts = texts_by_branch(events)
    assert texts[SKELETON_BRANCH] == PLAN
    for point in skeleton.points:
        assert texts[point.id] == section_header(point) + "\n" + REPLIES[point.id]
    merged = events[-1]
    assert merged.text == merge(skeleton, REPLIES) and merged.finish_reason is FinishReason.EOS

    plan_session = target.sessions[0]
    assert target.plan_opens == [(FMT, 0)] and plan_session.params.max_new_tokens == max_skeleton_tokens(FMT)
    assert plan_session.params.seed == branch_seed(SEED, SKELETON_BRANCH)
    assert sorted(child.point_id for _, _, child in target.forks) == [1, 2, 3]  # every branch forked the plan
    for parent, num_shared, child in target.forks:
        assert parent is plan_session and num_shared > len(plan_session.prompt_ids)  # the plan's tokens are shared
        point = skeleton.point(child.point_id)
        assert child.params.seed == branch_seed(SEED, point.id)
        assert child.params.max_new_tokens == branch_token_budget(point, MAX_NEW_TOKENS)
    assert all(s.closed for s in target.sessions)
    assert target.max_open_branches == 2  # max_parallel

    # point 3 depends on point 1: it starts after 1 ends, with 1's text in its prompt
    first_of_3 = next(i for i, e in enumerate(events) if isinstance(e, BranchText) and e.branch_id == 3)
    end_of_1 = next(i for i, e in enumerate(events) if isinstance(e, BranchEnd) and e.point_id == 1)
    assert first_of_3 > end_of_1
    move = next(s for s in target.sessions if s.point_id == 3)
    assert REPLIES[1].strip() in tokenizer.decode(move.prompt_ids)
    assert sorted(e.point_id for e in events if isinstance(e, BranchEnd)) == [1, 2, 3]

    summary = merged.summary
    plan_stats = next(e.stats for e in events if isinstance(e, PlanText) and e.finish_reason)
    branch_stats = [e.stats for e in events if isinstance(e, BranchEnd)]
    assert summary.num_skeleton_tokens == len(plan_session.reply_ids) == plan_stats.num_generated_tokens
    assert summary.num_prefilled_branches == 0 and not summary.direct_reason and summary.max_parallel == 2
    assert [b.point_id for b in summary.branches] == [1, 2, 3]
    for b, point in zip(summary.branches, skeleton.points):
        assert (b.title, b.est_tokens, b.finish_reason, b.error) == (point.title, point.est_tokens, FinishReason.EOS, "")
        assert b.num_tokens == len(tokenizer.encode(REPLIES[point.id], add_special_tokens=False)) + 1
    assert merged.stats.num_generated_tokens == plan_stats.num_generated_tokens + sum(
        s.num_generated_tokens for s in branch_stats)
    if drafting:
        assert merged.stats.num_accepted_tokens > 0 and merged.stats.num_draft_tokens > merged.stats.num_accepted_tokens


def test_a_forced_prefix_is_streamed_first_and_counted_as_forced(tokenizer):
    target = Target(tokenizer)
    prefix = "[PLAN]\n1.<12><None>[-]Sleep\n"
    events = run(tokenizer, target, prefix=prefix)
    prefix_ids = list(tokenizer.encode(prefix, add_special_tokens=False))
    assert events[0] == PlanText(SKELETON_BRANCH, prefix, prefix_ids)
    assert target.plan_opens == [(FMT, len(prefix_ids))]
    assert texts_by_branch(events)[SKELETON_BRANCH] == PLAN
    assert events[-1].summary.num_skeleton_tokens == len(target.sessions[0].reply_ids)  # the model's, not the prefix


def test_a_direct_plan_answers_the_question_plainly(tokenizer):
    target = Target(tokenizer, plan="[DIRECT]one line\n[END]")
    events = run(tokenizer, target)
    assert {type(e) for e in events} == {PlanText, AnswerText, Merged}
    answer = [e for e in events if isinstance(e, (AnswerText, Merged))]
    assert "".join(e.text for e in answer) == DIRECT_REPLY and all(getattr(e, "branch_id", MAIN_BRANCH) == MAIN_BRANCH
                                                                    for e in answer)
    merged = events[-1]
    assert merged.summary.direct_reason == DIRECT_BY_MODEL and merged.finish_reason is FinishReason.EOS
    assert merged.token_ids and merged.summary.branches == []
    direct = target.sessions[1]
    assert direct.prompt_ids == list(tokenizer.encode(QUESTION, add_special_tokens=False)) and direct.params.seed == SEED
    assert target.sessions[0].closed and not target.forks
    plan_stats = next(e.stats for e in events if isinstance(e, PlanText) and e.finish_reason)
    assert merged.stats.num_generated_tokens == plan_stats.num_generated_tokens + len(direct.reply_ids)


def test_a_rejected_plan_is_answered_plainly_and_says_why(tokenizer):
    target = Target(tokenizer, plan="[PLAN]\n1.<12><None>[-]Dark room\n2.<12><None>[-]dark room.\n[END]")
    events = run(tokenizer, target)
    assert not any(isinstance(e, (BranchText, BranchEnd)) for e in events)
    assert events[-1].summary.direct_reason == 'plan rejected, repeated points: 1 and 2 ("dark room")'
    assert "".join(e.text for e in events if isinstance(e, (AnswerText, Merged))) == DIRECT_REPLY


def test_a_failed_branch_is_reported_in_band_and_its_dependents_still_run(tokenizer):
    target = Target(tokenizer, failing_points={1})
    events = run(tokenizer, target)
    skeleton = parse_skeleton(PLAN)
    assert isinstance(skeleton, Skeleton)
    failed = next(e for e in events if isinstance(e, BranchEnd) and e.point_id == 1)
    assert failed.error == "RuntimeError: the replica of point 1 is on fire" and failed.text == ""
    move = next(s for s in target.sessions if s.point_id == 3)
    assert REPLIES[1].strip() not in tokenizer.decode(move.prompt_ids)  # started without the failed text
    merged = events[-1]
    assert merged.text == merge(skeleton, {2: REPLIES[2], 3: REPLIES[3]})
    assert merged.text.startswith(section_header(skeleton.point(1)) + "\n\n")  # the title stays
    first = merged.summary.branches[0]
    assert first.error == failed.error and first.finish_reason is None and first.num_tokens == 0
    assert [b.finish_reason for b in merged.summary.branches[1:]] == [FinishReason.EOS, FinishReason.EOS]
    assert all(s.closed for s in target.sessions)


def test_a_fork_that_cannot_happen_falls_back_to_a_prefill(tokenizer):
    target = Target(tokenizer, fork_unavailable=True)
    events = run(tokenizer, target)
    assert not target.forks and events[-1].summary.num_prefilled_branches == 3
    skeleton = parse_skeleton(PLAN)
    assert isinstance(skeleton, Skeleton) and events[-1].text == merge(skeleton, REPLIES)


def test_a_search_point_gets_passages_from_the_documents(tokenizer):
    target = Target(tokenizer, plan="[PLAN]\n1.<12><Search>[-]Sleep\n2.<30><None>[-]Food\n[END]")
    document = "A dark and cool bedroom helps sleep. Coffee after noon keeps many people awake."
    run(tokenizer, target, documents=[document])
    prompts = {s.point_id: tokenizer.decode(s.prompt_ids) for s in target.sessions if s.point_id}
    assert "Passages from the provided documents" in prompts[1] and "dark and cool bedroom" in prompts[1]
    assert "Passages from the provided documents" not in prompts[2]


def test_sibling_rounds_wait_for_each_other_at_the_gate(tokenizer):
    """Point 2's rounds are slow, point 1's instant: without the gate point 1 would run ahead; with it,
    while both run, neither is more than one round ahead of the other."""
    target = Target(tokenizer, plan="[PLAN]\n1.<12><None>[-]Sleep\n2.<30><None>[-]Food\n[END]", slow_points={2})
    run(tokenizer, target)
    totals = {point_id: target.rounds.count(point_id) for point_id in (1, 2)}
    assert min(totals.values()) > 3
    counts = {1: 0, 2: 0}
    for point_id in target.rounds:
        counts[point_id] += 1
        if counts[1] < totals[1] and counts[2] < totals[2]:
            assert abs(counts[1] - counts[2]) <= 1, target.rounds
