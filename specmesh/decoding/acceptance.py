"""Accept a whole verification batch at once: every session's draft against the rows the target
returned for it, in a few vectorised calls instead of one loop iteration (and one sync) per session.

Words (accepted, rejected, recovered, bonus, final token) are those of the glossary in
`specmesh.decoding.rejection`; tree layout as in `specmesh.decoding.tree`. As vLLM's rejection
sampler does, the batch is ragged (session b has 1 + k_b rows: its pending token, then its k_b draft
nodes), flattened session after session and indexed through cumulative offsets; each request keeps
its own generator.

The batch splits four ways:
- greedy sessions (chains and trees): ONE argmax over all their rows and ONE `.tolist()`; then, per
  session, the comparison of `verify_greedy` / `verify_tree_greedy` on plain Python ints.
- coupled sessions (`AcceptanceRule.COUPLED`, chains and trees): ONE `processed_probs_rows` over all
  their rows, each row's noise from (seed, the position it samples) (`specmesh.decoding.coupled`),
  ONE coupled sample over all rows and ONE `.tolist()`; then the greedy comparison with those tokens
  in place of the argmax. No generator is read; q is never needed.
- sampled chains: ONE `processed_probs_rows` over all their rows, each session's uniforms drawn from
  its own generator exactly as `verify_sampled` draws them (k_b + 1, sessions in order; one-hot
  drafts one draw at a time, judged position by position and the generator left num_accepted + 1
  draws on, see `specmesh.decoding.rejection`), then ONE padded `verify_sampled_batch` and ONE
  `.tolist()`.
- sampled trees (rare): p from the same `processed_probs_rows` call, the uniforms `verify_tree_sampled`
  would draw, then `verify_tree_sampled_with_uniforms` per session.
Outcomes and generator states equal those of the per-session functions, seed for seed.

Ragged layout, worked example: three sampled chains with k = [2, 0, 3] have 1 + k = [3, 1, 4] rows.
    cumulative_offsets([3, 1, 4])    -> [0, 3, 4, 8]   session b owns flat rows offsets[b]:offsets[b + 1]
    ragged_coordinates([3, 1, 4])    -> session [0, 0, 0, 1, 2, 2, 2, 2]
                                        column  [0, 1, 2, 0, 0, 1, 2, 3]
    padded[session, column] = flat   -> p [3, k_max + 1 = 4, vocab]; uniforms [3, 4] the same way
    row 0: p_0 p_1 p_2 .      row 1: p_0 . . .      row 2: p_0 p_1 p_2 p_3     (. = zero padding)
The draft tokens ([2, 0, 3] of them) are scattered into a [3, k_max = 3] tensor likewise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specmesh.decoding.coupled import coupled_sample, noise_rows, row_positions, verify_coupled
from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.rejection import (
    draw_positional_uniforms,
    draw_uniforms,
    keep_used_uniforms,
    verify_greedy,
    verify_sampled_batch,
)
from specmesh.decoding.sampling import SamplingParams, processed_probs_rows
from specmesh.decoding.tree import verify_tree_greedy, verify_tree_sampled_with_uniforms
from specmesh.decoding.types import PLACEHOLDER_TOKEN_ID, FinalTokenKind, VerifyOutcome


def accept_batch(
    logits: Sequence[torch.Tensor],
    proposals: Sequence[DraftProposal],
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
    positions: Sequence[int] | None = None,
) -> list[VerifyOutcome]:
    """One outcome per session, equal to what the per-session functions give.

    logits: per session [1 + k_b, vocab] float32, the target's rows for [pending token, *draft nodes];
    proposals: chains or trees, q None (one-hot) or given; params: per session, greedy or sampled;
    generators: one per session, on the logits' device (read by standard sampled sessions only);
    positions: per session, the absolute position its row 0 samples (the sequence's length with
    the pending token), needed by coupled sessions. A coupled session's noise seed is its
    `params.seed`, or its generator's seed when the params carry none.
    """
    num_sessions = len(logits)
    if not len(proposals) == len(params) == len(generators) == num_sessions:
        raise ValueError(
            f"one proposal, params and generator per session: got {num_sessions} logits, {len(proposals)} "
            f"proposals, {len(params)} params, {len(generators)} generators"
        )
    if positions is not None and len(positions) != num_sessions:
        raise ValueError(f"one position per session: got {len(positions)} for {num_sessions} sessions")
    for b, (rows, proposal) in enumerate(zip(logits, proposals)):
        if rows.dim() != 2 or rows.shape[0] != 1 + proposal.num_tokens:
            raise ValueError(f"session {b}: logits must be [1 + k = {1 + proposal.num_tokens}, vocab], "
                             f"got {tuple(rows.shape)}")
    greedy = [b for b in range(num_sessions) if params[b].is_greedy]
    coupled = [b for b in range(num_sessions) if params[b].is_coupled]
    sampled = [b for b in range(num_sessions) if not params[b].is_greedy and not params[b].is_coupled]
    if coupled and positions is None:
        raise ValueError("coupled sessions need their positions")
    outcomes = dict(zip(greedy, _accept_greedy([logits[b] for b in greedy], [proposals[b] for b in greedy])))
    if coupled:
        assert positions is not None  # checked above
        seeds = [_noise_seed(params[b], generators[b]) for b in coupled]
        outcomes.update(zip(coupled, _accept_coupled(
            [logits[b] for b in coupled], [proposals[b] for b in coupled], [params[b] for b in coupled],
            seeds, [positions[b] for b in coupled],
        )))
    outcomes.update(zip(sampled, _accept_sampled(
        [logits[b] for b in sampled], [proposals[b] for b in sampled],
        [params[b] for b in sampled], [generators[b] for b in sampled],
    )))
    return [outcomes[b] for b in range(num_sessions)]


def cumulative_offsets(lengths: Sequence[int]) -> list[int]:
    """[B + 1] start of each session's rows in the flat batch, then the total.

    >>> cumulative_offsets([3, 1, 4])
    [0, 3, 4, 8]
    """
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    return offsets


def ragged_coordinates(lengths: Sequence[int]) -> tuple[list[int], list[int]]:
    """(session, column) of every flat row: flat row r is padded[session[r], column[r]].

    >>> ragged_coordinates([3, 1, 0, 2])
    ([0, 0, 0, 1, 3, 3], [0, 1, 2, 0, 0, 1])
    """
    session = [b for b, length in enumerate(lengths) for _ in range(length)]
    column = [j for length in lengths for j in range(length)]
    return session, column


def _accept_greedy(logits: Sequence[torch.Tensor], proposals: Sequence[DraftProposal]) -> list[VerifyOutcome]:
    if not logits:
        return []
    target_ids = torch.cat(list(logits)).argmax(dim=-1).tolist()  # [rows] the batch's one sync
    offsets = cumulative_offsets([rows.shape[0] for rows in logits])
    outcomes = []
    for b, proposal in enumerate(proposals):
        session_ids = target_ids[offsets[b]:offsets[b + 1]]  # [1 + k_b]
        if proposal.is_tree:
            outcomes.append(verify_tree_greedy(proposal.token_ids, proposal.tree_parents(), session_ids))
        else:
            outcomes.append(verify_greedy(proposal.token_ids, session_ids))
    return outcomes


def _noise_seed(params: SamplingParams, generator: torch.Generator) -> int:
    """A coupled session's noise seed: its params' (set by `resolve_seed` at every entry point), or its
    generator's when the params carry none."""
    return params.seed if params.seed is not None else generator.initial_seed()


