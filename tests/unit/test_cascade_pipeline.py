"""The lossless cascade in-process: drafter -> stage(s) -> target equals target-only decoding.

Greedy: token-identical to the target alone, with an n-gram and a model base drafter, one and two
stages; the models are distinct tiny random models (the stage is the target's weights at a smaller
scale), so every level rejects part of what it is offered. Sampling: the joint of the first three
tokens over seeded trials matches the target's, by a chi-square test (as
tests/engine/test_sampling_exactness.py does for one drafter). The bookkeeping's worked examples
(`specmesh.cascade.plan`) are tests here too.
"""

from __future__ import annotations

import pytest
import torch
from sampling_helpers import target_joint
from scipy.stats import chisquare

from specmesh.cascade.pipeline import CascadeDrafter, cost_floor
from specmesh.cascade.plan import CascadeBook, StageSpec, split_for_base, stage_seed
from specmesh.cascade.stage_model import StageModel, StageOutput
from specmesh.decoding.adaptive import FixedK
from specmesh.decoding.proposal import Drafter, DraftProposal
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.speculative import generate
from specmesh.decoding.state import draft_seed
from specmesh.decoding.verifier import TargetVerifier
from specmesh.drafters.model import ModelDrafter
from specmesh.drafters.ngram import PromptLookupDrafter
from specmesh.models.load import load_engine

PROMPT = [5, 17, 33, 5, 17, 33, 5, 17]
GREEDY = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    """target, a middle stage, a smaller stage, a draft model: one random init at falling scales."""
    def load(std):
        return load_engine(tiny_model_dir("llama", seed=1, init_std=std), dtype="float64")
    return {"target": load(0.2), "stage": load(0.15), "stage_low": load(0.12), "draft": load(0.1)}


# --- bookkeeping (specmesh.cascade.plan), worked examples ---

@pytest.mark.parametrize("last_draft, accepted, pieces", [
    ([7, 8, 9], [7, 8, 4], [[7, 8, 4]]),  # 2 drafts accepted + the target's token: one call
    ([7, 8, 9], [7, 8, 9, 4], [[7, 8, 9, 4]]),  # all accepted + bonus
    ([7, 8, 9], [7, 5, 6, 4], [[7, 5], [6, 4]]),  # a stage replaced 8 by 5 and added 6
    ([7, 8, 9], [5, 4], [[5], [4]]),  # the first token already departs
    ([7], [7, 5, 4], [[7, 5], [4]]),  # the whole draft matched, then two more tokens
    ([], [3, 4, 5], [[3, 4, 5]]),  # nothing outstanding
])
def test_split_for_base(last_draft, accepted, pieces):
    assert split_for_base(last_draft, accepted) == pieces


def test_book_worked_example():
    book = CascadeBook([StageSpec()], [64], num_confirmed=10, keep_q=False)
    assert book.start_round([100], 4) == [([100], 4)]
    draft = book.base_proposed(DraftProposal([1, 2, 3, 4]))
    call = book.stage_call(0, draft)
    assert call is not None and (call.accepted, call.draft.token_ids, call.num_extend_tokens) == ([100], [1, 2, 3, 4], 1)
    proposal = book.stage_done(0, call, StageOutput(2, [1, 2, 9], None, []))
    assert proposal.token_ids == [1, 2, 9] and proposal.q is None
    # the target accepted [1] and emitted 7: the base learns it in two calls (its 2 was replaced)
    assert book.start_round([1, 7], 4) == [([1, 7], 4)]
    book.base_proposed(DraftProposal([7, 7, 7, 7]))
    assert book.start_round([7, 5, 6], 4) == [([7, 5], 0), ([6], 4)]
    stats = book.stats[0]
    assert (stats.num_rounds, stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_proposed_tokens) == (1, 4, 2, 3)


