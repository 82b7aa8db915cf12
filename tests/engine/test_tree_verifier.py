"""Token-tree drafts verified on the real engine through `TargetVerifier` (which keeps the accepted
path with the engine's `keep_tree_path`).

(a) Greedy: trees built from the target's own top-2 tokens plus random ones, over several rounds and
    two sessions per forward, emit exactly the tokens of target-only greedy decoding.
(b) Sampling: trees whose children are drawn independently from q (the same model at temperature
    0.5; the target samples at 1.0, both top-3) emit tokens distributed as the target alone. Each
    trial opens a session (the prefill samples t1), then verifies trees until t2 and t3 exist; the
    joint of (t1, t2, t3) over 4,000 seeded trials is compared, by a chi-square test, with
    p(t1) p(t2 | t1) p(t3 | t1 t2) computed from the model. The same test must reject a drafter that
    under-reports q, which makes the verifier accept every draft token: so it has power. This is the
    standard rule (the coupled rule reads no q; its trees: tests/engine/test_coupled_decoding.py).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.sampling import AcceptanceRule, SamplingParams, make_generator, processed_probs
from specmesh.decoding.types import FinalTokenKind
from specmesh.decoding.verifier import TargetVerifier
from specmesh.models.engine import NO_PARENT, SeqInput
from specmesh.models.load import load_engine

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
GREEDY_PROMPTS = [[5, 17, 33, 5, 17], [100, 7, 250, 31, 9, 60]]
GREEDY_DEPTH = 3  # tree levels; the target's path through them is fully in the tree unless cut
NUM_GREEDY_ROUNDS = 8

PROMPT = [11, 40, 7, 93]
TARGET = SamplingParams(temperature=1.0, top_k=3, ignore_eos=True, acceptance_rule=AcceptanceRule.STANDARD)  # q is read
DRAFT = SamplingParams(temperature=0.5, top_k=3)  # same support as TARGET, sharper: far from p
BRANCHING = (2, 2)  # children per node at depth 0, 1: 2 + 4 draft nodes
NUM_TRIALS = 4_000
CHUNK = 1_000  # sessions per batched forward
UNDER_REPORT = 1e-30  # q / 1e30: u * q(x) < p(x) always holds, every draft token is accepted


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama", init_std=0.2)  # peaked logits: no greedy near-ties


def next_logits(engine, prefix) -> torch.Tensor:
    """The target's float32 logits [1, vocab] after `prefix`, from a scratch sequence."""
    seq = engine.new_sequence()
    try:
        return engine.forward([SeqInput(seq, list(prefix), [len(prefix) - 1])])[0]
    finally:
        engine.free(seq)


# ---- (a) greedy ----------------------------------------------------------------------------------


def greedy_tree(engine, prefix, cut_depth, gen) -> DraftProposal:
    """Every node gets the target's top-2 next tokens (in random order) and one random token; the
    top-2 are expanded GREEDY_DEPTH levels deep. At depth `cut_depth` the top-1 is left out, so the
    target's path stops there and its argmax is recovered."""
    token_ids: list[int] = []
    parents: list[int] = []
    frontier = [(NO_PARENT, list(prefix))]
    for depth in range(GREEDY_DEPTH):
        next_frontier = []
        for parent, path in frontier:
            best, second = next_logits(engine, path)[0].topk(2).indices.tolist()
            other = best
            while other in (best, second):
                other = int(torch.randint(engine.vocab_size, (1,), generator=gen))
            children = [second, other]
            if depth != cut_depth:
                children.insert(int(torch.randint(3, (1,), generator=gen)), best)
            for token in children:
                token_ids.append(token)
                parents.append(parent)
                if token != other:
                    next_frontier.append((len(token_ids) - 1, path + [token]))
        frontier = next_frontier
    return DraftProposal(token_ids, None, parents)


def test_greedy_trees_equal_target_only_decoding(model_dir):
    engine = load_engine(model_dir, dtype="float64")
    verifier = TargetVerifier(engine)
    gen = torch.Generator().manual_seed(0)
    sessions = [verifier.open(prompt, GREEDY, make_generator(0)[0]) for prompt in GREEDY_PROMPTS]
    emitted = [[s.pending_token_id] for s in sessions]
    try:
        for round_index in range(NUM_GREEDY_ROUNDS):
            cuts = [(round_index + b) % (GREEDY_DEPTH + 1) for b in range(len(sessions))]  # GREEDY_DEPTH: no cut
            trees = [greedy_tree(engine, prompt + out, cut, gen)
                     for prompt, out, cut in zip(GREEDY_PROMPTS, emitted, cuts)]
            for out, outcome, cut, tree in zip(emitted, verifier.verify_many(sessions, trees), cuts, trees):
                assert outcome.num_accepted == cut
                kind = FinalTokenKind.BONUS if cut == GREEDY_DEPTH else FinalTokenKind.RECOVERED
                assert outcome.final_kind is kind
                assert [tree.token_ids[node] for node in outcome.accepted_nodes] == outcome.accepted_token_ids
                out.extend(outcome.token_ids)
    finally:
        for session in sessions:
            verifier.close(session)

    for prompt, spec in zip(GREEDY_PROMPTS, emitted):
        session = verifier.open(prompt, GREEDY, make_generator(0)[0])
        plain = [session.pending_token_id]
        while len(plain) < len(spec):
            plain.extend(verifier.verify(session, DraftProposal([])).token_ids)
        verifier.close(session)
        assert spec == plain
        assert len(spec) > 1 + NUM_GREEDY_ROUNDS * 2  # the trees saved forwards


