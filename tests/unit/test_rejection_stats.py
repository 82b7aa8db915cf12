"""Statistical exactness: speculative decoding's output follows the target, whatever the draft.

The target and the drafter are Markov chains over a 5-token vocabulary (next-token distribution =
a row of P resp. Q, picked by the previous token), so p and q depend on the drafted context like a
real model's do. Seeds are fixed, so each test is deterministic; a chi-square goodness-of-fit test
on >= 10,000 trials must give a p-value > 0.001.
"""

import pytest
import torch
from scipy.stats import chisquare

from specmesh.decoding.rejection import verify_sampled_batch
from specmesh.decoding.sampling import sample_with_uniforms
from specmesh.decoding.tree import verify_tree_sampled_with_uniforms
from specmesh.decoding.types import PLACEHOLDER_TOKEN_ID

VOCAB_SIZE = 5
START = 0
NUM_TRIALS = 20_000
MIN_P_VALUE = 0.001

# Target transitions P[prev] (one row with a zero: token 4 never follows token 3).
P = torch.tensor([
    [0.10, 0.40, 0.25, 0.15, 0.10],
    [0.30, 0.05, 0.30, 0.25, 0.10],
    [0.20, 0.20, 0.20, 0.20, 0.20],
    [0.45, 0.10, 0.15, 0.30, 0.00],
    [0.05, 0.15, 0.50, 0.10, 0.20],
])
# A model-like drafter: close to P in places, far in others, zero where P is not (and vice versa).
Q = torch.tensor([
    [0.30, 0.10, 0.30, 0.00, 0.30],
    [0.25, 0.10, 0.35, 0.20, 0.10],
    [0.05, 0.60, 0.05, 0.25, 0.05],
    [0.40, 0.10, 0.10, 0.20, 0.20],
    [0.20, 0.20, 0.20, 0.20, 0.20],
])
# A second drafter for trees whose siblings come from different distributions.
Q2 = torch.roll(Q, shifts=1, dims=1)


def deterministic_draft(prev: torch.Tensor) -> torch.Tensor:
    """A stand-in for an n-gram drafter: the next draft token is a fixed function of the context."""
    return (prev * 2 + 1) % VOCAB_SIZE


