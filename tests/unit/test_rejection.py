"""Rigged-logit tables for chain and tree verification: every outcome here is forced."""


import pytest
import torch

from specmesh.decoding.rejection import verify_greedy, verify_sampled, verify_sampled_batch
from specmesh.decoding.tree import (
    chain_parents,
    verify_tree_greedy,
    verify_tree_sampled,
    verify_tree_sampled_with_uniforms,
)
from specmesh.decoding.types import PLACEHOLDER_TOKEN_ID, FinalTokenKind

RECOVERED, BONUS = FinalTokenKind.RECOVERED, FinalTokenKind.BONUS


def one_hot(token: int, vocab_size: int = 4) -> list[float]:
    return [1.0 if i == token else 0.0 for i in range(vocab_size)]



# Each case: draft_ids [k], q [k][vocab] or None, p [k+1][vocab], expected accepted count, final token,
# final kind. Acceptance is forced by p(x) >= q(x) (always) or p(x) == 0 (never), and the final token
# by a residual or bonus row with a single-token support.
CHAIN_CASES = {
    "all accepted, bonus": (
        [1, 2], [[0.1, 0.5, 0.2, 0.2], [0.3, 0.0, 0.6, 0.1]],
        [[0.0, 0.9, 0.1, 0.0], [0.0, 0.0, 1.0, 0.0], one_hot(3)], 2, 3, BONUS),
    "first rejected": (
        [1, 2], [[0.1, 0.5, 0.2, 0.2], [0.3, 0.0, 0.6, 0.1]],
        [one_hot(0), one_hot(2), one_hot(3)], 0, 0, RECOVERED),
    "middle rejected": (
        [1, 2, 3], [[0.1, 0.5, 0.2, 0.2], [0.5, 0.0, 0.4, 0.1], [0.25] * 4],
        [one_hot(1), [0.5, 0.0, 0.0, 0.5], one_hot(0), one_hot(1)], 1, 3, RECOVERED),
    "residual is p minus q": (
        [2], [[0.0, 0.5, 0.5, 0.0]],
        [[0.0, 0.5, 0.0, 0.5], one_hot(0)], 0, 3, RECOVERED),
    "one-hot q all accepted": (
        [3, 0], None, [one_hot(3), one_hot(0), one_hot(2)], 2, 2, BONUS),
    "one-hot q rejected, residual drops the draft token": (
        [3, 0], None, [one_hot(3), [0.0, 0.0, 0.0, 1.0], one_hot(2)], 1, 3, RECOVERED),
    "q equals p: always accepted": (
        [1, 1], [[0.1, 0.4, 0.3, 0.2], [0.7, 0.1, 0.1, 0.1]],
        [[0.1, 0.4, 0.3, 0.2], [0.7, 0.1, 0.1, 0.1], one_hot(2)], 2, 2, BONUS),
    "disjoint supports: residual is p": (
        [0, 1], [[0.5, 0.5, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]],
        [one_hot(2), one_hot(3), one_hot(1)], 0, 2, RECOVERED),
    "p == q but the draft token lies outside q: empty residual, draw from p": (
        [0], [[0.0, 0.0, 0.0, 1.0]], [one_hot(3), one_hot(1)], 0, 3, RECOVERED),
    "no draft tokens: plain decode": (
        [], [], [one_hot(1)], 0, 1, BONUS),
}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", CHAIN_CASES.values(), ids=CHAIN_CASES.keys())
def test_chain_table(case, seed):
    draft_ids, q, p, num_accepted, final_token, kind = case
    q_tensor = None if q is None else torch.tensor(q).reshape(len(draft_ids), 4)
    outcome = verify_sampled(draft_ids, q_tensor, torch.tensor(p), torch.Generator().manual_seed(seed))
    assert outcome.num_accepted == num_accepted
    assert outcome.accepted_nodes == list(range(num_accepted))
    assert outcome.token_ids == [*draft_ids[:num_accepted], final_token]
    assert outcome.final_kind is kind


@pytest.mark.parametrize("case", CHAIN_CASES.values(), ids=CHAIN_CASES.keys())
def test_tree_verifier_on_a_chain_matches_the_table(case):
    draft_ids, q, p, num_accepted, final_token, kind = case
    q_tensor = None if q is None else torch.tensor(q).reshape(len(draft_ids), 4)
    outcome = verify_tree_sampled(draft_ids, chain_parents(len(draft_ids)), q_tensor, torch.tensor(p),
                                  torch.Generator().manual_seed(0))
    assert (outcome.num_accepted, outcome.final_token_id, outcome.final_kind) == (num_accepted, final_token, kind)


