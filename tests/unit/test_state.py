"""The sans-IO speculation state: k capping, finish rules, stats and drafter bookkeeping, by hand."""

from __future__ import annotations

import pytest

from specmesh.decoding.adaptive import FixedK, Outlook
from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.state import FinishReason, SpeculationState


def _state(max_new: int = 5, k: int = 4, **kwargs) -> SpeculationState:
    params = SamplingParams(temperature=0, max_new_tokens=max_new, stop=kwargs.pop("stop", ()),
                            stop_token_ids=kwargs.pop("stop_token_ids", ()), ignore_eos=kwargs.pop("ignore_eos", False))
    defaults = dict(num_prompt_tokens=3, max_context=64, eos_token_ids=[2], k_policy=FixedK(k))
    defaults.update(kwargs)
    return SpeculationState(params, **defaults)


def test_the_module_worked_example():
    state = _state()
    assert state.start(7).token_ids == [7]
    assert state.next_k() == 3  # min(4, 5 - 1 - 1, 64 - 4)
    assert state.take_draft_input() == [7]
    event = state.record(3, 1, [8, 9])
    assert event.token_ids == [8, 9] and event.finish_reason is None
    assert state.next_k() == 1  # min(4, 5 - 3 - 1)
    assert state.take_draft_input() == [8, 9]
    event = state.record(1, 1, [2, 5])
    assert event.token_ids == [2] and event.finish_reason is FinishReason.EOS
    assert state.generated == [7, 8, 9, 2]
    assert event.stats.num_target_forwards == 3 and event.stats.num_draft_tokens == 4
    assert event.stats.num_accepted_tokens == 2 and event.stats.num_generated_tokens == 4


def test_max_new_tokens_cuts_a_round_and_no_round_follows_a_finish():
    state = _state(max_new=3, k=8)
    state.start(7)
    assert state.next_k() == 1
    event = state.record(1, 1, [8, 9])
    assert event.token_ids == [8, 9] and event.finish_reason is FinishReason.LENGTH
    with pytest.raises(RuntimeError, match="finished"):
        state.next_k()
    with pytest.raises(RuntimeError, match="finished"):
        state.record(0, 0, [4])


def test_the_first_token_can_finish_and_ignore_eos_keeps_going():
    assert _state().start(2).finish_reason is FinishReason.EOS
    assert _state(ignore_eos=True).start(2).finish_reason is None
    assert _state(stop_token_ids=[7]).start(7).finish_reason is FinishReason.EOS


def test_the_context_window_caps_k_and_finishes():
    state = _state(max_new=100, k=8, max_context=8)  # prompt of 3
    state.start(7)  # 4 tokens: 4 drafts still fit after the pending token
    assert state.next_k() == 4
    event = state.record(4, 3, [1, 1, 1, 1])  # 8 tokens: full
    assert event.finish_reason is FinishReason.CONTEXT


def test_no_drafter_means_k_zero_and_a_requested_k_is_capped():
    plain = _state(has_drafter=False)
    plain.start(7)
    assert plain.next_k() == 0
    state = _state(max_new=4)
    state.start(7)
    assert state.next_k(requested=10) == 2
    assert state.next_k(requested=1) == 1


def test_stop_strings_need_a_decoder_and_cut_after_the_completing_token():
    with pytest.raises(ValueError, match="tokenizer"):
        _state(stop=["x"])
    letters = {7: "a", 8: "b", 9: "c", 10: "d"}
    state = _state(max_new=10, stop=["bc"], decode=lambda ids: "".join(letters[t] for t in ids))
    first = state.start(7)
    event = state.record(2, 2, [8, 9, 10])
    assert event.token_ids == [8, 9] and event.finish_reason is FinishReason.STOP
    assert state.generated == [7, 8, 9]
    assert first.text + event.text == "a"  # the stop string itself is never shown