def test_book_caps_by_k_extension_and_context():
    # two stages: m = 2 with at most 3 draft tokens, then m = 1; stage 1's context has 3 tokens of room
    book = CascadeBook([StageSpec(2, 3), StageSpec(1)], [64, 14], num_confirmed=10, keep_q=False)
    # caps: the target's k = 5; stage 1 drafts min(5, 14 - 11 - 1) = 2; stage 0 min(2, 3, 64 - 11 - 2) = 2
    assert book.start_round([100], 5) == [([100], 2)]
    draft = book.base_proposed(DraftProposal([1, 2, 3, 4]))
    assert draft.token_ids == [1, 2]
    call = book.stage_call(0, draft)
    assert call is not None and call.num_extend_tokens == 2
    out = book.stage_done(0, call, StageOutput(2, [1, 2, 8, 9], None, []))
    assert out.token_ids == [1, 2]  # cut to stage 1's cap
    # stage 1 has no room for even one token once 3 more are confirmed: retired, proposals pass it by
    book.start_round([1, 2, 8], 5)
    assert book.stats[1].retired and book.stage_call(1, DraftProposal([1])) is None


def test_a_filling_stage_is_asked_for_the_level_aboves_cap():
    # stage 0 fills, under stage 1 (m = 1), under the target's k = 5; stage 0 has 3 tokens of room
    book = CascadeBook([StageSpec(fill=True), StageSpec()], [14, 64], num_confirmed=10, keep_q=False)
    assert book.start_round([100], 5) == [([100], 2)]  # the base drafts min(5, 14 - 11 - 1)
    call = book.stage_call(0, book.base_proposed(DraftProposal([1, 2])))
    assert call is not None and (call.num_extend_tokens, call.fill_to) == (1, 3)  # up to its room, not 5
    top = book.stage_call(1, book.stage_done(0, call, StageOutput(0, [4, 5, 6], None, [])))
    assert top is not None and (top.draft.token_ids, top.fill_to) == ([4, 5, 6], 0)


def test_a_stage_that_agreed_with_a_whole_draft_sits_out_while_the_target_does():
    """`CascadeBook.pass_agreed`: stage 0 accepts the whole of a lower draft that fills its cap, so the next
    drafts go up past it as they are; when the target cuts one, the stage runs again and is told every token
    it missed in that one call."""
    book = CascadeBook([StageSpec(fill=True)], [64], num_confirmed=10, keep_q=False)
    book.start_round([100], 4)
    call = book.stage_call(0, book.base_proposed(DraftProposal([1, 2, 3, 4])))
    assert call is not None
    book.stage_done(0, call, StageOutput(4, [1, 2, 3, 4], None, []))  # all 4 of 4 accepted
    book.start_round([1, 2, 3, 4, 9], 4)  # the target took them all
    assert book.stage_call(0, book.base_proposed(DraftProposal([5, 6, 7, 8]))) is None  # passed up as it is
    book.start_round([5, 6, 7, 8, 10], 4)  # the target took the passed draft whole: still passing
    assert book.stage_call(0, book.base_proposed(DraftProposal([11, 12, 13]))) is not None  # short of the cap: filled
    book.start_round([11, 12, 13, 14], 4)  # (that call's output is not recorded: the stage stays passing)
    assert book.stage_call(0, book.base_proposed(DraftProposal([15, 16, 17, 18]))) is None
    book.start_round([15, 20], 4)  # the target cut the passed draft after one token
    call = book.stage_call(0, book.base_proposed(DraftProposal([21, 22, 23, 24])))
    assert call is not None and call.accepted == [11, 12, 13, 14, 15, 20]  # what it missed since its last call
    assert book.stats[0].num_passed == 2


@pytest.mark.parametrize("keep_q, pass_agreed, accepted", [(True, True, 4), (False, False, 4), (False, True, 3)])
def test_a_stage_runs_every_round_unless_it_agreed_and_its_q_travels_nowhere(keep_q, pass_agreed, accepted):
    """Standard sampling (q goes up with each proposal: a passed draft would carry the base's), a cascade
    that passes nothing (an adaptive one), or a stage that cut the lower draft: no round is sat out."""
    book = CascadeBook([StageSpec()], [64], num_confirmed=10, keep_q=keep_q, pass_agreed=pass_agreed)
    q = torch.full((4, 8), 1 / 8) if keep_q else None
    book.start_round([100], 4)
    call = book.stage_call(0, book.base_proposed(DraftProposal([1, 2, 3, 4], q)))
    assert call is not None
    book.stage_done(0, call, StageOutput(accepted, [1, 2, 3, 4][:accepted] + [9][:4 - accepted], q, []))
    book.start_round([1, 2, 3, 4, 9][:accepted + 1], 4)
    assert book.stage_call(0, book.base_proposed(DraftProposal([5, 6, 7, 8], q))) is not None