@pytest.mark.parametrize("u, accepted", [(0.49, True), (0.51, False)])
def test_rigged_uniform_decides_acceptance_at_ratio_p_over_q(u, accepted):
    # p(x) / q(x) = 0.3 / 0.6 = 0.5: accepted iff u < 0.5; on rejection the residual is one-hot at 2
    draft = torch.tensor([[1]])
    q = torch.tensor([[[0.4, 0.6, 0.0, 0.0]]])
    p = torch.tensor([[[0.4, 0.3, 0.3, 0.0], one_hot(3)]])
    outcome = verify_sampled_batch(draft, q, p, torch.tensor([[u, 0.5]], dtype=torch.float64))
    assert outcome.num_accepted.tolist() == [1 if accepted else 0]
    assert outcome.final_token_ids.tolist() == [3 if accepted else 2]


def test_batch_matches_one_by_one_and_pads_token_ids():
    gen = torch.Generator().manual_seed(7)
    batch_size, k, vocab_size = 6, 3, 5
    p = torch.softmax(torch.randn(batch_size, k + 1, vocab_size, generator=gen) * 2, -1)
    q = torch.softmax(torch.randn(batch_size, k, vocab_size, generator=gen) * 2, -1)
    draft = torch.randint(vocab_size, (batch_size, k), generator=gen)
    uniforms = torch.rand(batch_size, k + 1, generator=gen, dtype=torch.float64)
    batch = verify_sampled_batch(draft, q, p, uniforms)
    padded = batch.token_ids(draft)
    for b in range(batch_size):
        single = verify_sampled_batch(draft[b:b + 1], q[b:b + 1], p[b:b + 1], uniforms[b:b + 1])
        n = int(single.num_accepted[0])
        assert n == int(batch.num_accepted[b])
        assert padded[b].tolist() == [*draft[b, :n].tolist(), int(single.final_token_ids[0])] + [PLACEHOLDER_TOKEN_ID] * (k - n)
        tree = verify_tree_sampled_with_uniforms(draft[b].tolist(), chain_parents(k), q[b], p[b], uniforms[b])
        assert tree.num_accepted == n and tree.final_token_id == int(single.final_token_ids[0])


def test_same_seed_same_outcome_different_seeds_differ():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(5, 50, generator=gen), -1)
    q = torch.softmax(torch.randn(4, 50, generator=gen), -1)
    draft = [3, 9, 27, 1]
    runs = {seed: [verify_sampled(draft, q, p, g).token_ids for g in [torch.Generator().manual_seed(seed)] for _ in range(20)]
            for seed in range(4)}
    again = [verify_sampled(draft, q, p, g).token_ids for g in [torch.Generator().manual_seed(0)] for _ in range(20)]
    assert runs[0] == again
    assert len({tuple(map(tuple, r)) for r in runs.values()}) == 4


@pytest.mark.parametrize(
    "draft, target, tokens, kind",
    [
        ([7, 8, 9], [7, 8, 9, 5], [7, 8, 9, 5], BONUS),
        ([7, 8, 9], [6, 8, 9, 5], [6], RECOVERED),
        ([7, 8, 9], [7, 8, 4, 5], [7, 8, 4], RECOVERED),
        ([], [3], [3], BONUS),
    ],
)
def test_greedy_table(draft, target, tokens, kind):
    outcome = verify_greedy(draft, target)
    assert (outcome.token_ids, outcome.final_kind) == (tokens, kind)


def test_sampled_with_one_hot_p_is_greedy():
    gen = torch.Generator().manual_seed(3)
    for _ in range(50):
        target = torch.randint(6, (4,), generator=gen)
        draft = torch.where(torch.rand(3, generator=gen) < 0.7, target[:3], torch.randint(6, (3,), generator=gen)).tolist()
        p = torch.nn.functional.one_hot(target, 6).float()
        q = torch.softmax(torch.randn(3, 6, generator=gen), -1)
        assert verify_sampled(draft, q, p, gen).token_ids == verify_greedy(draft, target.tolist()).token_ids


