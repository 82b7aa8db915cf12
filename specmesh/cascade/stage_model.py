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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

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
    sequence: TargetSession  # confirmed tokens + this stage's last proposal (its last token pending)
    confirmed: list[int]  # prompt + tokens the top stage confirmed


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
        self.verifier.rewind(s.sequence, confirmed)
        s.confirmed = confirmed
        first = self.verifier.verify(s.sequence, proposal, keep_logits=True)
        outcomes, tokens = [first], list(first.token_ids)
        while len(outcomes) < num_extend or len(tokens) < fill_to:
            outcomes.append(self.verifier.verify(s.sequence, DraftProposal(token_ids=[]), keep_logits=True))
            tokens += outcomes[-1].token_ids
        logits = torch.cat([_kept_logits(outcome) for outcome in outcomes])  # [len(tokens), vocab]
        p = processed_probs(logits, s.sequence.params)
        features = [self._features(row_logits, row_p, token, s.sequence.params)
                    for row_logits, row_p, token in zip(logits, p, tokens)]
        return StageOutput(first.num_accepted, tokens, p, features)

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
