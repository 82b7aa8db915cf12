"""Exact verification of a chain of draft tokens (speculative sampling).

Papers: Leviathan, Kalman, Matias 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling".
Trees (several candidates per position) are in `specmesh.decoding.tree` and use the same words.

Glossary
- draft tokens x_0..x_{k-1}: proposed by the drafter; x_i was drawn from q_i, the drafter's
  *processed* distribution at position i (temperature / top-k / top-p applied). A deterministic
  drafter (n-gram lookup) has one-hot q_i, passed as `q=None`.
- target distributions p_0..p_k: the target's processed distributions from one forward over
  [last token, x_0, ..., x_{k-1}]; p_i judges x_i, p_k follows x_{k-1}.
- accepted: x_i is kept with probability min(1, p_i(x_i) / q_i(x_i)), tested in order.
- rejected: the first x_i that fails its test; it and every later draft token are discarded.
- recovered token: drawn at the first rejection i from the residual norm(max(0, p_i - q_i)),
  the part of p_i that q_i under-covers.
- bonus token: drawn from p_k when all k draft tokens were accepted.
- final token: the recovered or bonus token; every verification emits num_accepted + 1 tokens.

Why the output follows p exactly: at position i, token y is emitted either as the accepted draft,
with probability q(y) min(1, p(y)/q(y)) = min(p(y), q(y)), or as the recovered token, with
probability (1 - sum_z min(p(z), q(z))) * max(0, p(y) - q(y)) / sum_z max(0, p(z) - q(z)). The two
normalisers are equal (both are the total variation distance), so the sum is
min(p(y), q(y)) + max(0, p(y) - q(y)) = p(y).

Degenerate residual: max(0, p - q) sums to 0 only if p <= q everywhere, i.e. p == q (both sum to 1).
Then every draft token drawn from q is accepted with probability 1, so the rejection we are handling
had probability 0 (it needs float rounding, or a draft token outside q's support). We then draw from
p itself, the distribution the emitted token must follow anyway.

Greedy (temperature 0): accept while x_i == argmax p_i, then emit the target's argmax. With one-hot
p the sampling rule reduces to exactly this, but `verify_greedy` needs only the argmax ids.

Randomness: one uniform per draft token for its test, plus one for the final token, drawn up front
from the request's generator (always k + 1 draws, so the stream stays aligned across outcomes).

One-hot drafts (q = None: greedy or n-gram drafters) are judged position by position instead: at
position i the target samples y_i from p_i by inverse CDF with the position's uniform, x_i is
accepted iff y_i == x_i, and at the first mismatch y_i is the final token. That is the same exact
rule (P(accept) = p_i(x_i); a rejection emits y ~ p_i given y != x_i, which is the residual
norm(max(0, p_i - onehot(x_i)))), and it reads exactly the uniforms plain decoding would read: one
per emitted token, in order. `draw_positional_uniforms` / `keep_used_uniforms` leave the generator
exactly num_accepted + 1 draws on, so a seeded speculative run with a deterministic drafter emits
the very tokens of plain decoding with the same seed, whatever k and whatever is accepted.

This module is the standard rule (`AcceptanceRule.STANDARD`): its generator is read round by round,
so a seeded request's text depends on how its tokens were grouped into rounds unless every draft is
one-hot. The coupled rule (`AcceptanceRule.COUPLED`, `specmesh.decoding.coupled`) draws each
position's token with noise that is a pure function of (seed, position) instead, so the text does not
depend on the rounds at all; `specmesh.decoding.acceptance` applies whichever a session's params say.

Worked example (q = None, i.e. an n-gram draft; vocab of 3):
    >>> import torch
    >>> p = torch.tensor([[0.0, 1.0, 0.0],    # p_0: the target is sure of token 1
    ...                   [0.5, 0.0, 0.5],    # p_1: token 1 impossible here
    ...                   [0.2, 0.3, 0.5]])   # p_2: bonus row, not reached
    >>> outcome = verify_sampled([1, 1], None, p, torch.Generator().manual_seed(0))
    >>> outcome.accepted_token_ids, outcome.final_kind.value   # x_0 kept, x_1 rejected
    ([1], 'recovered')
    >>> outcome.final_token_id in (0, 2)   # drawn from norm(max(0, p_1 - onehot(1))) = [0.5, 0, 0.5]
    True
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specmesh.decoding.sampling import sample_with_uniforms
from specmesh.decoding.types import BatchVerifyOutcome, FinalTokenKind, VerifyOutcome


def verify_greedy(draft_ids: Sequence[int], target_ids: Sequence[int]) -> VerifyOutcome:
    """Accept while draft_ids[i] == target_ids[i]; the final token is the target's at the first
    mismatch (recovered) or target_ids[k] (bonus).

    draft_ids [k], target_ids [k + 1] = argmax of the target's logits at each row.

    >>> verify_greedy([7, 8, 9], [7, 8, 4, 5]).token_ids
    [7, 8, 4]
    """
    k = len(draft_ids)
    if len(target_ids) != k + 1:
        raise ValueError(f"target_ids must have k + 1 = {k + 1} entries, got {len(target_ids)}")
    num_accepted = 0
    while num_accepted < k and int(draft_ids[num_accepted]) == int(target_ids[num_accepted]):
        num_accepted += 1
    return VerifyOutcome(
        accepted_nodes=list(range(num_accepted)),
        accepted_token_ids=[int(t) for t in draft_ids[:num_accepted]],
        final_token_id=int(target_ids[num_accepted]),
        final_kind=FinalTokenKind.BONUS if num_accepted == k else FinalTokenKind.RECOVERED,
    )


def verify_sampled(
    draft_ids: Sequence[int],
    q: torch.Tensor | None,
    p: torch.Tensor,
    generator: torch.Generator,
) -> VerifyOutcome:
    """Speculative sampling of one sequence (glossary above).

    draft_ids [k]; q [k, vocab] or None (one-hot at the draft tokens); p [k + 1, vocab].
    The generator must live on p's device.
    """
    k = len(draft_ids)
    draft = torch.as_tensor(list(draft_ids), dtype=torch.long, device=p.device).reshape(1, k)
    if q is None:
        uniforms, state = draw_positional_uniforms(k, generator, p.device)
    else:
        uniforms, state = draw_uniforms(1, k, generator, p.device)[0], None
    batch = verify_sampled_batch(draft, None if q is None else q[None], p[None], uniforms[None])
    num_accepted = int(batch.num_accepted[0])
    if state is not None:
        keep_used_uniforms(generator, state, num_accepted + 1, p.device)
    return VerifyOutcome(
        accepted_nodes=list(range(num_accepted)),
        accepted_token_ids=[int(t) for t in draft_ids[:num_accepted]],
        final_token_id=int(batch.final_token_ids[0]),
        final_kind=FinalTokenKind.BONUS if num_accepted == k else FinalTokenKind.RECOVERED,
    )


def draw_uniforms(batch_size: int, k: int, generator: torch.Generator, device: torch.device | str) -> torch.Tensor:
    """[batch_size, k + 1] float64 uniforms in [0, 1): k acceptance tests, then the final token."""
    return torch.rand(batch_size, k + 1, generator=generator, device=device, dtype=torch.float64)


def draw_positional_uniforms(k: int, generator: torch.Generator,
                             device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[k + 1] float64 uniforms for a one-hot draft, drawn one at a time as plain decoding draws them,
    and the generator's state before them (None when k = 0: the one draw is always used)."""
    state = generator.get_state() if k else None
    uniforms = [torch.rand(1, generator=generator, device=device, dtype=torch.float64) for _ in range(k + 1)]
    return torch.cat(uniforms), state


