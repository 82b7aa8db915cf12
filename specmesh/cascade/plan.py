"""The bookkeeping of a lossless cascade round, without I/O: what each level drafts and is told.

A cascade is a drafter built from a base drafter and stages of increasing cost (the target verifies
the last stage's proposal in its ordinary round, `specmesh.decoding.state`). One cascade round:

    base drafter:  propose up to caps[0] tokens (and q, when sampling)
    stage i:       verify_and_extend(accepted, lower proposal, its q, m_i) -> proposal, q = its p rows
                   the proposal is cut to caps[i + 1] tokens
    target:        verifies the last proposal (caps[S] = the target's k)

Caps, from the top down (S stages, stage i with extension m_i and room_i = its context window minus
the confirmed tokens): caps[S] = k; caps[i] = min(caps[i + 1], num_draft_tokens_i, room_i - m_i).
A stage whose caps[i + 1] is 0 is not called this round (nothing above wants tokens); one that has no
room left for a single token is retired for the rest of the session and passes its lower proposal
up. Cutting a proposal to a length fixed before the round is exact: whether position j exists never
depends on the token drawn at j (see "Exactness" below).

Defaults, and why: every level drafts the target's k, and each stage extends by m = 1 — the
recovered or bonus token its verify forward samples anyway, so a stage costs ONE forward per target
round and its proposal is "the lower draft up to its first disagreement, plus its own token". With
m > 1 a stage adds m - 1 plain decoding rounds (one forward each) when its own model is cheap enough
to be worth it. A filling stage (`StageSpec.fill`) goes on until its proposal holds the level above's
cap: below a stage that pays as a drafter, a free base (prompt lookup) that often has nothing to offer
costs nothing, and the stage drafts the rest itself, to the k the target's policy chose.

Passing a stage by. A stage that accepted the whole of a lower draft that filled its cap (a prompt
lookup copying the prompt) sits out the next rounds (`pass_agreed`): the lower draft goes up as it is,
while the target keeps accepting all of it, and the stage runs again, taking in what it missed in one
forward, at the first round the target did not. Its forward over a draft it would pass whole is pure
cost (a bf16 stage, 0.6 of an fp32 target step here). Only lossless cascades whose q travels nowhere
(greedy, coupled) pass: a standard-sampling proposal must carry the stage's q.

Exactness (sampling). Stage i emits the accepted prefix of the lower draft, then its own tokens. By
the speculative sampling theorem each emitted token y_j is distributed as the stage's processed p
given y_<j — whatever the lower draft was, a one-hot n-gram draft included. So the q that goes up is
the stage's own p rows, never the lower q: an accepted lower token is still a draw from the stage's
p, and claiming the lower q for it biases the next level (the chi-square test in
tests/unit/test_cascade_pipeline.py fails with p ~ 1e-22 when that is done). Sending no q (one-hot)
would stay exact, as for any draft drawn independently of the verifier's coins, but the next level
would then accept a token with probability p_next(x) instead of min(1, p_next(x) / p_stage(x)): an
n-gram base's q = None stops at the first stage. The proposal's length n + m (max(n + m, f) for a
filling stage) is decided by acceptances at positions <= j - m, before y_j is drawn, and the caps are fixed before the round, so
the next level's rejection sampling sees each token drawn from the q it is given. Each stage has its
own generator (`stage_seed`): a stage sharing the target's random stream would correlate the two
levels' accept decisions. Greedy: q is None at every level (argmax matching needs none). Coupled rule
(`specmesh.decoding.coupled`): every level samples position t with the request's noise of t, on
purpose: each level's token at t is a pure function of its p_t and that noise, the target's tokens
are the target-only run's whatever comes from below, and the levels agree as often as their
distributions allow; q is None at every level (the rule reads none).

Telling the levels what the target confirmed. Every stage is handed the tokens the target emitted
since its last call (`accepted`); `StageModel` rewinds its sequence to them. The base drafter follows
the `Drafter` contract: the tokens it is told are its own accepted drafts then one more token. In a
cascade the target accepts the LAST stage's proposal, which may differ from the base's draft, so
`split_for_base` cuts the news where it departs from the base's draft: the first piece is "c of
your drafts, then this token", the rest arrives in a second call (with max_tokens = 0 first).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specmesh.cascade.stage_model import StageOutput
from specmesh.decoding.proposal import DraftProposal

STAGE_SEED_SALT = 0x57A6_E5EE  # stage i's generator is seeded with seed ^ (this + i)


def stage_seed(seed: int, stage_index: int) -> int:
    """Stage `stage_index`'s seed for a request seed: distinct from the target's and the drafter's,
    the same in-process and over the wire.

    >>> stage_seed(0, 0) == STAGE_SEED_SALT, stage_seed(7, 1) == 7 ^ (STAGE_SEED_SALT + 1)
    (True, True)
    """
    return seed ^ (STAGE_SEED_SALT + stage_index)


@dataclass(frozen=True)
class StageSpec:
    """How one stage takes part in every round."""

    num_extend_tokens: int = 1  # m: the stage's own tokens after the accepted prefix (1 = one forward)
    num_draft_tokens: int | None = None  # most lower-draft tokens it verifies per round; None = the target's k
    fill: bool = False  # extend (past m) until the proposal holds what the level above asked for

    def __post_init__(self):
        if self.num_extend_tokens < 1:
            raise ValueError(f"a stage extends by at least 1 token, got num_extend_tokens={self.num_extend_tokens}")
        if self.num_draft_tokens is not None and self.num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {self.num_draft_tokens}")


def split_for_base(last_draft: Sequence[int], accepted: Sequence[int]) -> list[list[int]]:
    """The tokens the target emitted since the base drafter's last proposal, as the calls that tell
    the base drafter: one when they are its draft's prefix plus one token (or it had no draft out),
    else two, cut after the first token that departs from its draft.

    >>> split_for_base([7, 8, 9], [7, 8, 4])      # 2 drafts accepted, then the target's token
    [[7, 8, 4]]
    >>> split_for_base([7, 8, 9], [7, 5, 6, 4])   # a stage replaced 8 by 5 and added 6
    [[7, 5], [6, 4]]
    >>> split_for_base([7], [7, 5, 4])            # the whole draft matched, then two more tokens
    [[7, 5], [4]]
    >>> split_for_base([], [3, 4])                # nothing was outstanding
    [[3, 4]]
    """
    accepted = [int(t) for t in accepted]
    if not last_draft:
        return [accepted]
    matched = 0
    while matched < min(len(last_draft), len(accepted) - 1) and accepted[matched] == last_draft[matched]:
        matched += 1
    if matched == len(accepted) - 1:
        return [accepted]
    return [accepted[:matched + 1], accepted[matched + 1:]]


@dataclass
class StageStats:
    """One stage's work over a session."""

    num_rounds: int = 0  # verify_and_extend calls
    num_draft_tokens: int = 0  # lower-draft tokens it verified
    num_accepted_tokens: int = 0  # of those, accepted
    num_proposed_tokens: int = 0  # tokens it sent up (after the cap)
    num_passed: int = 0  # rounds it sat out, the lower draft going up as it was (`CascadeBook.pass_agreed`)
    stage_ms: float = 0.0
    retired: bool = False  # out of the session: no room left, or its service failed (the cascade went on without it)
    # adaptive cascade only (`specmesh.cascade.chunk_stopping`; all 0 in a lossless one):
    num_chunks_stopped: int = 0  # chunks committed at this stage WITHOUT the target's verification (lossy)
    num_chunks_judged: int = 0  # chunks that went on and the next level verified
    num_chunks_agreed: int = 0  # of those, the next level accepted the whole chunk

    @property
    def agreement_rate(self) -> float:
        """Measured P(the next level accepts this stage's whole chunk), over the chunks that went on."""
        return self.num_chunks_agreed / self.num_chunks_judged if self.num_chunks_judged else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass
class StageCall:
    """One stage's call this round."""

    accepted: list[int]  # tokens the target emitted since this stage's last call
    draft: DraftProposal  # the lower level's proposal (a chain), cut to this stage's cap
    num_extend_tokens: int
    fill_to: int = 0  # a filling stage: its proposal's length (the level above's cap); 0 = m tokens only


@dataclass
class CascadeBook:
    """Per-session bookkeeping of a cascade (module docstring). Not thread-safe; no I/O.

    Worked example (one stage, m = 1, context 64, prompt of 10 tokens, the target's k = 4):
        start_round([t0], 4)          -> base calls [([t0], 4)]      confirmed 11, caps [4, 4]
        base proposes [a, b, c, d];   stage_call(0, ...) -> accepted [t0], draft [a, b, c, d], m 1
        the stage accepts [a, b] and recovers x: stage_done -> proposal [a, b, x] (cap 4)
        the target accepts [a] and emits y: start_round([a, y], 4) -> base calls [([a, y], 4)]
    """

    specs: list[StageSpec]
    max_contexts: list[int]  # each stage's context window, tokens
    num_confirmed: int  # prompt + every token the target emitted
    keep_q: bool  # standard sampling: q goes up with each proposal; greedy, coupled: None
    pass_agreed: bool = True  # a stage that agreed with a whole lower draft sits out while the target does (module
    # docstring); an adaptive (lossy) cascade's stopper judges every stage's chunk, so it passes none
    stats: list[StageStats] = field(default_factory=list)
    _untold: list[list[int]] = field(default_factory=list)
    _caps: list[int] = field(default_factory=list)
    _extend: list[int] = field(default_factory=list)
    _fill: list[int] = field(default_factory=list)
    _base_draft: list[int] = field(default_factory=list)
    _agreed: list[bool] = field(default_factory=list)  # stage -> it passes lower drafts by (`pass_agreed`)
    _passed: list[list[int] | None] = field(default_factory=list)  # stage -> the draft it let by last round

    def __post_init__(self):
        if len(self.specs) != len(self.max_contexts):
            raise ValueError(f"{len(self.specs)} stage specs for {len(self.max_contexts)} stages")
        self.stats = [StageStats() for _ in self.specs]
        self._untold = [[] for _ in self.specs]
        self._agreed = [False] * len(self.specs)
        self._passed = [None] * len(self.specs)

    @property
    def num_stages(self) -> int:
        return len(self.specs)

    def start_round(self, accepted: Sequence[int], max_tokens: int) -> list[tuple[list[int], int]]:
        """Take the target's news and its k; returns the base drafter's calls (tokens, max_tokens):
        every call but the last asks for 0 tokens (`split_for_base`)."""
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        accepted = [int(t) for t in accepted]
        self.num_confirmed += len(accepted)
        for i, stats in enumerate(self.stats):
            if not stats.retired:
                self._untold[i].extend(accepted)
            passed, self._passed[i] = self._passed[i], None
            if passed is not None and accepted[:len(passed)] != passed:  # the target cut the draft it let by:
                self._agreed[i] = False  # it runs again
        self._caps = [0] * self.num_stages + [max_tokens]
        self._extend = [0] * self.num_stages
        self._fill = [0] * self.num_stages
        for i in reversed(range(self.num_stages)):
            above = self._caps[i + 1]
            room = self.max_contexts[i] - self.num_confirmed
            if not self.stats[i].retired and room < 1:
                self.retire(i)
            if self.stats[i].retired or above == 0:
                self._caps[i] = above
                continue
            self._extend[i] = min(self.specs[i].num_extend_tokens, room)
            self._fill[i] = min(above, room) if self.specs[i].fill else 0
            wanted = self.specs[i].num_draft_tokens
            self._caps[i] = max(0, min(above, above if wanted is None else wanted, room - self._extend[i]))
        pieces = split_for_base(self._base_draft, accepted) if accepted else [[]]
        return [(piece, 0) for piece in pieces[:-1]] + [(pieces[-1], self._caps[0])]

    def base_proposed(self, proposal: DraftProposal) -> DraftProposal:
        """The base drafter's proposal, checked and cut to its cap."""
        if proposal.is_tree and self.num_stages:
            raise ValueError("a cascade's base drafter must propose chains, not trees")
        proposal, _ = proposal.capped(self._caps[0])
        self._base_draft = list(proposal.token_ids)
        return proposal if self.keep_q else DraftProposal(proposal.token_ids)

    def stage_call(self, index: int, lower: DraftProposal) -> StageCall | None:
        """Stage `index`'s call, or None: it sits this round out (the lower proposal goes up as is)."""
        if self._extend[index] == 0:
            return None
        draft, _ = lower.capped(self._caps[index])
        if self._agreed[index] and draft.num_tokens >= self._caps[index + 1]:  # it would pass the draft whole: sits out
            self._passed[index] = list(draft.token_ids)
            self.stats[index].num_passed += 1
            return None
        accepted, self._untold[index] = self._untold[index], []
        return StageCall(accepted, draft, self._extend[index], self._fill[index])

    def stage_done(self, index: int, call: StageCall, out: StageOutput, stage_ms: float = 0.0) -> DraftProposal:
        """The proposal stage `index` sends up: its output cut to the level above's cap."""
        if self.keep_q and out.q is None:
            raise ValueError(f"stage {index} sent no q for a sampled session")
        cap = self._caps[index + 1]
        tokens = list(out.proposal[:cap])
        stats = self.stats[index]
        stats.num_rounds += 1
        stats.num_draft_tokens += call.draft.num_tokens
        stats.num_accepted_tokens += out.num_accepted
        stats.num_proposed_tokens += len(tokens)
        stats.stage_ms += stage_ms
        whole = 0 < call.draft.num_tokens == out.num_accepted and call.draft.num_tokens >= cap  # it took all, and all fit
        self._agreed[index] = self.pass_agreed and not self.keep_q and whole
        return DraftProposal(tokens, out.q[:len(tokens)] if self.keep_q and out.q is not None else None)

    def retire(self, index: int) -> None:
        """Stage `index` takes no further part (no room left, or it failed): proposals pass it by."""
        self.stats[index].retired = True
        self._untold[index] = []
        self._agreed[index], self._passed[index] = False, None
        if self._extend:
            self._extend[index] = 0