def _accept_coupled(
    logits: Sequence[torch.Tensor],
    proposals: Sequence[DraftProposal],
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    positions: Sequence[int],
) -> list[VerifyOutcome]:
    """The coupled rule (`specmesh.decoding.coupled`) for every session at once: the target's token of
    every row in one vectorised call and one sync, then the greedy walk per session."""
    num_rows = [rows.shape[0] for rows in logits]
    p = processed_probs_rows(torch.cat(list(logits)), *_row_params(params, num_rows))  # [rows, vocab]
    vocab_size = p.shape[-1]
    noise = torch.cat([
        noise_rows(seed, row_positions(position, pr.parents, pr.num_tokens), vocab_size, p.device)
        for pr, seed, position in zip(proposals, seeds, positions)
    ])  # [rows, vocab]
    target_ids = coupled_sample(p, noise).tolist()  # [rows] the target's tokens; the one sync
    offsets = cumulative_offsets(num_rows)
    return [verify_coupled(pr.token_ids, target_ids[offsets[b]:offsets[b + 1]], pr.parents)
            for b, pr in enumerate(proposals)]


def _accept_sampled(
    logits: Sequence[torch.Tensor],
    proposals: Sequence[DraftProposal],
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
) -> list[VerifyOutcome]:
    if not logits:
        return []
    device = logits[0].device
    # Draw in session order, k_b + 1 each, as verify_sampled / verify_tree_sampled do one by one.
    positional = [not pr.is_tree and pr.q is None for pr in proposals]  # one-hot chains
    uniforms, states = [], []
    for pr, g, one_hot in zip(proposals, generators, positional):
        u, state = draw_positional_uniforms(pr.num_tokens, g, device) if one_hot else (draw_uniforms(1, pr.num_tokens, g, device)[0], None)
        uniforms.append(u)  # [1 + k_b]
        states.append(state)
    chains = [b for b, pr in enumerate(proposals) if not pr.is_tree]
    trees = [b for b, pr in enumerate(proposals) if pr.is_tree]
    order = chains + trees  # the chains' rows first: they form one contiguous block of p
    num_rows = [logits[b].shape[0] for b in order]
    row_params = _row_params([params[b] for b in order], num_rows)  # temperature, top_k, top_p [rows]
    p = processed_probs_rows(torch.cat([logits[b] for b in order]), *row_params)  # [rows, vocab]
    offsets = cumulative_offsets(num_rows)
    outcomes = dict(zip(chains, _accept_sampled_chains(
        p[:offsets[len(chains)]], [proposals[b] for b in chains], [uniforms[b] for b in chains],
        torch.tensor([positional[b] for b in chains], device=device),
    )))
    for b in chains:
        keep_used_uniforms(generators[b], states[b], len(outcomes[b].token_ids), device)
    for i, b in enumerate(trees, start=len(chains)):
        proposal = proposals[b]
        q = proposal.probs_q()
        outcomes[b] = verify_tree_sampled_with_uniforms(
            proposal.token_ids, proposal.tree_parents(), None if q is None else q.to(device),
            p[offsets[i]:offsets[i + 1]], uniforms[b],
        )
    return [outcomes[b] for b in range(len(proposals))]