def assert_follows(samples: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Chi-square goodness of fit of integer samples against expected_probs; returns the p-value."""
    counts = torch.bincount(samples, minlength=expected_probs.numel()).double()
    support = expected_probs > 0
    assert counts[~support].sum() == 0, "emitted a token the target gives probability 0"
    expected = expected_probs[support].double() * counts.sum() / expected_probs[support].double().sum()
    p_value = chisquare(counts[support].numpy(), expected.numpy()).pvalue
    assert p_value > MIN_P_VALUE
    return p_value


def pair_probs(start: int) -> torch.Tensor:
    """[VOCAB_SIZE ** 2] target probability of the first two tokens (a, b), flattened as a * V + b."""
    return (P[start][:, None] * P).flatten()


def run_chain(k: int, draft_kind: str, num_rounds: int, gen: torch.Generator) -> torch.Tensor:
    """Full speculative decoding loop, vectorised over NUM_TRIALS independent sequences.

    Returns emitted tokens [NUM_TRIALS, num_rounds * (k + 1)] (PLACEHOLDER_TOKEN_ID past the end)."""
    rows = torch.arange(NUM_TRIALS)
    last = torch.full((NUM_TRIALS,), START)
    emitted = torch.full((NUM_TRIALS, num_rounds * (k + 1)), PLACEHOLDER_TOKEN_ID)
    lengths = torch.zeros(NUM_TRIALS, dtype=torch.long)
    for _ in range(num_rounds):
        drafts, qs, prev = [], [], last
        for _ in range(k):
            if draft_kind == "model":
                qs.append(Q[prev])
                prev = sample_with_uniforms(Q[prev], torch.rand(NUM_TRIALS, generator=gen, dtype=torch.float64))
            else:
                prev = deterministic_draft(prev)
            drafts.append(prev)
        draft = torch.stack(drafts, dim=1)  # [T, k]
        q = torch.stack(qs, dim=1) if qs else None  # [T, k, V]
        p = P[torch.cat([last[:, None], draft], dim=1)]  # [T, k + 1, V]
        uniforms = torch.rand(NUM_TRIALS, k + 1, generator=gen, dtype=torch.float64)
        outcome = verify_sampled_batch(draft, q, p, uniforms)
        tokens = outcome.token_ids(draft)  # [T, k + 1]
        valid = tokens != PLACEHOLDER_TOKEN_ID
        columns = lengths[:, None] + torch.arange(k + 1)
        emitted[rows[:, None].expand_as(tokens)[valid], columns[valid]] = tokens[valid]
        lengths += outcome.num_accepted + 1
        last = outcome.final_token_ids
    return emitted


@pytest.mark.parametrize("draft_kind", ["model", "deterministic"])
@pytest.mark.parametrize("k", [1, 3])
def test_chain_first_two_tokens_follow_the_target(draft_kind, k):
    emitted = run_chain(k, draft_kind, num_rounds=2, gen=torch.Generator().manual_seed(1000 + k))
    assert_follows(emitted[:, 0] * VOCAB_SIZE + emitted[:, 1], pair_probs(START))


def test_first_token_with_disjoint_truncated_supports():
    # like top-k on both sides: q puts mass where p has none and misses p's mode entirely
    p = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0])
    q = torch.tensor([0.0, 0.2, 0.3, 0.4, 0.1])
    gen = torch.Generator().manual_seed(7)
    draft = sample_with_uniforms(q.expand(NUM_TRIALS, -1), torch.rand(NUM_TRIALS, generator=gen, dtype=torch.float64))
    outcome = verify_sampled_batch(draft[:, None], q.expand(NUM_TRIALS, 1, -1), p.expand(NUM_TRIALS, 2, -1),
                                   torch.rand(NUM_TRIALS, 2, generator=gen, dtype=torch.float64))
    first = outcome.token_ids(draft[:, None])[:, 0]
    assert_follows(first, p)


def test_the_check_has_power_against_accepting_every_draft():
    gen = torch.Generator().manual_seed(8)
    draft = sample_with_uniforms(Q[START].expand(NUM_TRIALS, -1), torch.rand(NUM_TRIALS, generator=gen, dtype=torch.float64))
    with pytest.raises(AssertionError):
        assert_follows(draft, P[START])


def run_tree(draft_kind: str, num_trials: int, gen: torch.Generator) -> torch.Tensor:
    """One tree verification per trial, then one plain target step if only one token came out.

    Tree: root -> three children c_j (drawn from Q, Q2, Q at the root, or deterministic and distinct);
    each c_j -> one grandchild g_j (drawn from Q[c_j], or deterministic). Returns [num_trials, 2]."""
    parents = [-1, -1, -1, 0, 1, 2]
    root_qs = [Q[START], Q2[START], Q[START]]
    out = torch.empty(num_trials, 2, dtype=torch.long)
    for trial in range(num_trials):
        if draft_kind == "model":
            u = torch.rand(6, generator=gen, dtype=torch.float64)
            children = [int(sample_with_uniforms(root_qs[j][None], u[j:j + 1])) for j in range(3)]
            grandchildren = [int(sample_with_uniforms(Q[c][None], u[3 + j:4 + j])) for j, c in enumerate(children)]
            q = torch.stack([*root_qs, *(Q[c] for c in children)])
        else:
            children = [2, 0, 4]
            grandchildren = [int(deterministic_draft(torch.tensor(c))) for c in children]
            q = None
        tokens = children + grandchildren
        p = P[torch.tensor([START, *tokens])]
        outcome = verify_tree_sampled_with_uniforms(tokens, parents, q, p, torch.rand(7, generator=gen, dtype=torch.float64))
        emitted = outcome.token_ids
        if len(emitted) == 1:  # next step: a plain decode from the target
            emitted.append(int(sample_with_uniforms(P[emitted[0]][None], torch.rand(1, generator=gen, dtype=torch.float64))))
        out[trial] = torch.tensor(emitted[:2])
    return out


@pytest.mark.parametrize("draft_kind", ["model", "deterministic"])
def test_tree_first_two_tokens_follow_the_target(draft_kind):
    emitted = run_tree(draft_kind, num_trials=10_000, gen=torch.Generator().manual_seed(2024))
    assert_follows(emitted[:, 0], P[START])
    assert_follows(emitted[:, 0] * VOCAB_SIZE + emitted[:, 1], pair_probs(START))