@pytest.mark.parametrize(
    "draft, q_shape, p_shape, message",
    [([1], (2, 4), (2, 4), "q must be"), ([1], None, (3, 4), "p must be"), ([9], None, (2, 4), "lie in")],
)
def test_malformed_inputs_raise_value_error(draft, q_shape, p_shape, message):
    q = None if q_shape is None else torch.full(q_shape, 0.25)
    with pytest.raises(ValueError, match=message):
        verify_sampled(draft, q, torch.full(p_shape, 0.25), torch.Generator())
    with pytest.raises(ValueError, match="target_ids"):
        verify_greedy([1, 2], [1, 2])


# ---- trees -------------------------------------------------------------------------------------
# Tree used below:  root -> 0:a=0, 1:b=1 (siblings);  1 -> 2:c=2;  2 -> 3:d=3, 4:e=0
TREE_TOKENS = [0, 1, 2, 3, 0]
TREE_PARENTS = [-1, -1, 1, 2, 2]


def test_tree_greedy_worked_example():
    outcome = verify_tree_greedy([5, 6, 7, 8], [-1, -1, 1, 1], [6, 9, 8, 1, 2])
    assert (outcome.accepted_nodes, outcome.token_ids, outcome.final_kind) == ([1, 3], [6, 8, 2], BONUS)


@pytest.mark.parametrize(
    "target_ids, path, final, kind",
    [
        ([1, 9, 2, 0, 9, 3], [1, 2, 4], 3, BONUS),  # second sibling at the root, last child at node 2
        ([2, 9, 2, 0, 9, 3], [], 2, RECOVERED),  # nothing matches at the root
        ([0, 1, 2, 0, 9, 3], [0], 1, BONUS),  # a leaf accepted
        ([1, 9, 3, 1, 9, 3], [1], 3, RECOVERED),  # node 1's only child rejected
    ],
)
def test_tree_greedy_table(target_ids, path, final, kind):
    outcome = verify_tree_greedy(TREE_TOKENS, TREE_PARENTS, target_ids)
    assert (outcome.accepted_nodes, outcome.final_token_id, outcome.final_kind) == (path, final, kind)
    assert outcome.accepted_token_ids == [TREE_TOKENS[n] for n in path]


@pytest.mark.parametrize("seed", [0, 1])
def test_tree_sampled_deterministic_candidates_forced(seed):
    # p rows: root, after a, b, c, d, e.  Root: p(a)=0 -> a rejected; residual p with a zeroed -> b sure.
    p = torch.tensor([one_hot(1), one_hot(3), one_hot(2), [1.0, 0.0, 0.0, 0.0], one_hot(3), one_hot(2)])
    outcome = verify_tree_sampled(TREE_TOKENS, TREE_PARENTS, None, p, torch.Generator().manual_seed(seed))
    # b accepted, c accepted, at node 2: d (3) rejected (p(3)=0), e (0) accepted, e is a leaf: bonus from row 5
    assert (outcome.accepted_nodes, outcome.token_ids, outcome.final_kind) == ([1, 2, 4], [1, 2, 0, 2], BONUS)


@pytest.mark.parametrize("u_second, path, final", [(0.3, [1], 3), (0.7, [], 2)])
def test_tree_sibling_is_judged_against_the_residual(u_second, path, final):
    # Root p = [0, .5, .5, 0]. Child a (token 0, q one-hot at 0) is rejected for sure; residual
    # max(0, p - q_a) = p. Child b (token 1) with q_b = [0, 1, 0, 0]: accepted iff u < p(1) = 0.5;
    # if rejected, the residual is one-hot at 2 (recovered).
    q = torch.tensor([one_hot(0), one_hot(1)])
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0], one_hot(2), one_hot(3)])
    uniforms = torch.tensor([0.1, u_second, 0.5], dtype=torch.float64)
    outcome = verify_tree_sampled_with_uniforms([0, 1], [-1, -1], q, p, uniforms)
    assert (outcome.accepted_nodes, outcome.final_token_id) == (path, final)
    assert outcome.final_kind is (BONUS if path else RECOVERED)


def test_tree_rejects_bad_parents():
    p = torch.full((3, 4), 0.25)
    with pytest.raises(ValueError, match="parents"):
        verify_tree_sampled([0, 1], [-1, 1], None, p, torch.Generator())
    with pytest.raises(ValueError, match="parents"):
        verify_tree_greedy([0, 1], [-1], [0, 1, 2])