# ---- (b) sampling ----------------------------------------------------------------------------------


class PrefixProbs:
    """The target's processed p and the drafter's q after a prefix, each prefix computed once."""

    def __init__(self, engine):
        self.engine = engine
        self._rows: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def _get(self, prefix) -> tuple[torch.Tensor, torch.Tensor]:
        key = tuple(prefix)
        if key not in self._rows:
            logits = next_logits(self.engine, key)
            self._rows[key] = processed_probs(logits, TARGET)[0], processed_probs(logits, DRAFT)[0]
        return self._rows[key]

    def p(self, prefix) -> torch.Tensor:
        return self._get(prefix)[0]  # [vocab] float32

    def q(self, prefix) -> torch.Tensor:
        return self._get(prefix)[1]  # [vocab] float32


def sampled_tree(probs: PrefixProbs, prefix, gen, under_report: bool) -> DraftProposal:
    """BRANCHING children per node, each drawn independently from q given its path (the condition
    for exact recursive rejection sampling); q[i] is the row node i was drawn from."""
    token_ids: list[int] = []
    parents: list[int] = []
    q_rows: list[torch.Tensor] = []
    frontier = [(NO_PARENT, tuple(prefix))]
    for num_children in BRANCHING:
        next_frontier = []
        for parent, path in frontier:
            q = probs.q(path)
            for _ in range(num_children):
                token = int(torch.multinomial(q, 1, generator=gen))
                token_ids.append(token)
                parents.append(parent)
                q_rows.append(q)
                next_frontier.append((len(token_ids) - 1, (*path, token)))
        frontier = next_frontier
    q = torch.stack(q_rows)  # [num_nodes, vocab]
    return DraftProposal(token_ids, q * UNDER_REPORT if under_report else q, parents)


def tree_samples(engine, probs: PrefixProbs, seeds, gen, under_report: bool) -> list[tuple[int, int, int]]:
    """(t1, t2, t3) per seed: t1 from the prefill, then tree rounds until three tokens exist."""
    verifier = TargetVerifier(engine)
    generators = [make_generator(seed)[0] for seed in seeds]
    sessions = verifier.open_many([PROMPT] * len(seeds), [TARGET] * len(seeds), generators)
    emitted = [[s.pending_token_id] for s in sessions]
    try:
        while todo := [i for i, out in enumerate(emitted) if len(out) < 3]:
            trees = [sampled_tree(probs, PROMPT + emitted[i], gen, under_report) for i in todo]
            for i, outcome in zip(todo, verifier.verify_many([sessions[i] for i in todo], trees)):
                emitted[i].extend(outcome.token_ids)
    finally:
        for session in sessions:
            verifier.close(session)
    return [tuple(out[:3]) for out in emitted]


def target_joint(probs: PrefixProbs) -> dict[tuple[int, int, int], float]:
    """{(t1, t2, t3): p(t1) p(t2 | t1) p(t3 | t1 t2)} under the target alone."""
    joint = {}
    p1 = probs.p(PROMPT).double()
    for t1 in torch.nonzero(p1).flatten().tolist():
        p2 = probs.p(PROMPT + [t1]).double()
        for t2 in torch.nonzero(p2).flatten().tolist():
            p3 = probs.p(PROMPT + [t1, t2]).double()
            for t3 in torch.nonzero(p3).flatten().tolist():
                joint[(t1, t2, t3)] = float(p1[t1] * p2[t2] * p3[t3])
    return joint


def chi_square_pvalue(samples, expected: dict) -> float:
    """p-value of the samples against the expected cell probabilities; 0 if a sample is impossible."""
    counts = Counter(samples)
    if any(cell not in expected for cell in counts):
        return 0.0
    cells = sorted(expected)
    observed = [counts[c] for c in cells]
    wanted = [expected[c] * len(samples) for c in cells]
    wanted = [w * sum(observed) / sum(wanted) for w in wanted]  # equal totals despite float rounding
    return float(chisquare(observed, wanted).pvalue)


@pytest.fixture(scope="module")
def sampling_setup(model_dir):
    engine = load_engine(model_dir, dtype="float64", max_kv_tokens=32 * CHUNK)
    probs = PrefixProbs(engine)
    expected = target_joint(probs)
    assert len(expected) == 27 and min(expected.values()) * NUM_TRIALS >= 5  # every cell well populated
    return engine, probs, expected


def run_trials(sampling_setup, under_report: bool) -> float:
    engine, probs, expected = sampling_setup
    gen = torch.Generator().manual_seed(1)  # the drafter's randomness
    samples = []
    for start in range(0, NUM_TRIALS, CHUNK):
        samples += tree_samples(engine, probs, range(start, start + CHUNK), gen, under_report)
    return chi_square_pvalue(samples, expected)


def test_sampled_trees_follow_the_target_distribution(sampling_setup):
    assert run_trials(sampling_setup, under_report=False) > 1e-3


def test_chi_square_detects_a_verifier_that_accepts_every_draft(sampling_setup):
    assert run_trials(sampling_setup, under_report=True) < 1e-3
