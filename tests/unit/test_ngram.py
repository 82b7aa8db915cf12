import random

import pytest
import torch

from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.rejection import verify_greedy
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.tree import tree_children, validate_parents, verify_tree_greedy
from specmesh.drafters.ngram import NgramStore, NgramStoreDrafter, PromptLookupDrafter, PromptLookupIndex

GREEDY = SamplingParams(temperature=0)



def reference_prompt_lookup(tokens: list[int], min_n: int, max_n: int, max_tokens: int) -> list[int]:
    """Brute force: latest earlier occurrence (with a continuation) of the longest matching suffix."""
    length = len(tokens)
    for n in range(min(max_n, length), min_n - 1, -1):
        suffix = tokens[length - n:]
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                extended = list(tokens)
                for offset in range(max_tokens):
                    extended.append(extended[start + n + offset])
                return extended[length:]
    return []


def random_chunks(rng: random.Random, tokens: list[int]) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(tokens):
        size = rng.randint(1, 5)
        chunks.append(tokens[i:i + size])
        i += size
    return chunks


@pytest.mark.parametrize("min_n, max_n", [(1, 1), (1, 3), (2, 4)])
def test_prompt_lookup_index_matches_brute_force(min_n, max_n):
    rng = random.Random(min_n * 10 + max_n)
    for _ in range(20):
        tokens = [rng.randrange(3) for _ in range(rng.randint(0, 40))]
        index = PromptLookupIndex(min_n, max_n)
        seen: list[int] = []
        for chunk in random_chunks(rng, tokens):
            index.extend(chunk)
            seen += chunk
            for max_tokens in (1, 4):
                assert index.propose(max_tokens) == reference_prompt_lookup(seen, min_n, max_n, max_tokens)


def test_ngram_store_counts_match_brute_force():
    rng = random.Random(5)
    tokens = [rng.randrange(4) for _ in range(200)]
    store = NgramStore(min_n=1, max_n=3)
    for chunk in random_chunks(rng, tokens):
        store.extend(chunk)
    for context in ([1], [2, 3], [0, 1, 2], [3, 3, 3]):
        n = len(context)
        expected: dict[int, int] = {}
        for i in range(n, len(tokens)):
            if tokens[i - n:i] == context:
                expected[tokens[i]] = expected.get(tokens[i], 0) + 1
        if expected:
            assert dict(store.continuations(context)) == expected
        else:  # unseen context: back off to the shorter one
            assert store.continuations(context) == store.continuations(context[1:])
        counts = [count for _, count in store.continuations(context)]
        assert counts == sorted(counts, reverse=True)


@pytest.mark.parametrize("max_branching", [1, 2, 3])
def test_store_tree_is_well_formed(max_branching):
    rng = random.Random(max_branching)
    store = NgramStore(min_n=1, max_n=3)
    store.extend([rng.randrange(6) for _ in range(300)])
    for max_tokens in (0, 1, 5, 12):
        token_ids, parents = store.propose_tree(max_tokens, max_branching)
        assert len(token_ids) == len(parents) <= max_tokens
        validate_parents(parents, len(token_ids))
        for children in tree_children(parents):
            assert len(children) <= max_branching
            assert len({token_ids[c] for c in children}) == len(children)  # siblings are distinct
        if max_branching == 1:
            assert parents == list(range(-1, len(token_ids) - 1))


def test_orders_are_validated():
    for cls in (PromptLookupIndex, NgramStore, PromptLookupDrafter, NgramStoreDrafter):
        with pytest.raises(ValueError, match="min_n"):
            cls(min_n=0, max_n=2)
        with pytest.raises(ValueError, match="min_n"):
            cls(min_n=3, max_n=2)
    with pytest.raises(ValueError, match="max_branching"):
        NgramStoreDrafter(max_branching=0)


def test_prompt_lookup_drafter_session_flow():
    drafter = PromptLookupDrafter(min_n=1, max_n=3)
    state = drafter.open([10, 11, 12, 13, 10])
    generator = torch.Generator().manual_seed(0)
    first = drafter.propose(state, [11], 3, GREEDY, generator)
    assert first == DraftProposal(token_ids=[12, 13, 10])
    second = drafter.propose(state, [12, 99], 3, GREEDY, generator)  # 12 accepted, 99 from the target
    assert second.token_ids == []
    assert state.token_ids == [10, 11, 12, 13, 10, 11, 12, 99]
    drafter.close(state)


def target_next(context: list[int]) -> int:
    """A deterministic stand-in for a greedy target: a function of the last two tokens."""
    return (3 * context[-2] + context[-1] + 1) % 7


@pytest.mark.parametrize("drafter", [PromptLookupDrafter(1, 3), NgramStoreDrafter(1, 3), NgramStoreDrafter(1, 3, max_branching=2)],
                         ids=["prompt-lookup", "store-chain", "store-tree"])
def test_greedy_speculation_with_ngram_drafts_is_token_identical(drafter):
    prompt = [1, 2, 3, 4]
    num_new = 80  # the target's output repeats with period 24
    reference = list(prompt)
    while len(reference) < len(prompt) + num_new:
        reference.append(target_next(reference))

    sequence = [*prompt, target_next(prompt)]  # the prefill's first token
    state = drafter.open(prompt)
    new_tokens = [sequence[-1]]
    num_accepted = 0
    while len(sequence) < len(prompt) + num_new:
        proposal = drafter.propose(state, new_tokens, 4, GREEDY, torch.Generator())
        proposal.validate(vocab_size=7)
        assert proposal.q is None
        parents = proposal.tree_parents()
        # the target's argmax at the root and after each node, given that node's path
        paths = [[]]
        for node, parent in enumerate(parents):
            paths.append(paths[parent + 1] + [proposal.token_ids[node]])
        target_ids = [target_next(sequence + path) for path in paths]
        if proposal.is_tree:
            outcome = verify_tree_greedy(proposal.token_ids, parents, target_ids)
        else:
            outcome = verify_greedy(proposal.token_ids, target_ids)
        num_accepted += outcome.num_accepted
        new_tokens = outcome.token_ids
        sequence += new_tokens
    drafter.close(state)
    assert sequence[:len(reference)] == reference
    assert num_accepted >= num_new // 3  # once the period has been seen, drafts hit


# ---- DraftProposal -----------------------------------------------------------------------------


def test_dummy_proposals_are_valid():
    for kwargs in ({}, {"with_q": True}, {"tree": True}, {"with_q": True, "tree": True}):
        proposal = DraftProposal.make_dummy(4, vocab_size=3, **kwargs)
        proposal.validate(vocab_size=3)
        assert proposal.num_tokens == 4 and len(proposal.tree_parents()) == 4


@pytest.mark.parametrize(
    "proposal, message",
    [
        (DraftProposal([0, 5]), "lie in"),
        (DraftProposal([0, 1], q=torch.full((3, 4), 0.25)), "q must be"),
        (DraftProposal([0, 1], q=torch.tensor([[1.0, 0, 0, 0], [1.0, 0, 0, 0]])), "q > 0"),
        (DraftProposal([0, 1], parents=[-1, 1]), "parents"),
    ],
)
def test_malformed_proposals_raise_value_error(proposal, message):
    with pytest.raises(ValueError, match=message):
        proposal.validate(vocab_size=4)
