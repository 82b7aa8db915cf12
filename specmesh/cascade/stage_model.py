"""A middle stage of a cascade: verify a lower stage's draft with this model, then extend it.

The stage keeps one engine sequence per session and `context` = the tokens the top stage confirmed.
verify_and_extend(accepted A, draft D, q, m):
    context += A
    forward [unfed context tokens..., D] (the KV keeps whatever prefix of context it already holds)
    accept a prefix of D exactly (greedy: argmax match; sampling: min(1, p/q), residual on rejection)
    proposal = accepted D + this stage's final token + (m - 1) more tokens decoded by this stage
The proposal is the next stage's draft; each proposal token was produced from this stage's processed
p at its position (by the speculative sampling theorem for the accepted/final tokens), so p rows are
the q the next stage verifies against. Per-token quality features come from the same p rows.

Worked example (greedy, context c0..c4 fully confirmed, KV holds c0..c3):
    D = [a, b], m = 2:  forward [c4, a, b] -> argmax [a, x, y]: accept [a], final x
    KV keeps c0..c4 a; extend: forward [x] -> z; proposal = [a, x, z]; KV c0..c4 a x
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from specmesh.decoding.rejection import verify_greedy, verify_sampled
from specmesh.decoding.sampling import SamplingParams, processed_probs, sample
from specmesh.models.engine import ContextLengthError, Engine, SeqInput


@dataclass
class TokenFeatures:
    entropy_nats: float  # of this stage's processed distribution (of the softmax at temperature 1 when greedy)
    top1_prob: float
    token_logprob: float  # log-probability of the emitted token under that distribution


@dataclass
class StageSession:
    seq_id: int
    params: SamplingParams
    generator: torch.Generator
    context: list[int]  # prompt + tokens the top stage confirmed
    kv_tokens: list[int] = field(default_factory=list)  # what the engine's KV holds, in order


@dataclass
class StageOutput:
    num_accepted: int
    proposal: list[int]  # accepted draft tokens + this stage's own tokens
    q: torch.Tensor  # [len(proposal), vocab] this stage's processed p at each proposal token
    features: list[TokenFeatures]


class StageModel:
    """Not thread-safe: one engine thread calls it."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def open(self, prompt: Sequence[int], params: SamplingParams, generator: torch.Generator) -> StageSession:
        if not prompt:
            raise ValueError("the prompt must have at least one token")
        if len(prompt) >= self.engine.max_context:
            raise ContextLengthError(f"prompt of {len(prompt)} tokens leaves no room in the {self.engine.max_context}-token context")
        return StageSession(self.engine.new_sequence(), params, generator, list(map(int, prompt)))

    def close(self, session: StageSession) -> None:
        self.engine.free(session.seq_id)

    def verify_and_extend(self, s: StageSession, accepted: Sequence[int], draft: Sequence[int],
                          q: torch.Tensor | None, num_extend: int) -> StageOutput:
        draft = list(map(int, draft))
        context = s.context + list(map(int, accepted))
        if len(context) + len(draft) + max(num_extend, 1) > self.engine.max_context:
            raise ContextLengthError("the draft and extension do not fit in the context window")
        keep = 0
        while keep < min(len(s.kv_tokens), len(context) - 1) and s.kv_tokens[keep] == context[keep]:
            keep += 1
        self.engine.truncate(s.seq_id, keep)
        feed = context[keep:] + draft
        first_row = len(context) - keep - 1
        logits = self.engine.forward([SeqInput(s.seq_id, feed, list(range(first_row, len(feed))))])[0]  # [k + 1, vocab]
        p = self._probs(logits, s.params)
        if s.params.is_greedy:
            outcome = verify_greedy(draft, logits.argmax(dim=-1).tolist())
        else:
            outcome = verify_sampled(draft, None if q is None else q.to(p.device), p, s.generator)
        n = outcome.num_accepted
        self.engine.truncate(s.seq_id, len(context) + n)
        s.context, s.kv_tokens = context, context + draft[:n]
        proposal, rows, feature_logits = outcome.token_ids, [p[i] for i in range(n + 1)], [logits[i] for i in range(n + 1)]
        for _ in range(num_extend - 1):
            row_logits = self.engine.forward([SeqInput(s.seq_id, [proposal[-1]], [0])])[0]
            s.kv_tokens.append(proposal[-1])
            row_p = self._probs(row_logits, s.params)
            token = int(row_logits[0].argmax()) if s.params.is_greedy else int(sample(row_p, s.generator)[0])
            proposal.append(token)
            rows.append(row_p[0])
            feature_logits.append(row_logits[0])
        features = [self._features(l, r, t, s.params) for l, r, t in zip(feature_logits, rows, proposal)]
        return StageOutput(n, proposal, torch.stack(rows), features)

    @staticmethod
    def _probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        return processed_probs(logits, params)

    @staticmethod
    def _features(logits: torch.Tensor, probs: torch.Tensor, token: int, params: SamplingParams) -> TokenFeatures:
        dist = torch.softmax(logits.double(), dim=-1) if params.is_greedy else probs.double()
        positive = dist[dist > 0]
        entropy = float(-(positive * positive.log()).sum())
        prob = float(dist[token])
        return TokenFeatures(entropy, float(dist.max()), math.log(prob) if prob > 0 else float("-inf"))
