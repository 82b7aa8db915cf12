"""`accept_batch` and `processed_probs_rows` give, bit for bit, what the per-session functions give.

The reference is the per-session acceptance the verifier ran before the batched path: argmax +
`verify_greedy` / `verify_tree_greedy`, or `processed_probs` + `verify_sampled` / `verify_tree_sampled`
(standard rule), or `processed_probs` + coupled samples at each row's position + `verify_coupled`
(coupled rule). Both sides get clones of the same seeded generators; outcomes and the generators'
final states must be identical (a coupled session reads none).
"""

from __future__ import annotations

import pytest
import torch

from specmesh.decoding.acceptance import accept_batch, cumulative_offsets, ragged_coordinates
from specmesh.decoding.coupled import row_positions, sample_at, verify_coupled
from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.rejection import verify_greedy, verify_sampled, verify_sampled_batch
from specmesh.decoding.sampling import AcceptanceRule, SamplingParams, processed_probs, processed_probs_rows
from specmesh.decoding.tree import verify_tree_greedy, verify_tree_sampled
from specmesh.decoding.types import NO_PARENT, PLACEHOLDER_TOKEN_ID

VOCAB_SIZE = 40
STANDARD, COUPLED = AcceptanceRule.STANDARD, AcceptanceRule.COUPLED
PARAMS_CHOICES = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0, acceptance_rule=STANDARD),
    SamplingParams(temperature=0.7, top_k=5, acceptance_rule=STANDARD),
    SamplingParams(temperature=1.3, top_p=0.8, acceptance_rule=STANDARD),
    SamplingParams(temperature=0.9, top_k=8, top_p=0.6, acceptance_rule=STANDARD),
    SamplingParams(temperature=2.0, top_k=VOCAB_SIZE, acceptance_rule=STANDARD),  # top-k as wide as the vocab: off
    SamplingParams(temperature=0.5, top_k=1, acceptance_rule=STANDARD),
    SamplingParams(temperature=1.0, seed=7, acceptance_rule=COUPLED),
    SamplingParams(temperature=0.8, top_k=6, top_p=0.9, seed=2**64 - 1),  # the default rule: coupled
]


def positions_of(num_sessions: int) -> list[int]:
    """Where each session's row 0 samples (distinct, so sessions of one seed get different noise)."""
    return [5 + 3 * b for b in range(num_sessions)]


def reference(logits, proposals, params, generators, positions=None):
    """The per-session acceptance of the verifier before `accept_batch`."""
    outcomes = []
    positions = positions or positions_of(len(logits))
    for rows, proposal, pa, generator, position in zip(logits, proposals, params, generators, positions):
        if pa.is_coupled:
            p = processed_probs(rows, pa)
            target_ids = sample_at(p, pa.seed, row_positions(position, proposal.parents, proposal.num_tokens)).tolist()
            outcomes.append(verify_coupled(proposal.token_ids, target_ids, proposal.parents))
            continue
        if pa.is_greedy:
            target_ids = rows.argmax(dim=-1).tolist()
            if proposal.is_tree:
                outcomes.append(verify_tree_greedy(proposal.token_ids, proposal.parents, target_ids))
            else:
                outcomes.append(verify_greedy(proposal.token_ids, target_ids))
            continue
        p = processed_probs(rows, pa)
        q = proposal.probs_q()
        if proposal.is_tree:
            outcomes.append(verify_tree_sampled(proposal.token_ids, proposal.parents, q, p, generator))
        else:
            outcomes.append(verify_sampled(proposal.token_ids, q, p, generator))
    return outcomes