def _accept_sampled_chains(
    p_flat: torch.Tensor,
    proposals: Sequence[DraftProposal],
    uniforms: Sequence[torch.Tensor],
    positional: torch.Tensor,
) -> list[VerifyOutcome]:
    """p_flat [sum(1 + k_b), vocab] and uniforms [1 + k_b] per chain -> outcomes, in one padded call;
    positional [B] marks the one-hot chains judged position by position."""
    if not proposals:
        return []
    device, vocab_size = p_flat.device, p_flat.shape[-1]
    num_drafts = [pr.num_tokens for pr in proposals]  # k_b
    batch_size, max_drafts = len(proposals), max(num_drafts)
    row_session, row_column = _index(ragged_coordinates([k + 1 for k in num_drafts]), device)  # [rows] each
    p = p_flat.new_zeros(batch_size, max_drafts + 1, vocab_size)  # [B, k_max + 1, vocab]
    p[row_session, row_column] = p_flat
    u = torch.zeros(batch_size, max_drafts + 1, dtype=torch.float64, device=device)  # [B, k_max + 1]
    u[row_session, row_column] = torch.cat(list(uniforms))
    draft_session, draft_column = _index(ragged_coordinates(num_drafts), device)  # [sum k_b] each
    flat_draft = torch.tensor([t for pr in proposals for t in pr.token_ids], dtype=torch.long, device=device)
    draft = torch.full((batch_size, max_drafts), PLACEHOLDER_TOKEN_ID, dtype=torch.long, device=device)  # [B, k_max]
    draft[draft_session, draft_column] = flat_draft
    q = None
    if max_drafts > 0 and any(pr.q is not None for pr in proposals):
        # one-hot rows stand in for q = None: p - onehot(x) clamps to 0 at x (p <= 1) and leaves p
        # elsewhere, exactly the residual verify_sampled_batch computes for q = None
        flat_q = torch.cat([_dense_q(pr, vocab_size) for pr in proposals]).to(device)  # [sum k_b, vocab]
        q = flat_q.new_zeros(batch_size, max_drafts, vocab_size)  # [B, k_max, vocab]
        q[draft_session, draft_column] = flat_q
    num_offered = torch.tensor(num_drafts, device=device)  # [B]
    outcome = verify_sampled_batch(draft, q, p, u, num_draft_tokens=num_offered, positional=positional)
    num_accepted, final_ids = torch.stack([outcome.num_accepted, outcome.final_token_ids]).tolist()  # one sync
    return [
        VerifyOutcome(
            accepted_nodes=list(range(n)),
            accepted_token_ids=[int(t) for t in pr.token_ids[:n]],
            final_token_id=final,
            final_kind=FinalTokenKind.BONUS if n == pr.num_tokens else FinalTokenKind.RECOVERED,
        )
        for pr, n, final in zip(proposals, num_accepted, final_ids)
    ]


def _row_params(params: Sequence[SamplingParams], num_rows: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """Temperature, top_k, top_p [rows] on the CPU: session b's params repeated num_rows[b] times."""
    per_row = [pa for pa, n in zip(params, num_rows) for _ in range(n)]
    return (
        torch.tensor([pa.temperature for pa in per_row], dtype=torch.float64),
        torch.tensor([pa.top_k for pa in per_row], dtype=torch.long),
        torch.tensor([pa.top_p for pa in per_row], dtype=torch.float64),
    )


def _dense_q(proposal: DraftProposal, vocab_size: int) -> torch.Tensor:
    """[k, vocab] float32 on the CPU: the proposal's q, or one-hot rows at its tokens for q = None."""
    q = proposal.probs_q()
    if q is not None:
        return q
    one_hot = torch.zeros(proposal.num_tokens, vocab_size, dtype=torch.float32)
    return one_hot.scatter_(-1, torch.tensor(proposal.token_ids, dtype=torch.long)[:, None], 1.0)


def _index(coordinates: tuple[list[int], list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    session, column = coordinates
    return (torch.tensor(session, dtype=torch.long, device=device),
            torch.tensor(column, dtype=torch.long, device=device))