class Knowing:
    """A base drafter that proposes the target's own greedy tokens (`own`), wrong at the positions in `wrong`."""

    name = "knowing"
    device = torch.device("cpu")

    def __init__(self, own: list[int], wrong: set[int]):
        self.own, self.wrong = own, wrong

    def open(self, prompt_ids):
        return [0]  # tokens emitted so far

    def check_call(self, state, accepted_since_last, max_tokens):
        pass

    def propose(self, state, accepted_since_last, max_tokens, params, generator):
        state[0] += len(accepted_since_last)
        start = state[0]
        return DraftProposal([t + (i in self.wrong) for i, t in enumerate(self.own[start:start + max_tokens], start)])

    def close(self, state):
        pass


@pytest.mark.parametrize("wrong", [set(), {9, 22}])
def test_a_lossless_cascade_that_passes_a_stage_by_is_exact(engines, wrong):
    """Greedy through a base that knows the target's tokens (two of them wrong, or none) -> a stage with the
    target's weights -> the target: the stage agrees with the base's whole drafts, so it sits out rounds,
    runs again where the target cuts a passed draft, and the tokens are the target's alone."""
    target = engines["target"]
    own = generate(TargetVerifier(target), None, PROMPT, GREEDY).token_ids
    drafter = CascadeDrafter(Knowing(own, wrong), [StageModel(target)], [StageSpec(fill=True)])
    result = generate(TargetVerifier(target), drafter, PROMPT, GREEDY, k_policy=FixedK(4))
    assert result.token_ids == own
    stats = drafter.last_state.stage_stats[0]
    assert stats.num_passed > 0 and stats.num_rounds == 1 + len(wrong)  # it ran at first, and once after each cut


def test_a_filling_stage_drafts_what_the_lower_draft_did_not_give(engines):
    """StageModel.verify_and_extend(fill_to=f): at least m own tokens, and up to f in all; the tokens are
    the stage model's own greedy continuation."""
    stage = StageModel(engines["stage"])
    own = generate(TargetVerifier(engines["stage"]), None, PROMPT, GREEDY).token_ids
    session = stage.open(PROMPT, GREEDY, torch.Generator().manual_seed(0))
    out = stage.verify_and_extend(session, [], [own[0], own[1] + 1], None, 1, fill_to=6)  # the 2nd is wrong
    assert (out.num_accepted, out.proposal) == (1, own[:6])
    out = stage.verify_and_extend(session, out.proposal, own[6:10], None, 1, fill_to=3)  # all 4 accepted: 4 + 1
    assert (out.num_accepted, out.proposal) == (4, own[6:11])
    assert stage.ms_per_token == engines["stage"].stats.step_ms is not None


def test_a_stage_extending_ahead_answers_as_one_that_does_not(engines):
    """StageModel.extend_ahead: while the level above verifies, the stage runs plain rounds past its proposal;
    a call whose confirmed tokens follow them is answered from them without a forward (or with forwards for
    what they do not reach), any other call as without them, and every answer (tokens, accepted count,
    features) is the one a stage that never extends ahead, nor prefilled its prompt at open, gives."""
    own = generate(TargetVerifier(engines["stage"]), None, PROMPT, GREEDY).token_ids
    plain, ahead = StageModel(engines["stage"]), StageModel(engines["stage"])
    sessions = [model.open(PROMPT, GREEDY, torch.Generator().manual_seed(0)) for model in (plain, ahead)]
    ahead.prefill(sessions[1])  # as a Stage service extending ahead does at open
    assert sessions[1].sequence.num_cached == len(PROMPT) - 1
    calls = [  # (accepted, draft, m, fill_to, rounds ahead before the call, answered from them)
        ([], [own[0], own[1] + 1], 1, 4, 0, False),
        (own[:5], own[5:7] + [own[7] + 1], 1, 4, 6, True),  # proposal own[:4] + the guess own[4]: a hit
        (own[5:10], own[10:12] + [own[12] + 1], 1, 4, 2, False),  # a hit, own[10] ahead: the rest of D needs a forward
        (own[10:14] + [own[14] + 1], [], 2, 0, 6, False),  # the level above replaced own[14]: a miss
        ([own[16] + 1], own[17:19], 1, 3, 2, False),  # after the miss the stage's own tokens are not `own`
    ]
    for accepted, draft, m, fill, depth, served in calls:
        while ahead.wants_ahead(sessions[1], depth):
            ahead.extend_ahead([sessions[1]])
        forwards = sessions[1].sequence.num_forwards
        outs = [model.verify_and_extend(session, accepted, draft, None, m, fill)
                for model, session in zip((plain, ahead), sessions)]
        assert outs[1].proposal == outs[0].proposal and outs[1].num_accepted == outs[0].num_accepted
        assert [f.top1_prob for f in outs[1].features] == pytest.approx([f.top1_prob for f in outs[0].features])
        assert (sessions[1].sequence.num_forwards == forwards) == served
    assert ahead.ahead_served == 4 + 1 and ahead.ahead_dropped > 0 and plain.ahead_served == 0
    sampled = ahead.open(PROMPT, SamplingParams(temperature=0.8, seed=1), torch.Generator().manual_seed(0))
    ahead.verify_and_extend(sampled, [], [], None, 1)
    assert not ahead.wants_ahead(sampled, 4)  # a verify round draws from the generator as a plain round does not