def random_session(gen: torch.Generator):
    """Logits [1 + k, vocab], a chain or tree proposal whose tokens often match the target, params."""
    params = PARAMS_CHOICES[int(torch.randint(len(PARAMS_CHOICES), (1,), generator=gen))]
    k = int(torch.randint(0, 6, (1,), generator=gen))
    logits = torch.randn(1 + k, VOCAB_SIZE, generator=gen) * 3
    if bool(torch.rand(1, generator=gen) < 0.3):
        logits = logits.round()  # ties: exercises the tie rules of argmax, top-k and top-p
    is_tree = bool(torch.rand(1, generator=gen) < 0.4)
    parents = [NO_PARENT if i == 0 else int(torch.randint(-1, i, (1,), generator=gen)) for i in range(k)]
    if not is_tree:
        parents = [NO_PARENT, *range(k - 1)][:k]
    with_q = not params.is_greedy and bool(torch.rand(1, generator=gen) < 0.6)
    q_logits = logits[[parent + 1 for parent in parents]] + torch.randn(k, VOCAB_SIZE, generator=gen)  # [k, vocab]
    q = torch.softmax(q_logits, dim=-1) if with_q else None
    tokens = []
    for i, parent in enumerate(parents):
        judged_by = logits[parent + 1]  # the row that judges node i
        if q is not None:
            tokens.append(int(torch.multinomial(q[i], 1, generator=gen)))
        elif bool(torch.rand(1, generator=gen) < 0.7):
            tokens.append(int(judged_by.argmax()))
        else:
            tokens.append(int(torch.randint(VOCAB_SIZE, (1,), generator=gen)))
    proposal = DraftProposal(tokens, q, parents if is_tree else None)
    proposal.validate(VOCAB_SIZE)
    return logits, proposal, params


def clone(generator: torch.Generator) -> torch.Generator:
    copy = torch.Generator()
    copy.set_state(generator.get_state())
    return copy



def test_worked_example_of_the_ragged_layout():
    # three chains with k = [2, 0, 3]: 1 + k rows each
    assert cumulative_offsets([3, 1, 4]) == [0, 3, 4, 8]
    session, column = ragged_coordinates([3, 1, 4])
    assert session == [0, 0, 0, 1, 2, 2, 2, 2]
    assert column == [0, 1, 2, 0, 0, 1, 2, 3]
    flat = torch.arange(8.0)  # flat row r holds r
    padded = torch.full((3, 4), -1.0)
    padded[session, column] = flat
    assert padded.tolist() == [[0, 1, 2, -1], [3, -1, -1, -1], [4, 5, 6, 7]]


@pytest.mark.parametrize("seed", range(20))
def test_processed_probs_rows_is_bit_identical_row_by_row(seed):
    gen = torch.Generator().manual_seed(seed)
    num_rows = 12
    logits = torch.randn(num_rows, VOCAB_SIZE, generator=gen) * 4
    logits[: num_rows // 2] = logits[: num_rows // 2].round()  # ties
    logits[0, :3] = float("-inf")
    row_params = [PARAMS_CHOICES[int(i)] for i in torch.randint(len(PARAMS_CHOICES), (num_rows,), generator=gen)]
    row_params[1] = SamplingParams(temperature=0.3, top_k=VOCAB_SIZE + 7, top_p=0.999)
    probs = processed_probs_rows(
        logits,
        torch.tensor([pa.temperature for pa in row_params], dtype=torch.float64),
        torch.tensor([pa.top_k for pa in row_params]),
        torch.tensor([pa.top_p for pa in row_params], dtype=torch.float64),
    )
    assert probs.dtype == torch.float32
    for i, pa in enumerate(row_params):
        assert torch.equal(probs[i], processed_probs(logits[i:i + 1], pa)[0]), (i, pa)


def test_processed_probs_rows_checks_shapes():
    with pytest.raises(ValueError, match="top_k"):
        processed_probs_rows(torch.zeros(2, 5), torch.ones(2), torch.zeros(3, dtype=torch.long), torch.ones(2))


def assert_same(batched, single):
    assert len(batched) == len(single)
    for b, (got, want) in enumerate(zip(batched, single)):
        assert got.accepted_nodes == want.accepted_nodes, b
        assert got.accepted_token_ids == want.accepted_token_ids, b
        assert got.final_token_id == want.final_token_id, b
        assert got.final_kind is want.final_kind, b


@pytest.mark.parametrize("seed", range(40))
def test_mixed_batch_equals_per_session_path(seed):
    gen = torch.Generator().manual_seed(seed)
    batch_size = int(torch.randint(1, 12, (1,), generator=gen))
    sessions = [random_session(gen) for _ in range(batch_size)]
    logits, proposals, params = map(list, zip(*sessions))
    generators = [torch.Generator().manual_seed(seed * 100 + b) for b in range(batch_size)]
    reference_generators = [clone(g) for g in generators]
    want = reference(logits, proposals, params, reference_generators)
    assert_same(accept_batch(logits, proposals, params, generators, positions_of(batch_size)), want)
    for g, r in zip(generators, reference_generators):
        assert torch.equal(g.get_state(), r.get_state())  # the same draws from every request's generator


def test_many_outcomes_are_covered():
    """The random batches above reach every kind of outcome (guards the generator of cases)."""
    kinds = set()
    for seed in range(40):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(10):
            logits, proposal, params = random_session(gen)
            outcome = accept_batch([logits], [proposal], [params], [torch.Generator().manual_seed(seed)], [9])[0]
            kinds.add((params.rule if not params.is_greedy else None, proposal.is_tree, proposal.q is not None,
                       outcome.final_kind, 0 < outcome.num_accepted < proposal.num_tokens))
    for rule, tree in [(None, False), (None, True), (STANDARD, False), (STANDARD, True), (COUPLED, False), (COUPLED, True)]:
        for with_q in ([False] if rule is None else [False, True]):
            reached = {(kind, partial) for r, t, w, kind, partial in kinds if (r, t, w) == (rule, tree, with_q)}
            assert len(reached) >= 3, (rule, tree, with_q, reached)


def test_all_sessions_greedy_or_all_sampled_or_empty():
    gen = torch.Generator().manual_seed(3)
    logits = [torch.randn(1 + k, VOCAB_SIZE, generator=gen) for k in (0, 2, 4)]
    proposals = [DraftProposal([]), DraftProposal([1, 2]), DraftProposal([3, 4, 5, 6], parents=[-1, -1, 0, 2])]
    for pa in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=4, acceptance_rule=STANDARD),
               SamplingParams(temperature=0.8, top_k=4, seed=3)):
        generators = [torch.Generator().manual_seed(i) for i in range(3)]
        want = reference(logits, proposals, [pa] * 3, [clone(g) for g in generators])
        assert_same(accept_batch(logits, proposals, [pa] * 3, generators, positions_of(3)), want)
    assert accept_batch([], [], [], []) == []


