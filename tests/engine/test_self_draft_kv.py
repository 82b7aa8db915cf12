"""A self-draft takes the context's KV from its target (`NativeEngine.import_kv`, `ModelDrafter`'s
`kv_source`): the rows it copies are the target's, a twin engine's drafts are unchanged by it, and the
output stays the target's while the drafter feeds fewer tokens."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import PairedDrafters

from specmesh import Generator
from specmesh.decoding.adaptive import AdaptiveK, FixedK
from specmesh.decoding.sampling import AcceptanceRule, SamplingParams
from specmesh.decoding.speculative import generate
from specmesh.decoding.verifier import TargetVerifier
from specmesh.drafters.model import ModelDrafter, self_draft
from specmesh.models.engine import SeqInput
from specmesh.models.load import load_engine

PROMPT = [100, 7, 250, 31, 9, 60, 12, 200, 4, 4, 99, 1, 3]
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=30)
SEEDED = SamplingParams(temperature=0.8, top_k=0, seed=5, ignore_eos=True, max_new_tokens=30,
                        acceptance_rule=AcceptanceRule.STANDARD)
COUPLED = SamplingParams(temperature=0.8, top_k=0, seed=5, ignore_eos=True, max_new_tokens=30,
                         acceptance_rule=AcceptanceRule.COUPLED)  # seeded, and token for token plain sampling's


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama", init_std=0.2)


def _rows(engine, seq_id, end):
    slots = engine.cache.slot_tensor(seq_id, end)
    return engine.cache.k[:, slots], engine.cache.v[:, slots]


def test_import_copies_the_sources_rows_in_this_caches_dtype(model_dir):
    target, draft = load_engine(model_dir, dtype="float32"), load_engine(model_dir, dtype="bfloat16")
    source = target.new_sequence()
    target.forward([SeqInput(source, PROMPT, logits_at=[len(PROMPT) - 1])])
    seq = draft.new_sequence()
    draft.import_kv(seq, target, source, 5)
    draft.import_kv(seq, target, source, len(PROMPT))  # from where it stands
    assert draft.seq_len(seq) == len(PROMPT)
    for mine, theirs in zip(_rows(draft, seq, len(PROMPT)), _rows(target, source, len(PROMPT)), strict=True):
        assert mine.dtype == torch.bfloat16
        assert torch.equal(mine, theirs.to(torch.bfloat16))
    with pytest.raises(ValueError, match="cannot import positions"):
        draft.import_kv(seq, target, source, len(PROMPT) + 1)  # the source has no such position


def test_import_refuses_a_cache_of_other_shapes(tiny_model_dir, model_dir):
    other = load_engine(tiny_model_dir("llama", init_std=0.2, num_layers=3), dtype="float32")
    target = load_engine(model_dir, dtype="float32")
    source = other.new_sequence()
    other.forward([SeqInput(source, PROMPT, logits_at=[0])])
    with pytest.raises(ValueError, match="does not fit"):
        target.import_kv(target.new_sequence(), other, source, 4)
    with pytest.raises(ValueError, match="native engines"):
        ModelDrafter(target, kv_source=object())


class Twins(PairedDrafters):
    """Drafts with the KV taken from the target and, beside it, by feeding everything: each proposal
    checked against the other's. The target is a twin of the draft engine (same weights and dtype), so
    the rows it writes are those the drafter's own forwards would."""

    def __init__(self, engine, target):
        super().__init__(ModelDrafter(engine, kv_source=target), ModelDrafter(engine))
        self.kv_source = target

    def share_kv(self, state, target_seq_id):
        self.mine.share_kv(state["mine"], target_seq_id)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("k", [1, 3])
def test_a_twins_kv_changes_no_draft(model_dir, params, k):
    draft = load_engine(model_dir, dtype="float32")
    if not draft.steps_equal_chains:
        pytest.skip("the CPU fast path is off: a fed chain's rows may differ from the target's prefill's")
    target = load_engine(model_dir, dtype="float32")
    twins = Twins(draft, target)
    result = generate(TargetVerifier(target), twins, PROMPT, params, k_policy=FixedK(k))
    assert twins.num_proposals > 3 and len(result.token_ids) == params.max_new_tokens


