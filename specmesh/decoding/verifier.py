"""The target side of speculative decoding: sessions with server-side KV, verified in batches.

A `TargetSession` is one sequence in the target engine: `token_ids` is the prompt and every token
emitted since, and the engine's KV holds the first `num_cached` of them. Normally every token but
the last, the *pending* token, is cached; the next forward feeds the uncached tokens followed by the
draft, so one forward over [pending, x_0, ..., x_{k-1}] yields p_0..p_k (words as in
`specmesh.decoding.rejection`). After verification the KV is rolled back to the accepted length and
the final token becomes the new pending token. A new session has nothing cached (its first forward
is the prefill, a round with no draft); `rewind` may uncache a tail (a cascade stage whose proposal
the next stage cut short).

Worked example (greedy, prompt of 4 tokens, k = 3):
    open:    forward [t0 t1 t2 t3], argmax -> 9          KV len 4, pending 9
    verify:  forward [9, 5, 6, 7] -> argmax [5, 6, 2, 8]   accepted [5, 6], final 2 (recovered)
             KV had 4 + 4 = 8 tokens; keep 4 + 1 + 2 = 7 (t0..t3 9 5 6); pending 2

`verify_many` verifies several sessions in ONE ragged engine forward and accepts the whole batch in
one vectorised call (`specmesh.decoding.acceptance`); `verify` is the batch of one.

A session may carry a `LogitsConstraint` (e.g. a grammar): its rows are masked by `constrain`
before acceptance, so acceptance is exact for the constrained model, and `commit` is told what the
round emitted. The first token (the prefill's row) is constrained too; fork children are not.

Chunked prefill (a long prompt fed in pieces, so a service can run other sessions' rounds between
them): `begin` makes the session with nothing cached, each `prefill_chunk` caches the next piece (a
forward that asks for no logits) but never the last prompt token, and the final
`verify(session, empty proposal)` feeds what is left and samples the first token, as `open` does.
Prompt of 10 tokens, chunks of 4:
    begin:                    cached 0
    prefill_chunk(4):         forward [t0 t1 t2 t3]      cached 4, uncached t4..t9
    prefill_chunk(4):         forward [t4 t5 t6 t7]      cached 8, uncached t8 t9
    verify(empty proposal):   forward [t8 t9], sample    cached 9, pending = the first token

Plain steps ahead (`plain_next`, on an engine whose forwards return before their kernels ran: CUDA).
A caller whose session's next round is plain (no draft: plain decoding, a Verify service's target-only
rounds) says so, and the verifier launches that next forward, [pending], before it returns this round:
the device computes it while the caller streams this round's tokens, records its state and comes back.
The next `verify` of that session with an empty proposal takes the launched forward's logits instead of
running one; anything else done to the session first (a draft to verify, a fork, a rewind, unverified
tokens, a batch with others, close) drops it and truncates its KV slot. A greedy round that takes a
launched forward launches the next one before it even reads its own token: the argmax stays on the
device and is the next step's input (`NativeEngine.forward`'s `feed`), so the device runs step after
step while the host reads each token behind it. Other rounds (sampled, constrained) launch it once
they know the pending token: the device then waits for that read and the launch, not for the caller.
Only when a forward runs changes: its input, and so every token, is the same.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from specmesh.decoding.acceptance import accept_batch
from specmesh.decoding.adaptive import ForwardCost, LinearCostFit
from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.rejection import verify_greedy
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.tree import tree_forward_input
from specmesh.decoding.types import NO_PARENT, VerifyOutcome
from specmesh.models.engine import ContextLengthError, Engine, SeqInput


class LogitsConstraint(Protocol):
    """Per-session state of an output constraint; called on the engine thread."""

    def constrain(self, rows: torch.Tensor, proposal: DraftProposal) -> torch.Tensor:
        """rows [1 + k, vocab]: the target's logits after the pending token and after each draft node
        -> the same rows with the refused tokens at -inf."""
        ...

    def commit(self, token_ids: Sequence[int]) -> None:
        """The round emitted `token_ids` (accepted draft tokens, then the final token)."""
        ...


@dataclass
class TargetSession:
    seq_id: int
    params: SamplingParams
    generator: torch.Generator
    token_ids: list[int]  # prompt + emitted tokens; after the first forward the last one is pending
    num_cached: int = 0  # leading token_ids held in the engine's KV
    num_forwards: int = 0  # target forwards this session took part in
    constraint: LogitsConstraint | None = None  # masks this session's rows (module docstring)
    group: int | None = None  # forks laid out in one sequence share it (engine.py: layouts)

    @property
    def pending_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncached(self) -> int:
        """Tokens the next forward feeds before any draft (the pending one last)."""
        return len(self.token_ids) - self.num_cached


def validate_prompt(prompt_ids: Sequence[int], max_context: int, vocab_size: int | None = None) -> list[int]:
    """The prompt as a list of ints, or ValueError / ContextLengthError naming what is wrong: the one
    prompt check of every entry point (library, services)."""
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt must have at least one token")
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in prompt):
        bad = next(t for t in prompt if not 0 <= t < vocab_size)
        raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")
    if len(prompt) >= max_context:
        raise ContextLengthError(f"prompt of {len(prompt)} tokens leaves no room in the {max_context}-token context")
    return prompt


TRUNK_MIN_TOKENS = 8  # a common head of children's appends at least this long is prefilled once (`fork`)
# each of the engine's measured forwards (`EngineStats.round_timings`) enters the verifier's fit as this many
# observations: about 4 requests' worth of probes before rounds outweigh them
ROUND_COST_SEED_WEIGHT = 4.0


def shared_head(appends: Sequence[Sequence[int]]) -> int:
    """How many leading tokens every append shares, leaving each at least one token of its own (a
    child's first token is sampled after its own last token).

    >>> shared_head([[1, 2, 3, 4], [1, 2, 3, 9], [1, 2, 5]])
    2
    >>> shared_head([[1, 2], [1, 2]])
    1
    """
    head = min(len(a) for a in appends) - 1
    for i in range(max(head, 0)):
        if any(a[i] != appends[0][i] for a in appends):
            return i
    return max(head, 0)


@dataclass
class _Ahead:
    """A session's next plain forward, launched ahead (module docstring)."""

    length: int  # the sequence's length in the engine before it
    feed: list[int]  # its input: the session's uncached tokens, the pending one last (fed on the device: set once read)
    logits: torch.Tensor  # [1, vocab] on the device, possibly still being computed
    launched: float  # perf_counter() once launched


class _Readback:
    """Reads a one-element device tensor back once the work queued before it is done, not the work
    queued after it (a plain `.item()` waits for the whole stream): a copy into pinned host memory and an
    event. On the CPU, the value."""

    def __init__(self, device: torch.device):
        self.device = device
        self._host: torch.Tensor | None = None  # pinned, reused: each copy is waited for before the next

    def start(self, value: torch.Tensor):
        """Queue the copy of `value`; returns the call that waits for it and gives the int."""
        if self.device.type != "cuda":
            return lambda: int(value.reshape(()))
        if self._host is None:
            self._host = torch.empty(1, dtype=value.dtype, pin_memory=True)
        host = self._host
        with torch.cuda.device(self.device):
            host.copy_(value.reshape(1), non_blocking=True)
            done = torch.cuda.Event()
            done.record()

        def wait() -> int:
            done.synchronize()
            return int(host[0])
        return wait


class TargetVerifier:
    """Owns sessions on one target engine. Not thread-safe: one engine thread calls it."""

    def __init__(self, engine: Engine, plain_ahead: bool | None = None):
        """plain_ahead: launch a session's next plain forward early when its caller says the next round is
        plain (module docstring); default on where the engine's forwards run asynchronously (CUDA)."""
        self.engine = engine
        self.plain_ahead = bool(getattr(engine, "launches_ahead", False)) if plain_ahead is None else plain_ahead
        self._ahead: dict[int, _Ahead] = {}  # seq_id -> its launched next plain forward
        self.num_ahead_launched = 0
        self.num_ahead_taken = 0
        self._readback = _Readback(engine.device)
        self._last_read = 0.0  # perf_counter() when a launched forward's outcome was last read
        # forward ms ~ fixed + per token * tokens over verify rounds (not prefills): the cost a draft token
        # adds, which adaptive k weighs (on a compute-bound low-bit CPU target it is far from the prior)
        self._round_costs = LinearCostFit(min_spread_tokens=0.3)
        self._round_costs_seeded = False  # with the engine's measured forwards (`forward_cost`)
        # False while forwards run with more threads than the caller's verify rounds get (a Verify service
        # borrowing the Draft service's cores for plain Runs): those would read as cheap tokens beside dear ones
        self.fit_round_costs = True

    def forward_cost(self, batch_size: int = 1) -> ForwardCost | None:
        """The fitted cost of this engine's verify forwards: from the engine's measured `round_timings` on, rounds
        observed folded in (None while neither is known: no measurement, and no rounds of different sizes)."""
        self._seed_round_costs()
        return self._round_costs.cost(batch_size)

    def _seed_round_costs(self) -> None:
        """Seed the fit once the engine's forwards are measured (`measure_step` may run after this verifier is made)."""
        measured = None if self._round_costs_seeded else getattr(self.engine.stats, "round_timings", None)
        if measured is not None:
            self._round_costs.seed(measured, weight=ROUND_COST_SEED_WEIGHT)
            self._round_costs_seeded = True

    def max_draft_tokens(self, session: TargetSession) -> int:
        """How many draft tokens still fit in the context window after the pending token."""
        return max(0, self.engine.max_context - session.num_tokens)

    def open(self, prompt_ids: Sequence[int], params: SamplingParams, generator: torch.Generator) -> TargetSession:
        return self.open_many([prompt_ids], [params], [generator])[0]

    def open_many(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator],
    ) -> list[TargetSession]:
        """Prefill several prompts in one forward; each session gets its first target token."""
        checked = [validate_prompt(prompt, self.engine.max_context, self.engine.vocab_size) for prompt in prompts]
        sessions: list[TargetSession] = []
        try:
            for prompt, p, g in zip(checked, params, generators):
                sessions.append(TargetSession(self.engine.new_sequence(), p, g, prompt))
            self.verify_many(sessions, [DraftProposal(token_ids=[])] * len(sessions))
        except BaseException:
            for session in sessions:
                self.engine.free(session.seq_id)
            raise
        return sessions

    def begin(self, prompt_ids: Sequence[int], params: SamplingParams, generator: torch.Generator) -> TargetSession:
        """A new session with its whole prompt uncached and no forward run yet (chunked prefill, module
        docstring): the caller feeds it with `prefill_chunk` and `verify`, and closes it if a step fails."""
        prompt = validate_prompt(prompt_ids, self.engine.max_context, self.engine.vocab_size)
        return TargetSession(self.engine.new_sequence(), params, generator, prompt)

    def prefill_chunk(self, session: TargetSession, max_tokens: int) -> int:
        """Cache up to `max_tokens` more of the session's uncached tokens, never the last one (the
        forward that feeds it samples the next token); returns how many stay uncached. A failed
        forward leaves the session as it was (the engine rolls it back)."""
        if max_tokens < 1:
            raise ValueError(f"a prefill chunk needs at least one token, got {max_tokens}")
        num_fed = min(max_tokens, session.num_uncached - 1)
        if num_fed > 0:
            start = session.num_cached
            self.engine.forward([SeqInput(session.seq_id, session.token_ids[start:start + num_fed], [])])
            session.num_cached += num_fed
            session.num_forwards += 1
        return session.num_uncached

    def verify(self, session: TargetSession, proposal: DraftProposal, keep_logits: bool = False,
               plain_next: bool = False) -> VerifyOutcome:
        return self.verify_many([session], [proposal], keep_logits, plain_next)[0]

    def verify_many(self, sessions: Sequence[TargetSession], proposals: Sequence[DraftProposal],
                    keep_logits: bool = False, plain_next: bool = False) -> list[VerifyOutcome]:
        """Verify each session's proposal (an empty one = plain decoding) in one engine forward.
        `keep_logits` puts the logits that judged each emitted token in `VerifyOutcome.logits`.
        `plain_next`: the caller's next round of this one session is plain (module docstring: plain steps
        ahead)."""
        inputs = [self._forward_input(s, pr) for s, pr in zip(sessions, proposals)]
        launched = self._take_ahead(sessions, inputs)
        if launched is not None and sessions[0].params.is_greedy and sessions[0].constraint is None:
            return [self._greedy_round_ahead(sessions[0], launched, keep_logits, plain_next)]
        if launched is not None:
            logits = [launched.logits]
        else:
            start = time.perf_counter()
            logits = self.engine.forward(inputs)
            num_fed = sum(len(item.token_ids) for item in inputs)
            if self.fit_round_costs and num_fed == sum(1 + proposal.num_tokens for proposal in proposals):  # rounds only
                self._seed_round_costs()
                ms = (time.perf_counter() - start) * 1e3
                self._round_costs.observe(num_fed, ms)
                if len(sessions) == 1 and num_fed > 1:
                    self._record_chain_as_step(num_fed, ms)
        logits = [rows if s.constraint is None else s.constraint.constrain(rows, pr)
                  for s, pr, rows in zip(sessions, proposals, logits)]
        outcomes = accept_batch(logits, proposals, [s.params for s in sessions], [s.generator for s in sessions],
                                [s.num_tokens for s in sessions])  # row 0 samples position num_tokens (coupled rule)
        for session, proposal, outcome, rows in zip(sessions, proposals, outcomes, logits):
            self._advance(session, proposal, outcome)
            if session.constraint is not None:
                session.constraint.commit(outcome.token_ids)
            if keep_logits:
                outcome.logits = rows[outcome.judging_rows]
        if launched is not None:
            self._record_step(launched)
        if plain_next and self.plain_ahead and len(sessions) == 1:
            self._launch_ahead(sessions[0])
        return outcomes

    def _greedy_round_ahead(self, session: TargetSession, launched: _Ahead, keep_logits: bool,
                            plain_next: bool) -> VerifyOutcome:
        """A greedy plain round that takes a launched forward: its token is the argmax on the device (the
        op greedy acceptance runs, `_accept_greedy`), and the next step, fed that token on the device, is
        launched before the host reads it, so the device goes from one step to the next without waiting
        for the host."""
        rows = launched.logits
        token = rows.argmax(dim=-1)  # [1]
        read = self._readback.start(token)
        if plain_next and self.plain_ahead:
            self._launch_ahead(session, feed=token)
        outcome = verify_greedy([], [read()])
        self._advance(session, DraftProposal(token_ids=[]), outcome)
        next_ahead = self._ahead.get(session.seq_id)
        if next_ahead is not None:
            next_ahead.feed = [outcome.final_token_id]  # what the device fed it
        self._record_step(launched)
        if keep_logits:
            outcome.logits = rows[outcome.judging_rows]
        return outcome

    def _record_chain_as_step(self, num_fed: int, ms: float) -> None:
        """A lone session's verify chain of `num_fed` tokens, as the one-token step it implies at the fitted
        costs, into the engine's step: where every round drafts no one-token forward runs, and the step a
        caller prices its next request's drafts against (`AdaptiveK.prior_costs`) went stale while the
        machine's load moved (measured: a bf16 self-draft's fresh 12.4 ms against the Verify service's 17.6
        from before the load, where steps took 24: the request was priced below the draft gate and decoded
        plainly). The engine caps what one timing moves (`EngineStats`)."""
        cost = self._round_costs.cost(1)
        if cost is None:
            return
        one = cost.fixed_ms + cost.ms_per_token
        if one > 0:
            self.engine.stats.record_step(ms * one / (cost.fixed_ms + cost.ms_per_token * num_fed))

    def _record_step(self, launched: _Ahead) -> None:
        """A launched forward's outcome is read: its step took at most the time since it was launched, or
        since the step before it was read (an upper bound where the caller came late)."""
        now = time.perf_counter()
        self.engine.stats.record_step((now - max(launched.launched, self._last_read)) * 1e3)
        self._last_read = now

    def _launch_ahead(self, session: TargetSession, feed: torch.Tensor | None = None) -> None:
        """Launch the session's next plain forward (module docstring): on its pending token, or (`feed`)
        on the token the device holds, which becomes the pending token once read. None for a session in a
        group (its forwards share a layout with the group's), or where the forward fails (the context is
        full, no KV block is free: the round that needs it runs it and reports that)."""
        if session.group is not None:
            return
        item = (SeqInput(session.seq_id, [0], [0]) if feed is not None  # the id is the device's (`NativeEngine.forward`)
                else self._forward_input(session, DraftProposal(token_ids=[])))
        length = self.engine.seq_len(session.seq_id)
        try:
            logits = self.engine.forward([item], timed=False, feed=feed)[0]  # type: ignore[call-arg]
        except Exception:  # noqa: BLE001 - see above
            return
        self._ahead[session.seq_id] = _Ahead(length, list(item.token_ids), logits, time.perf_counter())
        self.num_ahead_launched += 1

    def _take_ahead(self, sessions: Sequence[TargetSession], inputs: Sequence[SeqInput]) -> _Ahead | None:
        """The launched forward this batch of one plain round takes, if any; every other launched forward
        of these sessions is dropped (`_drop_ahead`)."""
        if len(sessions) == 1 and (ahead := self._ahead.pop(sessions[0].seq_id, None)) is not None:
            item = inputs[0]
            if (item.token_ids == ahead.feed and list(item.logits_at) == [len(ahead.feed) - 1] and item.parents is None
                    and self.engine.seq_len(item.seq_id) == ahead.length + len(ahead.feed)):
                self.num_ahead_taken += 1
                return ahead
            self.engine.truncate(item.seq_id, ahead.length)
        for session in sessions:
            self._drop_ahead(session)
        return None

    def _drop_ahead(self, session: TargetSession) -> None:
        """Forget the session's launched forward and truncate the KV it appended."""
        ahead = self._ahead.pop(session.seq_id, None)
        if ahead is not None:
            self.engine.truncate(session.seq_id, ahead.length)

    def fork(
        self,
        parent: TargetSession,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator],
        append_token_ids: Sequence[int] = (),
        num_prefix_tokens: int | None = None,
        one_sequence: bool = False,
        child_appends: Sequence[Sequence[int]] | None = None,
    ) -> list[TargetSession]:
        """Child sessions sharing the parent's KV (copy-on-write), one per params/generator.

        Children start where the parent is (same tokens, same pending token). With `append_token_ids`,
        one forward over all children feeds [pending, *append_token_ids] and samples each child's next
        token under its own params — e.g. Skeleton-of-Thought branches that each begin with their
        point's header. With `num_prefix_tokens` = n, children keep only the parent's first n tokens
        (`rewind`) before the append, which is then required: e.g. a branch prompt that shares the
        skeleton session's first n tokens. The parent is unchanged either way.

        `child_appends` instead gives one non-empty list per child (each child its own tail, e.g. each
        branch its own point prompt); the children's first tokens still come from one forward. When those
        tails begin with a common head of at least TRUNK_MIN_TOKENS tokens (the instruction every
        point prompt shares), the head is prefilled once, in a trunk sequence the children fork from,
        and each child's forward feeds only its own rest: 2 forwards, head + sum of the rests tokens,
        instead of 1 forward of every child's whole tail.

        `one_sequence`: the children are regions of one sequence with the parent's prefix (engine.py:
        layouts), so their forwards (and the parent's) share one attention row; otherwise each is a
        sequence of its own ("batching"). Either layout gives each child the same tokens.
        """
        if child_appends is not None:
            if append_token_ids:
                raise ValueError("set append_token_ids or child_appends, not both")
            appends = [[int(t) for t in tail] for tail in child_appends]
            if len(appends) != len(params) or not all(appends):
                raise ValueError(f"child_appends needs one non-empty list per child: {len(params)} children, "
                                 f"{sum(map(bool, appends))} of {len(appends)} lists non-empty")
        else:
            appends = [[int(t) for t in append_token_ids]] * len(params)
        self._drop_ahead(parent)
        num_prefix = parent.num_tokens if num_prefix_tokens is None else num_prefix_tokens
        if not 1 <= num_prefix <= parent.num_tokens:
            raise ValueError(f"num_prefix_tokens must be in [1, {parent.num_tokens}], got {num_prefix}")
        if num_prefix < parent.num_tokens and not all(appends):
            raise ValueError("children cut to a prefix of the parent need append_token_ids to sample from")
        if num_prefix + max(map(len, appends), default=0) > self.engine.max_context:
            raise ContextLengthError(f"{max(map(len, appends))} appended tokens do not fit in the context window")
        children: list[TargetSession] = []
        group = None
        if one_sequence:
            group = parent.group = parent.seq_id if parent.group is None else parent.group
        trunk = None
        try:
            origin = parent
            head = shared_head(appends) if len(appends) > 1 else 0
            if head >= TRUNK_MIN_TOKENS:  # the appends' common head: one forward for all children
                trunk = origin = self._trunk(parent, [*parent.token_ids[:num_prefix], *appends[0][:head]], group)
            for child_params, generator, append in zip(params, generators, appends):
                child = TargetSession(self.engine.fork(origin.seq_id), child_params, generator, list(origin.token_ids),
                                      origin.num_cached, group=group)
                children.append(child)
                if trunk is not None:
                    child.token_ids.extend(append[head:])
                elif num_prefix < parent.num_tokens:
                    self.rewind(child, [*parent.token_ids[:num_prefix], *append])
                else:
                    child.token_ids.extend(append)
            if any(appends):
                self.verify_many(children, [DraftProposal(token_ids=[])] * len(children))
        except BaseException:
            for child in children:
                self.engine.free(child.seq_id)
            raise
        finally:
            if trunk is not None:
                self.engine.free(trunk.seq_id)  # its blocks live on in the children
        return children

    def _trunk(self, parent: TargetSession, token_ids: list[int], group: int | None) -> TargetSession:
        """A fork of `parent` holding `token_ids` (the parent's prefix and the children's common head) all
        cached: one forward that samples nothing. The children fork from it; `fork` frees it."""
        trunk = TargetSession(self.engine.fork(parent.seq_id), parent.params, parent.generator, list(parent.token_ids),
                              parent.num_cached, group=group)
        try:
            self.rewind(trunk, token_ids)
            self.engine.forward([SeqInput(trunk.seq_id, trunk.token_ids[trunk.num_cached:], [], group=group)])
        except BaseException:
            self.engine.free(trunk.seq_id)
            raise
        trunk.num_cached = trunk.num_tokens
        return trunk

    def rewind(self, session: TargetSession, token_ids: Sequence[int]) -> None:
        """Make the session's sequence `token_ids`: the KV keeps the longest cached prefix the two
        share, and the next forward feeds the rest (at least the last token).

        Worked example: token_ids [p0 p1 a b x] with 4 cached (x pending); rewind to [p0 p1 a y z]
        -> 3 stay cached (p0 p1 a), the next forward feeds [y, z, *draft]."""
        self._drop_ahead(session)
        new = [int(t) for t in token_ids]
        if not new or len(new) > self.engine.max_context:
            raise ContextLengthError(f"a sequence of {len(new)} tokens does not fit in the {self.engine.max_context}-token context")
        common = 0
        limit = min(session.num_cached, len(new) - 1)
        while common < limit and session.token_ids[common] == new[common]:
            common += 1
        self.engine.truncate(session.seq_id, common)
        session.token_ids, session.num_cached = new, common

    def append_unverified(self, session: TargetSession, token_ids: Sequence[int]) -> None:
        """Extend the sequence by tokens taken without verification (a lossy cascade's committed chunk,
        a Verify request's forced tokens): no forward now; the next forward feeds them before its
        draft, and the last one becomes the pending token.

        Worked example: [p0 p1 x] with 2 cached (x pending); append [a, b] -> [p0 p1 x a b], 2 cached;
        the next verify feeds [x, a, b, *draft] and judges the draft from b's row on."""
        self._drop_ahead(session)
        tokens = [int(t) for t in token_ids]
        if any(not 0 <= t < self.engine.vocab_size for t in tokens):
            raise ValueError(f"unverified token ids must lie in [0, {self.engine.vocab_size})")
        if tokens and session.constraint is not None:
            raise ValueError("a constrained session (grammar) cannot take unverified tokens")
        if session.num_tokens + len(tokens) > self.engine.max_context:
            raise ContextLengthError(f"{len(tokens)} unverified tokens do not fit in the context window "
                                     f"({session.num_tokens} of {self.engine.max_context} tokens used)")
        session.token_ids.extend(tokens)

    def close(self, session: TargetSession) -> None:
        self._ahead.pop(session.seq_id, None)
        self.engine.free(session.seq_id)

    def _forward_input(self, session: TargetSession, proposal: DraftProposal) -> SeqInput:
        """[uncached tokens (the pending one last), *draft]; logits from the pending token on."""
        if proposal.unverified:
            raise ValueError("an unverified chunk is committed by the driver (append_unverified), never verified")
        if proposal.num_tokens > self.max_draft_tokens(session):
            raise ContextLengthError(
                f"{proposal.num_tokens} draft tokens exceed the context window "
                f"({session.num_tokens} of {self.engine.max_context} tokens used)"
            )
        proposal.validate(self.engine.vocab_size)
        uncached = session.token_ids[session.num_cached:]
        if not uncached:
            raise RuntimeError("a session always has its pending token uncached")
        first = len(uncached) - 1  # index of the pending token in the feed
        if not proposal.is_tree:
            tokens = [*uncached, *proposal.token_ids]
            return SeqInput(session.seq_id, tokens, list(range(first, len(tokens))), group=session.group)
        tree_tokens, tree_parents = tree_forward_input(uncached[-1], proposal.token_ids, proposal.tree_parents())
        chain = [NO_PARENT, *range(first - 1)] if first else []  # uncached tokens before the pending one
        parents = [*chain, first - 1 if first else NO_PARENT, *(p + first for p in tree_parents[1:])]
        tokens = [*uncached[:-1], *tree_tokens]
        return SeqInput(session.seq_id, tokens, list(range(first, len(tokens))), parents, session.group)

    def _advance(self, session: TargetSession, proposal: DraftProposal, outcome: VerifyOutcome) -> None:
        """Roll the KV back to the accepted path; the final token becomes the pending one."""
        fed = session.num_tokens - session.num_cached  # uncached tokens fed before the draft
        if proposal.is_tree:
            kept = [*range(fed), *(fed + node for node in outcome.accepted_nodes)]
            self.engine.keep_tree_path(session.seq_id, kept)
        elif proposal.num_tokens:  # a plain round's KV is its length already (and may hold a step launched ahead)
            self.engine.truncate(session.seq_id, session.num_cached + fed + outcome.num_accepted)
        session.token_ids.extend(outcome.token_ids)
        session.num_cached = session.num_tokens - 1
        session.num_forwards += 1
