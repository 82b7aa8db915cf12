"""Beam search on the engine: beams are KV forks of their parent, all beams step in one forward.

Each step every live beam feeds its pending token (the KV convention of `verifier.py`); the
candidates are scored by the running sum of log-probabilities, and the best 2 * num_beams are walked
in order: a candidate ending in EOS becomes a finished hypothesis (if it ranks within the first
num_beams), any other fills the next beams until there are num_beams. A beam chosen by several
children is forked for all but one of them; a beam chosen by none is freed.

Finished hypotheses are ranked by sum_logprob / length ** length_penalty (length = generated
tokens). The search stops at max_new_tokens, or once num_beams hypotheses are finished and the best
live beam cannot beat the worst of them at the current length.

Worked example (num_beams 2, vocab {a, b, EOS}):
    step 1 log-probs: a -0.1, b -0.5, EOS -3   -> beams [a], [b]
    step 2 from [a]: a -2.0, b -0.2, EOS -0.4; from [b]: a -0.1, b -3, EOS -3
       candidates in order: [a b] -0.3, [a EOS] -0.5 (finished), [b a] -0.6, ...
       -> beams [a b], [b a]; hypotheses {[a EOS]: -0.5 / 2 ** length_penalty}
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specmesh.models.engine import Engine, SeqInput


@dataclass
class Beam:
    seq_id: int
    token_ids: list[int]  # generated so far (the last one is pending, not yet in the KV)
    logprob: float  # sum of the generated tokens' log-probabilities


@dataclass
class BeamHypothesis:
    token_ids: list[int]
    logprob: float
    score: float  # logprob / len ** length_penalty


@dataclass
class BeamSearchResult:
    token_ids: list[int]  # the best hypothesis
    hypotheses: list[BeamHypothesis]  # best first
    num_forwards: int


def beam_search(
    engine: Engine,
    prompt_ids: Sequence[int],
    num_beams: int,
    max_new_tokens: int,
    length_penalty: float = 1.0,
    eos_token_ids: Sequence[int] | None = None,
) -> BeamSearchResult:
    if num_beams < 1:
        raise ValueError(f"num_beams must be >= 1, got {num_beams}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompt_ids:
        raise ValueError("the prompt must have at least one token")
    eos = set(engine.eos_token_ids if eos_token_ids is None else eos_token_ids)
    root = engine.new_sequence()
    parents = [Beam(root, [], 0.0)]
    live: list[Beam] = []
    finished: list[BeamHypothesis] = []
    num_forwards = 0

    def score(logprob: float, length: int) -> float:
        return logprob / (length**length_penalty)

    try:
        logits = engine.forward([SeqInput(root, list(map(int, prompt_ids)), [len(prompt_ids) - 1])])
        num_forwards += 1
        rows = torch.log_softmax(logits[0].double(), dim=-1)  # [1, vocab]
        while True:
            candidates = _top_candidates(parents, rows, 2 * num_beams)
            chosen: list[tuple[int, int, float]] = []
            length = len(parents[0].token_ids) + 1
            for rank, (parent_index, token, logprob) in enumerate(candidates):
                if token in eos:
                    if rank < num_beams:
                        finished.append(BeamHypothesis(parents[parent_index].token_ids + [token], logprob, score(logprob, length)))
                    continue
                chosen.append((parent_index, token, logprob))
                if len(chosen) == num_beams:
                    break
            live = _fork_beams(engine, parents, chosen)
            parents = []
            finished.sort(key=lambda h: h.score, reverse=True)
            if length >= max_new_tokens or not live:
                break
            if len(finished) >= num_beams:
                best_live = max(score(b.logprob, length) for b in live)
                if best_live <= finished[num_beams - 1].score:
                    break
            logits = engine.forward([SeqInput(b.seq_id, [b.token_ids[-1]], [0]) for b in live])
            num_forwards += 1
            rows = torch.log_softmax(torch.cat(logits).double(), dim=-1)  # [beams, vocab]
            parents, live = live, []
        for beam in live:
            finished.append(BeamHypothesis(beam.token_ids, beam.logprob, score(beam.logprob, len(beam.token_ids))))
        finished.sort(key=lambda h: h.score, reverse=True)
        return BeamSearchResult(finished[0].token_ids, finished[:num_beams], num_forwards)
    finally:
        for beam in live + parents:
            engine.free(beam.seq_id)


def _top_candidates(parents: list[Beam], logprobs: torch.Tensor, count: int) -> list[tuple[int, int, float]]:
    """(parent index, token, total logprob) of the `count` best continuations, best first.
    logprobs [num_parents, vocab]."""
    parent_logprobs = torch.tensor([b.logprob for b in parents], dtype=logprobs.dtype, device=logprobs.device)
    totals = logprobs + parent_logprobs[:, None]
    values, flat = totals.flatten().topk(min(count, totals.numel()))
    vocab = logprobs.shape[-1]
    return [(i // vocab, i % vocab, v) for v, i in zip(values.tolist(), flat.tolist())]


def _fork_beams(engine: Engine, parents: list[Beam], chosen: list[tuple[int, int, float]]) -> list[Beam]:
    """New beams for the chosen (parent, token, logprob); parents are reused once, forked after."""
    used: set[int] = set()
    beams = []
    for parent_index, token, logprob in chosen:
        parent = parents[parent_index]
        if parent_index in used:
            seq_id = engine.fork(parent.seq_id)
        else:
            seq_id = parent.seq_id
            used.add(parent_index)
        beams.append(Beam(seq_id, parent.token_ids + [token], logprob))
    for index, parent in enumerate(parents):
        if index not in used:
            engine.free(parent.seq_id)
    return beams