class PlainStretches(FixedK):
    """k rounds after every `plain` rounds at 0: the drafter is told the plain rounds' tokens all at once."""

    def __init__(self, k: int, plain: int):
        super().__init__(k)
        self.plain, self.rounds = plain, 0

    def next_k(self) -> int:
        return self.k if self.rounds % (self.plain + 1) == self.plain else 0

    def update(self, *args, **kwargs) -> None:
        self.rounds += 1

    def plain_rounds_ahead(self) -> int | None:
        return 0 if self.next_k() else 1


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_plain_stretchs_tokens_come_from_the_target_too(model_dir, params):
    draft = load_engine(model_dir, dtype="float32")
    if not draft.steps_equal_chains:
        pytest.skip("the CPU fast path is off: a fed chain's rows may differ from the target's prefill's")
    target = load_engine(model_dir, dtype="float32")
    twins = Twins(draft, target)
    imports = []  # (from, to) of each copy
    copy = draft.import_kv

    def counted(seq_id, source, source_seq_id, end):
        imports.append((draft.seq_len(seq_id), end))
        copy(seq_id, source, source_seq_id, end)

    draft.import_kv = counted
    result = generate(TargetVerifier(target), twins, PROMPT, params, k_policy=PlainStretches(3, plain=3))
    assert twins.num_proposals >= 5 and len(result.token_ids) == params.max_new_tokens
    assert imports[0] == (0, len(PROMPT))  # the prompt
    assert (len(PROMPT), len(PROMPT) + 3) in imports  # the 3 plain rounds' tokens after it, copied, not fed
    assert sum(end - start >= 3 for start, end in imports[1:]) >= 3  # and every plain stretch since


@pytest.mark.parametrize("params", [GREEDY, COUPLED], ids=["greedy", "coupled"])
def test_a_bf16_self_draft_taking_the_targets_kv_emits_the_targets_tokens(model_dir, params):
    target, draft = load_engine(model_dir, dtype="float32"), load_engine(model_dir, dtype="bfloat16")
    verifier = TargetVerifier(target)
    plain = generate(verifier, None, PROMPT, params).token_ids
    fed = []
    for drafter in (ModelDrafter(draft), self_draft(draft, target)):
        before = draft.stats.num_tokens_forwarded
        assert generate(verifier, drafter, PROMPT, params, k_policy=FixedK(3)).token_ids == plain
        fed.append(draft.stats.num_tokens_forwarded - before)
    assert fed[1] <= fed[0] - (len(PROMPT) - 1)  # the prompt came from the target, and more since


def test_a_seeded_run_with_the_targets_kv_reproduces(model_dir):
    target, draft = load_engine(model_dir, dtype="float32"), load_engine(model_dir, dtype="bfloat16")
    runs = [generate(TargetVerifier(target), self_draft(draft, target), PROMPT, SEEDED, k_policy=FixedK(3)).token_ids
            for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == SEEDED.max_new_tokens


@pytest.mark.parametrize("name", ["int8", "q4_1"])
def test_every_library_self_draft_takes_the_targets_kv_and_keeps_its_output(model_dir, name):
    from client.cli_common import LOCAL_DRAFTERS
    from specmesh.generator import DRAFTERS

    assert LOCAL_DRAFTERS == DRAFTERS  # the CLI lists what the library builds
    gen = Generator(str(model_dir), drafter=name)
    assert isinstance(gen.drafter, ModelDrafter) and gen.drafter.kv_source is gen.engine
    ids = gen.prompt_ids("Numbers: 0 1 2 3", chat=False)
    assert generate(gen.verifier, gen.drafter, ids, GREEDY, k_policy=FixedK(3)).token_ids == \
        generate(gen.verifier, None, ids, GREEDY).token_ids


def test_the_library_self_draft_shares_and_prices_no_catch_up(model_dir):
    gen = Generator(str(model_dir), drafter="bf16")
    assert isinstance(gen.drafter, ModelDrafter) and gen.drafter.kv_source is gen.engine
    priors = []

    class Watched(AdaptiveK):
        def prior_costs(self, draft_ms, decode_ms, catch_up_ms=None, forward_cost=None):
            priors.append(catch_up_ms)
            super().prior_costs(draft_ms, decode_ms, catch_up_ms, forward_cost)

    ids = gen.prompt_ids("Numbers: 0 1 2 3", chat=False)
    result = generate(gen.verifier, gen.drafter, ids, GREEDY, k_policy=Watched())
    assert priors == [0.0]  # a copy, not a forward: a probe after a plain stretch costs no catch-up
    assert result.token_ids == generate(gen.verifier, None, ids, GREEDY).token_ids


def test_the_verify_services_fused_self_draft_shares_its_targets_kv(model_dir, tiny_model_dir):
    from target_service.options import VerifyOptions
    from target_service.server import build_fused_drafter

    target = load_engine(model_dir, dtype="float32")
    own = build_fused_drafter(VerifyOptions(model=str(model_dir), fused_drafter="model"), target, str(model_dir))
    assert isinstance(own, ModelDrafter) and own.kv_source is target
    other_dir = str(tiny_model_dir("llama", init_std=0.2, seed=1))  # another model of the same shapes: its own KV
    other = build_fused_drafter(VerifyOptions(model=str(model_dir), fused_drafter="model", fused_drafter_model=other_dir),
                                target, str(model_dir))
    assert isinstance(other, ModelDrafter) and other.kv_source is None