def test_a_cascades_prior_is_its_base_and_filling_stages_tokens(engines):
    """The k policy's prior for a cascade (`cost_floor`): a first round that also prefills the prompt on
    every level must not stand for a draft token's cost."""
    stage = StageModel(engines["stage"])
    assert CascadeDrafter(PromptLookupDrafter(), [stage], [StageSpec(fill=True)]).ms_per_token == stage.ms_per_token
    assert CascadeDrafter(PromptLookupDrafter(), [stage], [StageSpec()]).ms_per_token is None  # n-gram: unknown
    base = ModelDrafter(engines["draft"])
    assert CascadeDrafter(base, [stage], [StageSpec()]).ms_per_token == base.ms_per_token
    assert cost_floor(2.0, [StageSpec(fill=True), StageSpec(fill=True)], [3.0, 4.0]) == 9.0
    assert CascadeDrafter(None, [stage], [StageSpec()]).ms_per_token is None  # a forward a round: rounds measure it


def test_spec_and_seed_validation():
    with pytest.raises(ValueError, match="at least 1"):
        StageSpec(num_extend_tokens=0)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        StageSpec(num_draft_tokens=-1)
    with pytest.raises(ValueError, match="specs"):
        CascadeDrafter(None, [object()], [StageSpec(), StageSpec()])  # type: ignore[list-item]
    assert len({stage_seed(3, 0), stage_seed(3, 1), draft_seed(3), 3}) == 4


# --- greedy: identical to the target alone ---

class RecordingCascade(CascadeDrafter):
    """Keeps its last session's state, for the stage statistics."""

    def open(self, prompt_ids):
        self.state = super().open(prompt_ids)
        return self.state


@pytest.mark.parametrize("base", ["ngram", "model", "none"])
@pytest.mark.parametrize("stages, specs", [
    (["stage"], [StageSpec()]),
    (["stage_low", "stage"], [StageSpec(), StageSpec(num_extend_tokens=2)]),
    (["stage"], [StageSpec(fill=True)]),
    (["stage_low", "stage"], [StageSpec(), StageSpec(fill=True)]),
])
def test_greedy_cascade_equals_target(engines, base, stages, specs):
    target = TargetVerifier(engines["target"])
    plain = generate(target, None, PROMPT, GREEDY).token_ids
    drafters: dict[str, Drafter | None] = {"ngram": PromptLookupDrafter(), "model": ModelDrafter(engines["draft"]), "none": None}
    base_drafter = drafters[base]
    drafter = RecordingCascade(base_drafter, [StageModel(engines[name]) for name in stages], specs)
    result = generate(target, drafter, PROMPT, GREEDY, k_policy=FixedK(4))
    assert result.token_ids == plain
    stats = drafter.state.stage_stats
    # every level rejected part of what it was offered: the test exercises the cuts
    top = stats[-1]
    assert 0 < top.num_accepted_tokens < top.num_draft_tokens or base == "none"
    assert 0 < result.stats.num_accepted_tokens < result.stats.num_draft_tokens