def test_tokens_past_a_finish_still_reach_the_drafter_bookkeeping():
    state = _state(max_new=2, k=4)
    state.start(7)
    state.record(1, 1, [8, 9])  # LENGTH after 8; 9 was emitted by the target all the same
    assert state.generated == [7, 8]
    assert state.take_draft_input() == [7, 8, 9]


class _Recording(FixedK):
    """A fixed k that keeps what the state told it each round."""

    def __init__(self, ks: list[int]):
        super().__init__(0)
        self.ks, self.told = ks, []

    def next_k(self) -> int:
        return self.ks[len(self.told)]

    def update(self, num_drafted, num_accepted, draft_ms, verify_ms, cost=None, catch_up=0, outlook=None):
        self.told.append((num_drafted, catch_up, outlook))


def test_the_policy_hears_each_rounds_catch_up_and_the_next_rounds_outlook():
    """Catch-up: what a draft round's ask brought beyond the verdict on a draft the round before (the
    prompt and the first token on the first ask; the plain rounds' tokens after a stretch the drafter
    sat out). The outlook: what the next round's ask would bring were it to draft, and the tokens left."""
    policy = _Recording([2, 0, 0, 0, 3, 1])
    state = SpeculationState(SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True),
                             num_prompt_tokens=10, max_context=64, k_policy=policy)
    state.start(100)  # generated: 1
    for drafted, accepted, tokens in ((2, 1, [101, 102]), (0, 0, [103]), (0, 0, [104]), (0, 0, [105]),
                                      (3, 3, [106, 107, 108, 109]), (1, 0, [110])):
        step = state.draft_step(state.next_k())
        if step.asks:
            step.take(DraftProposal(token_ids=list(range(drafted))))
        state.record(drafted, accepted, tokens)
    assert policy.told == [
        (2, 10 + 1, Outlook(0, 17)),  # the first ask: the prompt and the first token
        (0, 0, Outlook(1, 16)),  # asked for the verdict (k = 0): the next ask brings this round's token
        (0, 0, Outlook(2, 15)),  # not asked: tokens pile up
        (0, 0, Outlook(3, 14)),
        (3, 3, Outlook(0, 10)),  # caught up on 3 plain tokens; the next round hears its verdict only
        (1, 0, Outlook(0, 9)),
    ]


def test_the_draft_step_hands_the_policy_the_drafters_figure_after_its_forwards():
    """Every driver's draft step (`DraftStep.take`) refreshes an adaptive policy's prior draft cost with
    the drafter's own figure after the proposal's forwards, and the state forwards prior costs to a
    policy that takes them: a driver cannot leave a stale prior in place (the Verify service's fused
    rounds did)."""
    from specmesh.decoding.adaptive import AdaptiveK

    state = SpeculationState(SamplingParams(temperature=0, max_new_tokens=40), num_prompt_tokens=3, max_context=100,
                             eos_token_ids=[], has_drafter=True)
    state.prior_costs(draft_ms_per_token=16.3, decode_ms=20.0)  # timed on a busy machine: the gate is shut
    policy = state.k_policy
    assert isinstance(policy, AdaptiveK) and policy.draft_ms_per_token == 16.3 and not policy.could_pay()
    state.start(7)
    step = state.draft_step(2, fixed_k=True)
    step.take(DraftProposal([1, 2]), drafter_ms_per_token=10.0)
    assert policy.draft_ms_per_token == 10.0 and policy.could_pay()
    fixed = SpeculationState(SamplingParams(temperature=0, max_new_tokens=40), num_prompt_tokens=3, max_context=100,
                             eos_token_ids=[], has_drafter=True, k_policy=FixedK(3))
    fixed.prior_costs(16.3, 20.0)  # a policy that prices nothing takes none
    fixed.start(7)
    assert fixed.draft_step(3).take(DraftProposal([1, 2, 3]), drafter_ms_per_token=10.0).token_ids == [1, 2, 3]