def test_only_plain_decoding_rows():
    # k = 0 everywhere: every sampled session draws exactly one uniform, its final token from p_0
    gen = torch.Generator().manual_seed(5)
    logits = [torch.randn(1, VOCAB_SIZE, generator=gen) for _ in range(4)]
    params = [PARAMS_CHOICES[i] for i in (1, 2, 3, 0, 7, 8)]
    generators = [torch.Generator().manual_seed(i) for i in range(6)]
    logits += [torch.randn(1, VOCAB_SIZE, generator=gen) for _ in range(2)]
    want = reference(logits, [DraftProposal([])] * 6, params, [clone(g) for g in generators])
    assert_same(accept_batch(logits, [DraftProposal([])] * 6, params, generators, positions_of(6)), want)


def test_rejects_mismatched_inputs():
    logits = [torch.zeros(3, VOCAB_SIZE)]
    with pytest.raises(ValueError, match="one proposal"):
        accept_batch(logits, [], [SamplingParams()], [torch.Generator()])
    with pytest.raises(ValueError, match="1 \\+ k = 2"):
        accept_batch(logits, [DraftProposal([1])], [SamplingParams()], [torch.Generator()])


def test_ragged_verify_sampled_batch_equals_each_row_alone():
    gen = torch.Generator().manual_seed(11)
    num_drafts = [3, 0, 1, 2]
    batch_size, k_max = len(num_drafts), max(num_drafts)
    p = torch.softmax(torch.randn(batch_size, k_max + 1, VOCAB_SIZE, generator=gen), -1)
    q = torch.softmax(torch.randn(batch_size, k_max, VOCAB_SIZE, generator=gen), -1)
    draft = torch.full((batch_size, k_max), PLACEHOLDER_TOKEN_ID)
    for b, k in enumerate(num_drafts):
        draft[b, :k] = torch.multinomial(q[b, :k], 1, generator=gen).squeeze(-1)
    uniforms = torch.rand(batch_size, k_max + 1, generator=gen, dtype=torch.float64)
    for q_or_none in (q, None):
        batch = verify_sampled_batch(draft, q_or_none, p, uniforms, num_draft_tokens=torch.tensor(num_drafts))
        for b, k in enumerate(num_drafts):
            alone = verify_sampled_batch(draft[b:b + 1, :k], None if q_or_none is None else q[b:b + 1, :k],
                                         p[b:b + 1, :k + 1], uniforms[b:b + 1, :k + 1])
            assert int(batch.num_accepted[b]) == int(alone.num_accepted[0])
            assert int(batch.final_token_ids[b]) == int(alone.final_token_ids[0])
        assert (batch.num_accepted <= torch.tensor(num_drafts)).all()