def test_greedy_cascade_with_a_small_stage_context(tiny_model_dir, engines):
    """A stage whose context fills up first is retired; the output stays the target's."""
    small = load_engine(tiny_model_dir("llama", seed=1, init_std=0.15), dtype="float64")
    small.max_context = len(PROMPT) + 12  # the stage's window ends 12 tokens into the 40 generated
    target = TargetVerifier(engines["target"])
    plain = generate(target, None, PROMPT, GREEDY).token_ids
    drafter = RecordingCascade(PromptLookupDrafter(), [StageModel(small)])
    assert generate(target, drafter, PROMPT, GREEDY, k_policy=FixedK(4)).token_ids == plain
    assert drafter.state.stage_stats[0].retired


# --- sampling: the target's distribution ---

SAMPLED = SamplingParams(temperature=1.0, top_k=3, max_new_tokens=3, ignore_eos=True)
NUM_TRIALS = 2_000


def chi_square_pvalue(counts: dict, expected: dict, num_trials: int) -> tuple[float, int]:
    """p-value of counts vs expected probabilities (cells expected < 5 times pooled), and the number
    of well-populated cells."""
    cells = sorted(expected, key=lambda cell: expected[cell], reverse=True)
    wanted = [expected[c] * num_trials for c in cells]
    big = [i for i, w in enumerate(wanted) if w >= 5]
    small = [i for i, w in enumerate(wanted) if w < 5]
    obs = [counts[cells[i]] for i in big] + ([sum(counts[cells[i]] for i in small)] if small else [])
    exp = [wanted[i] for i in big] + ([sum(wanted[i] for i in small)] if small else [])
    exp = [e * sum(obs) / sum(exp) for e in exp]
    return float(chisquare(obs, exp).pvalue), len(big)


@pytest.mark.parametrize("base, stages, fill", [
    ("ngram", ["stage_low", "stage"], False),  # one-hot q at the first stage, q passed stage to stage
    ("model", ["stage"], False),  # a sampled base q
    ("ngram", ["stage"], True),  # the stage draws its own tokens past the lower draft's, to the target's k
])
def test_sampled_cascade_follows_the_target(engines, base, stages, fill):
    target = TargetVerifier(engines["target"])
    base_drafter = PromptLookupDrafter() if base == "ngram" else ModelDrafter(engines["draft"])
    drafter = CascadeDrafter(base_drafter, [StageModel(engines[name]) for name in stages],
                             [StageSpec(fill=fill) for _ in stages])
    expected = target_joint(engines["target"], PROMPT, SAMPLED)
    counts = dict.fromkeys(expected, 0)
    num_draft = num_accepted = 0
    for seed in range(NUM_TRIALS):
        params = SamplingParams(temperature=1.0, top_k=3, max_new_tokens=3, ignore_eos=True, seed=seed)
        result = generate(target, drafter, PROMPT, params, k_policy=FixedK(2))
        sample = tuple(result.token_ids)
        assert sample in counts, f"{sample} has probability 0 under the target"
        counts[sample] += 1
        num_draft += result.stats.num_draft_tokens
        num_accepted += result.stats.num_accepted_tokens
    assert 0 < num_accepted < num_draft  # the target both accepted and rejected stage tokens
    pvalue, num_cells = chi_square_pvalue(counts, expected, NUM_TRIALS)
    assert pvalue > 1e-3, (pvalue, counts, expected)
    assert num_cells >= 10  # the test has power: many well-populated cells


def test_the_rounds_a_stage_sat_out_reach_the_callers_stats():
    """The Coordinator reports each stage's `num_passed` (CascadeStageStats), and the client library says it."""
    from types import SimpleNamespace

    from client.coordinator_client import GenerationStats
    from coordinator.cascade import NamedCascade, cascade_stats_pb
    from specmesh.cascade.plan import StageStats
    from specmesh.proto.v1 import common_pb2

    cascade = NamedCascade(["127.0.0.1:7"], None, [object()])
    cascade.last_state = SimpleNamespace(stage_stats=[StageStats(num_rounds=2, num_draft_tokens=8, num_accepted_tokens=8,
                                                                 num_passed=3)])
    (stage,) = cascade_stats_pb(cascade)
    assert (stage.stage, stage.num_rounds, stage.num_passed) == ("127.0.0.1:7", 2, 3)
    stats = GenerationStats.from_pb(common_pb2.SpeculationStats(cascade_stages=[stage]))
    assert stats.cascade == ["127.0.0.1:7: accepted 8/8 in 2 rounds, sat out 3"]
