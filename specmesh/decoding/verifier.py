"""The target side of speculative decoding: sessions with server-side KV, verified in batches.

A `TargetSession` is one sequence in the target engine. Its KV cache holds every token of the
sequence except the last one emitted, the *pending* token: the next forward feeds the pending token
followed by the draft, so one forward over [pending, x_0, ..., x_{k-1}] yields p_0..p_k (words as in
`specmesh.decoding.rejection`). After verification the KV is rolled back to the accepted length and
the final token becomes the new pending token.

Worked example (greedy, prompt of 4 tokens, k = 3):
    open:    forward [t0 t1 t2 t3], argmax -> 9          KV len 4, pending 9
    verify:  forward [9, 5, 6, 7] -> argmax [5, 6, 2, 8]   accepted [5, 6], final 2 (recovered)
             KV had 4 + 4 = 8 tokens; keep 4 + 1 + 2 = 7 (t0..t3 9 5 6); pending 2

`verify_many` verifies several sessions in ONE ragged engine forward; `verify` is the batch of one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from specmesh.decoding.rejection import verify_greedy, verify_sampled
from specmesh.decoding.sampling import SamplingParams, processed_probs, sample
from specmesh.decoding.tree import kept_forward_indices, tree_forward_input, verify_tree_greedy, verify_tree_sampled
from specmesh.decoding.types import VerifyOutcome
from specmesh.drafters.base import DraftProposal
from specmesh.models.engine import ContextLengthError, Engine, SeqInput


@dataclass
class TargetSession:
    seq_id: int
    params: SamplingParams
    generator: torch.Generator
    pending_token_id: int  # the last emitted token; not yet in the KV cache
    num_tokens: int  # prompt + emitted tokens (including the pending one)
    num_prompt_tokens: int
    num_forwards: int = 0  # target forwards this session took part in


@dataclass
class VerifyTiming:
    verify_ms: float  # wall time of the batched forward + acceptance
    batch_size: int  # sessions in that forward


class TargetVerifier:
    """Owns sessions on one target engine. Not thread-safe: one engine thread calls it."""

    def __init__(self, engine: Engine):
        self.engine = engine

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
        for prompt in prompts:
            if not prompt:
                raise ValueError("the prompt must have at least one token")
            if len(prompt) >= self.engine.max_context:
                raise ContextLengthError(
                    f"prompt of {len(prompt)} tokens leaves no room in the {self.engine.max_context}-token context"
                )
        seq_ids = [self.engine.new_sequence() for _ in prompts]
        try:
            inputs = [SeqInput(seq_id, list(map(int, prompt)), [len(prompt) - 1]) for seq_id, prompt in zip(seq_ids, prompts)]
            logits = self.engine.forward(inputs)
        except Exception:
            for seq_id in seq_ids:
                self.engine.free(seq_id)
            raise
        sessions = []
        for seq_id, prompt, p, g, row in zip(seq_ids, prompts, params, generators, logits):
            first = self._sample_one(row, p, g)
            sessions.append(TargetSession(seq_id, p, g, first, len(prompt) + 1, len(prompt), num_forwards=1))
        return sessions

    def verify(self, session: TargetSession, proposal: DraftProposal) -> VerifyOutcome:
        return self.verify_many([session], [proposal])[0]

    def verify_many(self, sessions: Sequence[TargetSession], proposals: Sequence[DraftProposal]) -> list[VerifyOutcome]:
        """Verify each session's proposal (an empty one = plain decoding) in one engine forward."""
        inputs = []
        for session, proposal in zip(sessions, proposals):
            if proposal.num_tokens > self.max_draft_tokens(session):
                raise ContextLengthError(
                    f"{proposal.num_tokens} draft tokens exceed the context window "
                    f"({session.num_tokens} of {self.engine.max_context} tokens used)"
                )
            proposal.validate(self.engine.vocab_size)
            if proposal.is_tree:
                tokens, parents = tree_forward_input(session.pending_token_id, proposal.token_ids, proposal.parents)
            else:
                tokens, parents = [session.pending_token_id, *proposal.token_ids], None
            inputs.append(SeqInput(session.seq_id, tokens, list(range(len(tokens))), parents))
        logits = self.engine.forward(inputs)
        return [self._accept(s, pr, row) for s, pr, row in zip(sessions, proposals, logits)]

    def fork(
        self,
        parent: TargetSession,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator],
        append_token_ids: Sequence[int] = (),
    ) -> list[TargetSession]:
        """Child sessions sharing the parent's KV (copy-on-write), one per params/generator.

        Children start where the parent is (same pending token). With `append_token_ids`, one forward
        over all children feeds [pending, *append_token_ids] and samples each child's next token under
        its own params — e.g. Skeleton-of-Thought branches that each begin with their point's header.
        """
        if len(append_token_ids) > self.max_draft_tokens(parent):
            raise ContextLengthError(f"{len(append_token_ids)} appended tokens do not fit in the context window")
        children: list[TargetSession] = []
        try:
            for child_params, generator in zip(params, generators):
                children.append(TargetSession(
                    self.engine.fork(parent.seq_id), child_params, generator, parent.pending_token_id,
                    parent.num_tokens, parent.num_prompt_tokens,
                ))
            if append_token_ids:
                feed = [parent.pending_token_id, *map(int, append_token_ids)]
                logits = self.engine.forward([SeqInput(c.seq_id, feed, [len(feed) - 1]) for c in children])
                for child, row in zip(children, logits):
                    child.pending_token_id = self._sample_one(row, child.params, child.generator)
                    child.num_tokens += len(append_token_ids) + 1
                    child.num_forwards += 1
        except BaseException:
            for child in children:
                self.engine.free(child.seq_id)
            raise
        return children

    def close(self, session: TargetSession) -> None:
        self.engine.free(session.seq_id)

    def _accept(self, session: TargetSession, proposal: DraftProposal, logits: torch.Tensor) -> VerifyOutcome:
        """logits [1 + k, vocab] -> outcome; rolls the KV back to the accepted path."""
        params, draft = session.params, proposal.token_ids
        cached_before = session.num_tokens - 1
        if params.is_greedy:
            target_ids = logits.argmax(dim=-1).tolist()
            if proposal.is_tree:
                outcome = verify_tree_greedy(draft, proposal.parents, target_ids)
            else:
                outcome = verify_greedy(draft, target_ids)
        else:
            p = processed_probs(logits, params)
            q = None if proposal.q is None else proposal.q.to(p.device)
            if proposal.is_tree:
                outcome = verify_tree_sampled(draft, proposal.parents, q, p, session.generator)
            else:
                outcome = verify_sampled(draft, q, p, session.generator)
        if proposal.is_tree:
            self.engine.keep_tree_path(session.seq_id, kept_forward_indices(outcome.accepted_nodes))
        else:
            self.engine.truncate(session.seq_id, cached_before + 1 + outcome.num_accepted)
        session.pending_token_id = outcome.final_token_id
        session.num_tokens += outcome.num_accepted + 1
        session.num_forwards += 1
        return outcome

    @staticmethod
    def _sample_one(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
        """logits [1, vocab] -> one token under the request's sampling."""
        if params.is_greedy:
            return int(logits[0].argmax())
        return int(sample(processed_probs(logits, params), generator)[0])


def timed(fn, *args):
    """(result, elapsed_ms) of fn(*args)."""
    start = time.perf_counter()
    result = fn(*args)
    return result, (time.perf_counter() - start) * 1e3