def keep_used_uniforms(generator: torch.Generator, state: torch.Tensor | None, num_used: int,
                       device: torch.device | str) -> None:
    """Rewind the generator to `state` and redraw the `num_used` uniforms a positional verification
    read, so the stream goes on exactly where plain decoding's would."""
    if state is None:
        return
    generator.set_state(state)
    for _ in range(num_used):
        torch.rand(1, generator=generator, device=device, dtype=torch.float64)


def verify_sampled_batch(
    draft_ids: torch.Tensor,
    q: torch.Tensor | None,
    p: torch.Tensor,
    uniforms: torch.Tensor,
    num_draft_tokens: torch.Tensor | None = None,
    positional: torch.Tensor | None = None,
) -> BatchVerifyOutcome:
    """Speculative sampling of B sequences at once, with the randomness given as uniforms.

    draft_ids [B, k]; q [B, k, vocab] or None (one-hot); p [B, k + 1, vocab];
    uniforms [B, k + 1]: column i < k tests draft i (accept iff u * q(x) < p(x), which happens with
    probability min(1, p(x)/q(x))); column k draws the final token by inverse CDF.
    Rigged uniforms force outcomes in tests; per-request generators fill them in `verify_sampled`.

    Ragged batches: num_draft_tokens [B] (None = k everywhere) gives row b its own k_b <= k. Row b
    then offers draft_ids[b, :k_b] (later columns are padding, e.g. PLACEHOLDER_TOKEN_ID, and never
    read), p[b, k_b] is its bonus row and uniforms[b, k_b] draws its final token: each row keeps the
    layout of a batch of its own, left-aligned, so its outcome is the one it would get alone.

    positional [B] bool: rows with a one-hot draft judged position by position (module docstring);
    None = every row when q is None, no row otherwise. Such a row's q (if q is given) is ignored.
    """
    batch_size, k = draft_ids.shape
    _check_chain_shapes(batch_size, k, q, p, uniforms)
    if num_draft_tokens is None:
        num_offered = torch.full((batch_size,), k, dtype=torch.long, device=p.device)  # [B]
    elif tuple(num_draft_tokens.shape) == (batch_size,):
        num_offered = num_draft_tokens.to(device=p.device, dtype=torch.long)  # [B], each in 0..k
    else:
        raise ValueError(f"num_draft_tokens must be [B={batch_size}], got {tuple(num_draft_tokens.shape)}")
    rows = torch.arange(batch_size, device=p.device)
    offered = torch.arange(k, device=p.device)[None, :] < num_offered[:, None]  # [B, k]
    out_of_vocab = (draft_ids < 0) | (draft_ids >= p.shape[-1])  # [B, k]
    if k > 0 and bool((offered & out_of_vocab).any()):
        raise ValueError(f"draft token ids must lie in [0, {p.shape[-1]})")
    draft = torch.where(offered, draft_ids.long(), 0)  # [B, k], padding read as token 0, never accepted
    p_draft = p[:, :k].gather(-1, draft[..., None]).squeeze(-1).double()  # [B, k]
    q_draft = torch.ones_like(p_draft) if q is None else q.gather(-1, draft[..., None]).squeeze(-1).double()
    accepted = (uniforms[:, :k] * q_draft < p_draft) & offered  # [B, k]
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)  # [B] length of the accepted prefix
    final_dist = p[rows, num_accepted]  # [B, vocab]: the bonus row where num_accepted == k_b
    if k > 0:
        rejected_at = torch.minimum(num_accepted, (num_offered - 1).clamp_min(0))  # [B], used where num_accepted < k_b
        if q is None:
            residual = final_dist.scatter(-1, draft[rows, rejected_at][:, None], 0.0)
        else:
            residual = (final_dist - q[rows, rejected_at]).clamp_min(0.0)
        use_residual = (num_accepted < num_offered) & (residual.sum(dim=-1) > 0)  # [B]
        final_dist = torch.where(use_residual[:, None], residual, final_dist)
    final_ids = sample_with_uniforms(final_dist, uniforms[rows, num_offered])  # normalises implicitly
    if positional is None:
        positional = torch.full((batch_size,), q is None, dtype=torch.bool, device=p.device)
    if bool(positional.any()):
        num_accepted, final_ids = _judge_positionally(draft, p, uniforms, offered, positional, num_accepted, final_ids)
    return BatchVerifyOutcome(num_accepted=num_accepted, final_token_ids=final_ids)


