"""Model drafter: any engine-loaded model proposes k tokens autoregressively.

Used with a small model, or with the target's own weights at lower precision ("self-draft": bf16,
int8 dynamic quantization), which agrees with the fp32 target on most tokens at a fraction of the cost.

KV bookkeeping. The drafter's KV holds the context except the tokens in `pending` (at least the
last one). Proposing feeds `pending`, samples x_0, feeds x_0, samples x_1, ... and samples x_{k-1}
without feeding it. So after a proposal the KV holds context + x_0..x_{k-2}, and `base_len` records
where the drafts start. The next call learns that the target accepted n drafts and emitted a final
token: the drafts x_0..x_{min(n, k-1)-1} are already in the KV and stay; the rest is truncated.

Worked example (k = 3, context of 10 tokens, pending = [c9]):
    propose: feed [c9] -> x0; feed [x0] -> x1; feed [x1] -> x2      KV: c0..c9 x0 x1 (12), base_len 10
    target accepts 2 drafts + final f: accepted_since_last = [x0, x1, f]
    next propose: keep = min(2, 3 - 1) = 2 -> truncate KV to 12, pending = [f]
    if it had accepted 3 (all): keep = 2, pending = [x2, b] (x2 was never fed)

`propose_many` drafts for several sessions with one engine forward per draft position.

KV from the target (`kv_source`: a self-draft, the target's weights at a lower precision, in the same
process). What the drafter has not fed yet but the target has (the prompt at the first proposal, a plain
stretch's tokens after rounds that drafted nothing, the last draft of an accepted proposal) is copied from
the target's KV (`NativeEngine.import_kv`) instead of fed, when the driver tied the session to the
target's (`share_kv`): only the last pending token is fed, for the logits the first draft comes from.
Measured: the bf16 drafter's prefill of a 54-token chat prompt took 110 ms of a 1.17 s request (64 tokens,
k = 4). The drafts then come from a context the target computed, which changes which tokens are drafted,
never what is emitted (the target verifies every one).

Drafting ahead (`draft_ahead_step`). While the target verifies a proposal x_0..x_{k-1}, the drafter
may go on as if the target accepts all k and then emits the drafter's own guess g at the next
position: one forward feeds x_{k-1} to make g, then it drafts y_0, y_1, ... exactly as the next
`propose` would after `accepted_since_last = [x_0..x_{k-1}, g]`: that call would feed [x_{k-1}, g]
together. On an engine whose steps equal its chains bit for bit (`NativeEngine.steps_equal_chains`:
the CPU fast path) the guess forward's KV of x_{k-1} is what that chain would write, so it stays and
the first draft ahead feeds g alone: one forward of two rows fewer per round. Elsewhere the guess
forward is truncated away and the first draft ahead feeds [x_{k-1}, g]. Each later one feeds the
previous draft. When the next call brings exactly x_0..x_{k-1}, g, the first
min(k', drafted) of the y's are the proposal and drafting goes on from there; otherwise the ahead
KV is truncated, the session's generator is put back to its state before the first ahead draw, and
the call proceeds as if nothing had been drafted ahead. Either way a proposal is the one drafting
without looking ahead makes (same forwards, same KV, same generator draws), so drafting ahead
changes when drafts are computed, never what they are, and a seeded run does not depend on timing.

Sampling. With the standard rule a draft token is drawn from q with the session's generator and q
goes with the proposal (the verifier's test reads it). With the coupled rule
(`specmesh.decoding.coupled`) the token at absolute position t (the context length before drafting,
plus its index in the draft) is the coupled sample of q under the noise of (seed, t), the noise the
target samples that position with; the verifier reads no q, so the proposal carries none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specmesh.decoding.coupled import sample_at
from specmesh.decoding.proposal import DraftProposal, normalize_q
from specmesh.decoding.sampling import SamplingParams, processed_probs, sample
from specmesh.decoding.state import draft_seed
from specmesh.kv.shared import AttachedKV
from specmesh.models.engine import Engine, SeqInput
from specmesh.models.native_engine import NativeEngine


@dataclass
class ModelDraftState:
    seq_id: int
    pending: list[int]  # tokens of the context not yet in the drafter's KV
    base_len: int = 0  # KV length where the last proposal's drafts start
    num_drafted: int = 0  # k of the last proposal (0 = none outstanding)
    num_tokens: int = 0  # context length (KV + pending) before drafting
    last_drafts: list[int] = field(default_factory=list)  # the last proposal's tokens
    ahead: DraftAhead | None = None  # drafts made past the last proposal, awaiting the target's verdict
    guess_held: bool | None = None  # at the last proposal: whether the verdict was the guess ahead (None: no guess)
    kv_from: int | None = None  # the target's sequence of the same context, whose KV it may take (`share_kv`)
    kv_source: NativeEngine | AttachedKV | None = None  # where `kv_from` lives: the drafter's kv_source, or another's


@dataclass
class DraftAhead:
    """What `ModelDrafter.draft_ahead_step` drafted past the last proposal (module docstring)."""

    guess: int  # the drafter's guess at the target's token after the last proposal
    depth: int  # how many tokens to draft ahead
    transform: object  # the q transform they were drawn with: a hit needs the same
    before: torch.Tensor | None  # the generator's state before the first ahead draw (None: draws use none)
    kept_last: bool = False  # the guess forward's KV of the last draft stayed (steps equal chains): feed the guess alone
    tokens: list[int] = field(default_factory=list)
    qs: list[torch.Tensor] = field(default_factory=list)
    after: list[torch.Tensor] = field(default_factory=list)  # the generator's state after each draw


class ModelDrafter:
    """Drafts with a model on an `Engine`. Not thread-safe: one engine thread calls it.

    `q_transform` (e.g. `specmesh.drafters.wire_q.RoundQ`) maps each processed q row to the form it
    is stored and sent in; the draft token is then drawn from `normalize_q` of that form, so the
    proposal's q is exactly what was sampled from. Drafters with different transforms may share an
    engine and serve the same session states."""

    name = "model"

    def __init__(self, engine: Engine, q_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 kv_source: Engine | None = None):
        """`kv_source`: the target's engine, when this engine holds the same model (a self-draft): its KV may
        stand in for context this drafter has not fed (module docstring)."""
        if kv_source is not None and not (isinstance(engine, NativeEngine) and isinstance(kv_source, NativeEngine)):
            raise ValueError("kv_source needs native engines on both sides (NativeEngine.import_kv)")
        self.engine = engine
        self.device = engine.device  # where its generators must live
        self.q_transform = q_transform
        self.kv_source = kv_source
        self.ahead_served = 0  # tokens drafted ahead that became a proposal's
        self.ahead_dropped = 0  # tokens drafted ahead that the verdict (or a smaller k) made useless
        self.kv_taken = 0  # context tokens whose KV was copied from the target (`share_kv`), not fed

    @property
    def ms_per_token(self) -> float | None:
        """What a draft token costs here, as far as this process knows: its engine's one-token forward
        time (`EngineStats.step_ms`; None until one ran). A k policy's prior (`AdaptiveK.prior_costs`)."""
        return self.engine.stats.step_ms

    @property
    def catch_up_ms_per_token(self) -> float | None:
        """What taking in a token it was not told costs here: its engine's prefill ms per token
        (`EngineStats.prefill_ms_per_token`; None until a prefill ran). A k policy's prior for a probe's catch-up."""
        return self.engine.stats.prefill_ms_per_token

    def open(self, prompt_ids: Sequence[int]) -> ModelDraftState:
        """The prompt is prefilled lazily with the first proposal (it rides in the same forward)."""
        seq_id = self.engine.new_sequence()
        return ModelDraftState(seq_id=seq_id, pending=list(map(int, prompt_ids)), num_tokens=len(prompt_ids))

    def close(self, state: ModelDraftState) -> None:
        self.engine.free(state.seq_id)

    def share_kv(self, state: ModelDraftState, target_seq_id: int, source: AttachedKV | None = None) -> None:
        """Tie the session to the target's sequence `target_seq_id` of `source` (default: this drafter's
        `kv_source`), which holds the same context: from now on what it caches there is taken, not fed
        (module docstring)."""
        if source is None and self.kv_source is None:
            raise ValueError("this drafter has no kv_source")
        if source is not None and not isinstance(self.engine, NativeEngine):
            raise ValueError("taking KV needs a native engine (NativeEngine.import_kv)")
        state.kv_from, state.kv_source = target_seq_id, source if source is not None else self.kv_source

    def _take_kv(self, state: ModelDraftState) -> None:
        """Copy from the target the KV of what is pending, all but its last token, as far as the target has it."""
        engine, source = self.engine, state.kv_source
        if state.kv_from is None or source is None or len(state.pending) < 2:
            return
        assert isinstance(engine, NativeEngine)  # (__init__, share_kv)
        cached = engine.seq_len(state.seq_id)
        take = min(len(state.pending) - 1, source.seq_len(state.kv_from) - cached)
        if take > 0:
            engine.import_kv(state.seq_id, source, state.kv_from, cached + take)
            if isinstance(source, AttachedKV) and not source.intact(state.kv_from):  # a block went back to the
                engine.truncate(state.seq_id, cached)  # writer's pool during the copy: its rows may be another's
                return
            state.pending = state.pending[take:]
            self.kv_taken += take

    def prefill(self, states: Sequence[ModelDraftState]) -> None:
        """Take in now what the next proposal would feed first (a session's prompt, say), all but its last
        token, in one forward for the states that have no draft outstanding: a Draft service on cores of its
        own does this at open, beside the target's prefill, so the first proposal feeds one or two tokens.
        The drafts are those a proposal feeding it all at once makes (the same context in the KV)."""
        chosen = [s for s in states if not s.num_drafted and s.ahead is None and len(s.pending) > 1]
        if not chosen:
            return
        self.engine.forward([SeqInput(s.seq_id, s.pending[:-1], []) for s in chosen])
        for state in chosen:
            state.pending = state.pending[-1:]

    def check_call(self, state: ModelDraftState, accepted_since_last: Sequence[int], max_tokens: int) -> None:
        """After a proposal of k tokens, the next call must bring the accepted ones and the target's
        own token (1 to k + 1 tokens); a proposal needs something to feed."""
        n = len(accepted_since_last)
        if state.num_drafted and not 1 <= n <= state.num_drafted + 1:
            raise ValueError(f"after a draft of {state.num_drafted} tokens, accepted_token_ids must hold the accepted "
                             f"draft tokens and the target's token (1 to {state.num_drafted + 1} tokens), got {n}")
        if max_tokens and not state.num_drafted and not state.pending and not n:
            raise ValueError("nothing to draft from: send the tokens accepted since the last call")

    def propose(
        self,
        state: ModelDraftState,
        accepted_since_last: Sequence[int],
        max_tokens: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> DraftProposal:
        return self.propose_many([state], [accepted_since_last], [max_tokens], [params], [generator])[0]

    def propose_many(
        self,
        states: Sequence[ModelDraftState],
        accepted: Sequence[Sequence[int]],
        max_tokens: Sequence[int],
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator],
    ) -> list[DraftProposal]:
        for state, tokens, k in zip(states, accepted, max_tokens):
            self.check_call(state, tokens, k)  # all, before any state moves
        for state, tokens in zip(states, accepted):
            ahead = state.ahead
            state.guess_held = None if ahead is None else list(map(int, tokens)) == [*state.last_drafts, ahead.guess]
        hits = [self._ahead_hit(s, k) for s, k in zip(states, max_tokens)]
        for state, tokens, generator, hit in zip(states, accepted, generators, hits):
            if hit:  # _take_ahead moves the KV and pending below
                state.num_tokens += len(tokens)
            else:
                self.drop_ahead(state, generator)
                self._absorb(state, tokens)
                self._take_kv(state)
        limits = [max(0, min(k, self.engine.max_context - s.num_tokens)) for s, k in zip(states, max_tokens)]
        drafts: list[list[int]] = [[] for _ in states]
        qs: list[list[torch.Tensor]] = [[] for _ in states]
        for i, (state, generator) in enumerate(zip(states, generators)):
            if hits[i]:
                drafts[i], qs[i] = self._take_ahead(state, generator, limits[i])
        for position in range(max(limits, default=0)):
            active = [i for i, limit in enumerate(limits) if len(drafts[i]) == position < limit]
            if not active:  # only sessions served from their drafts ahead are this far yet
                continue
            inputs = []
            for i in active:
                state = states[i]
                feed = state.pending if position == 0 else [drafts[i][-1]]
                inputs.append(SeqInput(state.seq_id, list(feed), [len(feed) - 1]))
            logits = self.engine.forward(inputs)
            for i, row in zip(active, logits):
                token, q = self._draw(row, params[i], generators[i], states[i].num_tokens + position)
                drafts[i].append(token)
                if q is not None:
                    qs[i].append(q)
        proposals = []
        for i, state in enumerate(states):
            if limits[i] > 0:
                state.base_len = state.num_tokens  # the pending tokens were fed at position 0
                state.pending = []
            state.num_drafted = limits[i]
            state.last_drafts = drafts[i]
            q = torch.stack(qs[i]) if qs[i] else None
            proposals.append(DraftProposal(token_ids=drafts[i], q=q))
        return proposals

    # drafting ahead (module docstring)
    def wants_ahead(self, state: ModelDraftState, depth: int) -> bool:
        """Whether `draft_ahead_step` has a forward to run for this state, drafting `depth` tokens ahead."""
        if not state.num_drafted or depth < 1:
            return False
        ahead = state.ahead
        drafted = 0 if ahead is None else len(ahead.tokens)
        if ahead is not None and drafted >= ahead.depth:
            return False
        return state.base_len + state.num_drafted + 1 + drafted < self.engine.max_context

    def draft_ahead_step(self, states: Sequence[ModelDraftState], depths: Sequence[int],
                         params: Sequence[SamplingParams], generators: Sequence[torch.Generator]) -> None:
        """One engine forward for every state that `wants_ahead`: the guess at the target's token if it
        has none yet, else the next draft past it."""
        chosen = [i for i, (s, d) in enumerate(zip(states, depths)) if self.wants_ahead(s, d)]
        if not chosen:
            return
        inputs = []
        for i in chosen:
            state, ahead = states[i], states[i].ahead
            if ahead is None:
                feed = [state.last_drafts[-1]]
            elif ahead.tokens:
                feed = [ahead.tokens[-1]]
            else:
                feed = [ahead.guess] if ahead.kept_last else [state.last_drafts[-1], ahead.guess]
            inputs.append(SeqInput(state.seq_id, feed, [len(feed) - 1]))
        logits = self.engine.forward(inputs)
        for i, row in zip(chosen, logits):
            state, ahead, generator = states[i], states[i].ahead, generators[i]
            end = state.base_len + state.num_drafted  # the context if every draft is accepted
            if ahead is None:
                keep = bool(getattr(self.engine, "steps_equal_chains", False))
                if not keep:
                    self.engine.truncate(state.seq_id, end - 1)  # x_{k-1} is fed again with the guess
                before = None if params[i].is_greedy or params[i].is_coupled else generator.get_state()
                state.ahead = DraftAhead(self._guess(row, params[i], generator, end), depths[i], self.q_transform, before,
                                         kept_last=keep)
                continue
            token, q = self._draw(row, params[i], generator, end + 1 + len(ahead.tokens))
            ahead.tokens.append(token)
            if q is not None:
                ahead.qs.append(q)
            if ahead.before is not None:
                ahead.after.append(generator.get_state())

    def drop_ahead(self, state: ModelDraftState, generator: torch.Generator) -> None:
        """Forget the drafts made ahead: their KV goes, the generator gets its state back."""
        ahead, state.ahead = state.ahead, None
        if ahead is None:
            return
        self.ahead_dropped += len(ahead.tokens)
        self.engine.truncate(state.seq_id, state.base_len + state.num_drafted - 1)
        if ahead.before is not None:
            generator.set_state(ahead.before)

    def _ahead_hit(self, state: ModelDraftState, max_tokens: int) -> bool:
        """The target accepted every draft and emitted the guess (`guess_held`, set for this call), and there
        are drafts ahead to serve."""
        ahead = state.ahead
        return (bool(state.guess_held) and ahead is not None and bool(ahead.tokens) and max_tokens > 0
                and ahead.transform is self.q_transform)

    def _take_ahead(self, state: ModelDraftState, generator: torch.Generator, limit: int) -> tuple[list[int], list]:
        """On a hit (the context already counts the accepted tokens): the first drafts ahead become this
        proposal's, the KV and the generator are where drafting them now would leave them, and drafting
        goes on from there. A hit leaves room for at least one draft (`wants_ahead`), so `limit` >= 1."""
        ahead, state.ahead = state.ahead, None
        assert ahead is not None  # _ahead_hit
        taken = min(limit, len(ahead.tokens))
        self.ahead_served += taken
        self.ahead_dropped += len(ahead.tokens) - taken
        state.base_len, state.pending, state.num_drafted = state.num_tokens, [], 0
        self.engine.truncate(state.seq_id, state.base_len + taken - 1)
        if ahead.before is not None:
            generator.set_state(ahead.after[taken - 1])
        return ahead.tokens[:taken], ahead.qs[:taken]

    def _guess(self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator, position: int) -> int:
        """The drafter's guess at the target's token at `position` (it never draws from the generator): its
        coupled sample under the noise the target samples that position with, else its most likely token."""
        if params.is_coupled:
            seed = params.seed if params.seed is not None else draft_seed(generator.initial_seed())
            return int(sample_at(processed_probs(logits, params), seed, [position])[0])
        return int(logits[0].argmax())

    def _absorb(self, state: ModelDraftState, tokens: Sequence[int]) -> None:
        """Fold the tokens accepted since the last proposal into the KV / pending (module docstring)."""
        tokens = list(map(int, tokens))
        if state.num_drafted:
            num_accepted = len(tokens) - 1
            keep = min(num_accepted, state.num_drafted - 1)
            self.engine.truncate(state.seq_id, state.base_len + keep)
            state.pending = tokens[keep:]
            state.num_drafted = 0
        else:
            state.pending.extend(tokens)
        state.num_tokens += len(tokens)

    def _draw(self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
              position: int) -> tuple[int, torch.Tensor | None]:
        """logits [1, vocab] at absolute `position` -> (token, stored q [vocab], or None when greedy, q
        then one-hot, or coupled, q then unread)."""
        if params.is_greedy:
            return int(logits[0].argmax()), None
        q = processed_probs(logits, params)  # [1, vocab]
        if params.is_coupled:  # the request's seed (the generator's is draft_seed of it)
            seed = params.seed if params.seed is not None else draft_seed(generator.initial_seed())
            return int(sample_at(q, seed, [position])[0]), None
        if self.q_transform is None:
            return int(sample(q, generator)[0]), q[0]
        stored = self.q_transform(q)
        return int(sample(normalize_q(stored).to(logits.device), generator)[0]), stored[0]


def self_draft(engine: Engine, target: Engine) -> ModelDrafter:
    """A drafter on `engine`, which holds the target's own model at another precision (bf16, int8, q4_1): it takes
    the context's KV from the target (`kv_source`) where both are native engines, and feeds it otherwise."""
    shares = isinstance(engine, NativeEngine) and isinstance(target, NativeEngine)
    return ModelDrafter(engine, kv_source=target if shares else None)
