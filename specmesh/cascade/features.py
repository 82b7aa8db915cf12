"""Cheap per-chunk features for the adaptive cascade's agreement predictor (pure Python, no torch).

A *chunk* is the run of tokens one stage hands up the cascade in one step (its `StageOutput.proposal`,
or the first tokens of it). For stage j's chunk the predictor estimates P(stage j+1 agrees with the
whole chunk); these are its inputs, one flat list of floats in `FeatureSchema.names()` order:

    chunk_entropy_mean / _max     entropy (nats) of stage j's distribution at each chunk token
    chunk_top1_mean / _min        top-1 probability at each chunk token
    chunk_logprob_mean / _min     log-probability of each chunk token (-inf clipped at LOGPROB_FLOOR)
    window_entropy_mean / _max    the same entropy over this stage's last `window_tokens` (32) tokens,
    window_logprob_mean           the chunk included: how hard the text has been lately
    log_length_ratio              log((1 + prompt tokens) / (1 + generated tokens)): input/output ratio
    draft_accepted_fraction       accepted / drafted tokens of the lower stage's draft (0 for stage 0)
    num_chunk_tokens              chunk length (a longer chunk is less likely to be agreed in full)
    stage_0 .. stage_{N-2}        one-hot stage id (the final stage never asks: it is never disagreed with)

Every per-token input is a `TokenFeatures` (entropy, top-1 prob, token log-prob) as `StageOutput`
and `VerifyAndExtendResponse.features` carry them. One `SessionFeatures` per generation keeps a
window per stage; `chunk()` appends the chunk to the stage's window and returns the vector.
`bench/cascade_features.py` times `chunk()` (budget: 0.3 ms per call).

Worked example (3 stages, stage 1, prompt 20 tokens, 7 generated so far, draft of 4 from stage 0 with
3 accepted; chunk tokens with entropies [0.5, 1.5], top-1 [0.9, 0.5], log-probs [-0.1, -0.7], window
empty before):
    [1.0, 1.5, 0.7, 0.5, -0.4, -0.7, 1.0, 1.5, -0.4, log(21/8) = 0.965, 0.75, 2, 0, 1]
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from specmesh.cascade.stage_model import TokenFeatures

SCHEMA_VERSION = 1  # bump when the names, their order or their meaning change
WINDOW_TOKENS = 32
LOGPROB_FLOOR = -30.0  # a token the stage gave probability 0 (possible under top-k / top-p)
BASE_NAMES = (
    "chunk_entropy_mean", "chunk_entropy_max", "chunk_top1_mean", "chunk_top1_min", "chunk_logprob_mean",
    "chunk_logprob_min", "window_entropy_mean", "window_entropy_max", "window_logprob_mean", "log_length_ratio",
    "draft_accepted_fraction", "num_chunk_tokens",
)


@dataclass(frozen=True)
class FeatureSchema:
    num_stages: int  # all stages, final included; the one-hot has num_stages - 1 entries
    window_tokens: int = WINDOW_TOKENS
    version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.num_stages < 2:
            raise ValueError(f"a cascade has at least 2 stages, got {self.num_stages}")
        if self.window_tokens < 1:
            raise ValueError(f"window_tokens must be >= 1, got {self.window_tokens}")

    @property
    def num_decision_stages(self) -> int:
        return self.num_stages - 1

    def names(self) -> list[str]:
        return list(BASE_NAMES) + [f"stage_{j}" for j in range(self.num_decision_stages)]

    @property
    def num_features(self) -> int:
        return len(BASE_NAMES) + self.num_decision_stages

    def to_dict(self) -> dict:
        return {"version": self.version, "num_stages": self.num_stages, "window_tokens": self.window_tokens,
                "names": self.names()}

    @classmethod
    def from_dict(cls, data: dict) -> FeatureSchema:
        schema = cls(int(data["num_stages"]), int(data["window_tokens"]), int(data["version"]))
        if list(data.get("names", schema.names())) != schema.names():
            raise ValueError("feature names do not match this version of the schema")
        return schema


class FeatureWindow:
    """One stage's last `max_tokens` entropies and log-probabilities."""

    def __init__(self, max_tokens: int = WINDOW_TOKENS):
        self.entropies: deque[float] = deque(maxlen=max_tokens)
        self.logprobs: deque[float] = deque(maxlen=max_tokens)

    def push(self, entropy_nats: float, logprob: float) -> None:
        self.entropies.append(entropy_nats)
        self.logprobs.append(logprob)


class SessionFeatures:
    """Feature state of one generation: a window per decision stage. Not thread-safe."""

    def __init__(self, schema: FeatureSchema, num_prompt_tokens: int):
        self.schema = schema
        self.num_prompt_tokens = num_prompt_tokens
        self.windows = [FeatureWindow(schema.window_tokens) for _ in range(schema.num_decision_stages)]

    def chunk(self, stage: int, tokens: Sequence[TokenFeatures], num_draft_tokens: int, num_accepted: int,
              num_generated_tokens: int) -> list[float]:
        """The vector for stage `stage`'s chunk `tokens` (its features in order); pushes them to the window.

        num_draft_tokens / num_accepted: the lower stage's draft this stage verified and how much of it it
        kept (0 / 0 at stage 0); num_generated_tokens: output tokens confirmed before this chunk.
        """
        if not 0 <= stage < self.schema.num_decision_stages:
            raise ValueError(f"stage {stage} takes no stopping decision (decision stages 0..{self.schema.num_decision_stages - 1})")
        if not tokens:
            raise ValueError("a chunk has at least one token")
        window = self.windows[stage]
        entropy_sum = top1_sum = logprob_sum = 0.0
        entropy_max, top1_min, logprob_min = -math.inf, math.inf, math.inf
        for t in tokens:
            logprob = t.token_logprob if t.token_logprob > LOGPROB_FLOOR else LOGPROB_FLOOR
            entropy_sum += t.entropy_nats
            top1_sum += t.top1_prob
            logprob_sum += logprob
            entropy_max = max(entropy_max, t.entropy_nats)
            top1_min = min(top1_min, t.top1_prob)
            logprob_min = min(logprob_min, logprob)
            window.push(t.entropy_nats, logprob)
        n = len(tokens)
        num_window = len(window.entropies)
        one_hot = [0.0] * self.schema.num_decision_stages
        one_hot[stage] = 1.0
        return [
            entropy_sum / n, entropy_max, top1_sum / n, top1_min, logprob_sum / n, logprob_min,
            sum(window.entropies) / num_window, max(window.entropies), sum(window.logprobs) / num_window,
            math.log((1 + self.num_prompt_tokens) / (1 + num_generated_tokens)),
            num_accepted / num_draft_tokens if num_draft_tokens else 0.0,
            float(n),
        ] + one_hot
