"""A middle stage of a cascade: verify a lower stage's draft with this model, then extend it.

The stage's sequence is a `TargetSession` on this model's `TargetVerifier`: its rounds are the
verifier's rounds (one forward, exact acceptance, KV rollback), nothing written again here.
verify_and_extend(accepted A, draft D, q, m, fill_to=f):
    confirmed += A                     the tokens the top stage confirmed since the last call
    rewind the sequence to `confirmed` (the KV keeps whatever prefix it already holds)
    one verify round on D: accepted D + this stage's final token
    plain rounds (k = 0), at least m - 1 and until the proposal holds f tokens: its own next tokens
    proposal = everything those rounds emitted
f = 0 extends by exactly m. A stage that fills (f = the level above's k) drafts by itself what the
lower draft did not give: where the first lower token is rejected it is a model drafter of f tokens.
The proposal is the next stage's draft; each proposal token was produced from this stage's processed
p at its position (by the speculative sampling theorem for the accepted/final tokens), so p rows are
the q the next stage verifies against. Per-token quality features come from the same rows.

Worked example (greedy, confirmed c0..c4, KV holds c0..c3):
    D = [a, b], m = 2:  forward [c4, a, b] -> argmax [a, x, y]: accept [a], final x
    plain round: forward [x] -> z; proposal = [a, x, z]; KV c0..c4 a x, z pending

Extending ahead (`extend_ahead`, greedy sessions). While the level above verifies proposal P, the stage
may go on as if it confirms all of P and then emits the stage's own next token g: plain rounds on the
sequence (feed P's last token -> g, feed g -> y0, ...), their logits kept. The next call's confirmed
tokens are then usually a prefix of that sequence (P, g); when they are, the stage's greedy continuation
after them is known as far as the rounds ahead went: D is accepted up to its first token that differs from
it, the final token and the extension are its next tokens (`ahead_served`), and forwards run only for what
they do not reach (the rest of D when all of them matched it, then the extension's remaining tokens).
Otherwise the sequence is rewound to the confirmed tokens, keeping the KV they share (`ahead_dropped`),
and the call runs as without extending ahead. Each answered token is the argmax
of this stage's logits at its position either way; on an engine whose steps equal its chains bit for
bit (`NativeEngine.steps_equal_chains`) they are the same logits, elsewhere a near tie may break the
other way, which changes a draft, never the target's output. Sampled sessions do not extend ahead: a
verify round's draws from the generator differ from a plain round's.

    greedy, proposal P = [a, x, z] answered (z pending); ahead: feed [z] -> g; feed [g] -> y0, y1
    next call accepted [a, x, z, g], D = [y0, q], m = 1: accept y0, final y1, no forward
    next call accepted [a, x, z, g], D = [y0, y1, q], m = 1: feed [y1, q] -> accept q or not, and its final
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.sampling import SamplingParams, processed_probs
from specmesh.decoding.types import VerifyOutcome
from specmesh.decoding.verifier import TargetSession, TargetVerifier, validate_prompt
from specmesh.models.engine import ContextLengthError, Engine


@dataclass
class TokenFeatures:
    entropy_nats: float  # of this stage's processed distribution (of the softmax at temperature 1 when greedy)
    top1_prob: float
    token_logprob: float  # log-probability of the emitted token under that distribution


@dataclass
class StageSession:
    sequence: TargetSession  # confirmed tokens + this stage's last proposal (its last token pending), + rounds ahead
    confirmed: list[int]  # prompt + tokens the top stage confirmed
    answered: int = 0  # the sequence's length when the last call was answered: rounds ahead start there
    ahead_logits: list[torch.Tensor] = field(default_factory=list)  # [1, vocab] rows of the tokens ahead, in order
    guess_held: bool | None = None  # at the last call: whether its confirmed tokens followed those ahead (None: none)


@dataclass
class StageOutput:
    num_accepted: int
    proposal: list[int]  # accepted draft tokens + this stage's own tokens
    q: torch.Tensor | None  # [len(proposal), vocab] this stage's processed p at each proposal token (None: not sent)
    features: list[TokenFeatures]


class StageModel:
    """Not thread-safe: one engine thread calls it."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.verifier = TargetVerifier(engine)
        self.ahead_served = 0  # tokens extended ahead that became a proposal's
        self.ahead_dropped = 0  # tokens extended ahead that the verdict made useless

    @property
    def max_context(self) -> int:
        """The stage's context window, tokens (a cascade caps the drafts it sends here by it)."""
        return self.engine.max_context

    @property
    def device(self) -> torch.device:
        """Where the generator passed to `open` must live."""
        return self.engine.device

    @property
    def ms_per_token(self) -> float | None:
        """One of this stage's own tokens (its engine's one-token forward; None until one ran): what a
        filling stage adds to a draft token's cost (`CascadeDrafter.ms_per_token`)."""
        return self.engine.stats.step_ms

    def open(self, prompt: Sequence[int], params: SamplingParams, generator: torch.Generator) -> StageSession:
        """No forward yet: the prompt is fed with the first draft."""
        prompt = validate_prompt(prompt, self.engine.max_context, self.engine.vocab_size)
        sequence = TargetSession(self.engine.new_sequence(), params, generator, list(prompt))
        return StageSession(sequence, list(prompt))

    def close(self, session: StageSession) -> None:
        self.verifier.close(session.sequence)

    def prefill(self, s: StageSession) -> None:
        """Take in now what the first call would feed first: the prompt, all but its last token (a Stage service
        extending ahead does this at open, beside the target's prefill, so its first call feeds a token or
        two, as later ones do). The answers are those of a first call feeding it all at once (greedy)."""
        self.verifier.prefill_chunk(s.sequence, s.sequence.num_uncached)

    def verify_and_extend(self, s: StageSession, accepted: Sequence[int], draft: Sequence[int],
                          q: torch.Tensor | None, num_extend: int, fill_to: int = 0) -> StageOutput:
        """`fill_to`: plain rounds go on until the proposal holds that many tokens (module docstring).
        Whether a round runs depends only on how many tokens the earlier ones emitted, never on the
        token a round draws, so each token is still a draw from this stage's p (`specmesh.cascade.plan`)."""
        confirmed = s.confirmed + [int(t) for t in accepted]
        if len(confirmed) + max(len(draft) + max(num_extend, 1), fill_to) > self.engine.max_context:
            raise ContextLengthError("the draft and extension do not fit in the context window")
        proposal = DraftProposal(token_ids=[int(t) for t in draft], q=q)
        proposal.validate(self.engine.vocab_size)
        cont, rows = self._ahead_after(s, confirmed)  # this stage's own tokens after `confirmed`, known already
        s.confirmed = confirmed
        judged = 0  # draft tokens the tokens ahead accept
        while judged < min(proposal.num_tokens, len(cont)) and proposal.token_ids[judged] == cont[judged]:
            judged += 1
        if judged < len(cont):  # they judge the draft: `judged` accepted, the final token theirs
            num_accepted = judged
            taken = min(max(judged + max(num_extend, 1), fill_to), len(cont))
        else:  # every token ahead is a draft token: the forward judges the rest of the draft
            taken = len(cont)
        self._take_ahead(s, confirmed, cont, taken)
        tokens, logits_rows = cont[:taken], rows[:taken]
        if judged == len(cont):
            rest = DraftProposal(proposal.token_ids[judged:], None if q is None else q[judged:])
            first = self.verifier.verify(s.sequence, rest, keep_logits=True)
            num_accepted = judged + first.num_accepted
            tokens, logits_rows = tokens + list(first.token_ids), logits_rows + [_kept_logits(first)]
        while len(tokens) < max(num_accepted + max(num_extend, 1), fill_to):  # this stage's own tokens
            outcome = self.verifier.verify(s.sequence, DraftProposal(token_ids=[]), keep_logits=True)
            tokens, logits_rows = tokens + list(outcome.token_ids), logits_rows + [_kept_logits(outcome)]
        logits = torch.cat(logits_rows)  # [len(tokens), vocab]
        s.answered = s.sequence.num_tokens
        p = processed_probs(logits, s.sequence.params)
        features = [self._features(row_logits, row_p, token, s.sequence.params)
                    for row_logits, row_p, token in zip(logits, p, tokens)]
        return StageOutput(num_accepted, tokens, p, features)

    # extending ahead (module docstring)
    @staticmethod
    def extends_ahead(s: StageSession) -> bool:
        """Whether the session may extend ahead at all: greedy and unconstrained (module docstring)."""
        return s.sequence.params.is_greedy and s.sequence.constraint is None

    def wants_ahead(self, s: StageSession, depth: int) -> bool:
        """Whether `extend_ahead` has a round to run for this session, `depth` tokens past the last answer."""
        return (s.answered > 0 and self.extends_ahead(s) and len(s.ahead_logits) < depth
                and s.sequence.num_tokens + 1 < self.engine.max_context)

    def extend_ahead(self, sessions: Sequence[StageSession]) -> None:
        """One plain round for each session (one forward for them all): its next own token, logits kept."""
        if not sessions:
            return
        outcomes = self.verifier.verify_many([s.sequence for s in sessions], [DraftProposal(token_ids=[])] * len(sessions),
                                             keep_logits=True)
        for s, outcome in zip(sessions, outcomes):
            s.ahead_logits.append(_kept_logits(outcome))

    def _ahead_after(self, s: StageSession, confirmed: list[int]) -> tuple[list[int], list[torch.Tensor]]:
        """The tokens extended ahead that follow `confirmed` and their logits rows; none (the sequence then
        rewound to `confirmed`, as a call without them starts) when the confirmed tokens left them."""
        ahead, s.ahead_logits = s.ahead_logits, []
        known, start = s.sequence.token_ids, len(confirmed)
        followed = bool(ahead) and s.answered < start <= len(known) and known[:start] == confirmed
        s.guess_held = followed if ahead else None
        if followed and start < len(known):
            return known[start:], ahead[start - s.answered:]
        self.ahead_dropped += len(ahead)
        self.verifier.rewind(s.sequence, confirmed)
        return [], []

    def _take_ahead(self, s: StageSession, confirmed: list[int], cont: list[int], taken: int) -> None:
        """The sequence made `confirmed` + the first `taken` tokens ahead (their KV kept, the last pending)."""
        if not cont:
            return
        self.verifier.rewind(s.sequence, confirmed + cont[:taken])
        self.ahead_served += taken
        self.ahead_dropped += len(cont) - taken

    @staticmethod
    def _features(logits: torch.Tensor, probs: torch.Tensor, token: int, params: SamplingParams) -> TokenFeatures:
        dist = torch.softmax(logits.double(), dim=-1) if params.is_greedy else probs.double()
        positive = dist[dist > 0]
        entropy = float(-(positive * positive.log()).sum())
        prob = float(dist[token])
        return TokenFeatures(entropy, float(dist.max()), math.log(prob) if prob > 0 else float("-inf"))


def _kept_logits(outcome: VerifyOutcome) -> torch.Tensor:
    assert outcome.logits is not None  # verified with keep_logits=True
    return outcome.logits