def _judge_positionally(draft: torch.Tensor, p: torch.Tensor, uniforms: torch.Tensor, offered: torch.Tensor,
                        positional: torch.Tensor, num_accepted: torch.Tensor, final_ids: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The positional rule for the rows in `positional`; other rows keep their outcome."""
    batch_size, k_plus_1, vocab_size = p.shape
    picked = positional.nonzero().squeeze(-1)  # [P]
    sampled = sample_with_uniforms(p[picked].reshape(-1, vocab_size), uniforms[picked].reshape(-1))
    sampled = sampled.reshape(len(picked), k_plus_1)  # [P, k + 1] y_i per position (padding rows unread)
    k = k_plus_1 - 1
    matches = (sampled[:, :k] == draft[picked]) & offered[picked]  # [P, k]
    picked_accepted = matches.long().cumprod(dim=-1).sum(dim=-1)  # [P]
    num_accepted = num_accepted.clone()
    final_ids = final_ids.clone()
    num_accepted[picked] = picked_accepted
    final_ids[picked] = sampled[torch.arange(len(picked), device=p.device), picked_accepted]
    return num_accepted, final_ids


def _check_chain_shapes(batch_size: int, k: int, q: torch.Tensor | None, p: torch.Tensor, uniforms: torch.Tensor) -> None:
    if p.dim() != 3 or p.shape[:2] != (batch_size, k + 1):
        raise ValueError(f"p must be [B={batch_size}, k+1={k + 1}, vocab], got {tuple(p.shape)}")
    if q is not None and tuple(q.shape) != (batch_size, k, p.shape[-1]):
        raise ValueError(f"q must be [B={batch_size}, k={k}, vocab={p.shape[-1]}], got {tuple(q.shape)}")
    if tuple(uniforms.shape) != (batch_size, k + 1):
        raise ValueError(f"uniforms must be [B={batch_size}, k+1={k + 1}], got {tuple(uniforms.shape)}")
