"""Encoder-decoder models (T5, BART) on EncDecEngine: the decoder forward against transformers,
speculative greedy decoding equal to target-only decoding (with rejections, so KV rollback runs),
and the clear errors of a pair that cannot work. Tiny random models built in a temp dir."""

from __future__ import annotations

import json

import pytest
import torch

from specmesh.decoding.adaptive import FixedK
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.speculative import generate
from specmesh.decoding.verifier import TargetVerifier
from specmesh.drafters.model import ModelDrafter
from specmesh.models.encdec import EncDecEngine, is_encoder_decoder
from specmesh.models.engine import ContextLengthError, SeqInput
from specmesh.models.load import load_engine
from specmesh.models.pairing import IncompatibleDraftError, check_draft_compatible
from specmesh.models.tiny_encdec import make_tiny_encdec, perturbed_copy

ENCODER_INPUTS = [[5, 17, 33, 80, 120, 7, 2], [200, 9, 9, 41, 300, 12, 60, 61, 2], [44, 2]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)
INIT_STD = {"t5": 0.1, "bart": 0.15}  # peaked logits (no near-ties) that do not collapse to one token


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """{family: (target folder, draft folder)}: the draft is the target with noise on its weights."""
    out = {}
    for family in ("t5", "bart"):
        target = make_tiny_encdec(family, tmp_path_factory.mktemp(family), init_std=INIT_STD[family])
        out[family] = (target, perturbed_copy(target, tmp_path_factory.mktemp(f"{family}-draft"), noise_std=0.3))
    return out


def _full_logits(engine: EncDecEngine, encoder_ids, decoder_ids) -> torch.Tensor:
    """transformers' own forward over the whole decoder sequence, no cache: [len(decoder_ids), vocab]."""
    with torch.inference_mode():
        return engine.model(input_ids=torch.tensor([encoder_ids]), decoder_input_ids=torch.tensor([decoder_ids])).logits[0].float()


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_decoder_forward_with_rollback_matches_transformers(pairs, family):
    engine = load_engine(pairs[family][0])
    assert isinstance(engine, EncDecEngine) and engine.backend == "hf" and is_encoder_decoder(engine)
    encoder_ids, decoder_ids = ENCODER_INPUTS[0], [*engine.decoder_prompt_ids, 40, 41, 42, 43, 44]
    full = _full_logits(engine, encoder_ids, decoder_ids)
    seq = engine.new_sequence(encoder_input_ids=encoder_ids)
    first = engine.forward([SeqInput(seq, decoder_ids[:3], [0, 1, 2])])[0]  # a prompt chunk
    rest = engine.forward([SeqInput(seq, decoder_ids[3:], list(range(len(decoder_ids) - 3)))])[0]  # k + 1 rows at once
    torch.testing.assert_close(torch.cat([first, rest]), full, atol=1e-5, rtol=1e-5)
    engine.truncate(seq, 4)  # reject the last drafts: re-feeding them gives the same rows
    again = engine.forward([SeqInput(seq, decoder_ids[4:], list(range(len(decoder_ids) - 4)))])[0]
    torch.testing.assert_close(again, full[4:], atol=1e-5, rtol=1e-5)
    child = engine.fork(seq)  # shares the encoder output
    engine.truncate(child, 2)
    torch.testing.assert_close(engine.forward([SeqInput(child, decoder_ids[2:3], [0])])[0], full[2:3], atol=1e-5, rtol=1e-5)
    usage = engine.kv_usage()
    assert usage.total_blocks - usage.free_blocks == 2 * len(encoder_ids) + len(decoder_ids) + 3  # decoder + encoder tokens
    engine.free(seq), engine.free(child)
    assert engine.kv_usage().free_blocks == engine.kv_usage().total_blocks


def test_decoder_prompt_is_the_start_token_then_a_forced_bos(pairs):
    assert load_engine(pairs["t5"][0]).decoder_prompt_ids == (0,)
    assert load_engine(pairs["bart"][0]).decoder_prompt_ids == (2, 1)  # decoder_start, then generation_config.forced_bos


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_greedy_speculative_equals_target_only_decoding(pairs, family):
    target_dir, draft_dir = pairs[family]
    target, draft = load_engine(target_dir), load_engine(draft_dir)
    check_draft_compatible(target, draft, target_dir, draft_dir)
    num_drafted = num_accepted = num_forwards = num_tokens = 0
    plain_outputs = []
    for encoder_ids in ENCODER_INPUTS:
        prompt = target.decoder_prompt_ids
        plain = generate(TargetVerifier(target.bind(encoder_ids)), None, prompt, GREEDY)
        plain_outputs.append(plain.token_ids)
        for k in (1, 3, 5):
            spec = generate(TargetVerifier(target.bind(encoder_ids)), ModelDrafter(draft.bind(encoder_ids)), prompt, GREEDY,
                            k_policy=FixedK(k))
            assert spec.token_ids == plain.token_ids, (encoder_ids, k)
            num_drafted += spec.stats.num_draft_tokens
            num_accepted += spec.stats.num_accepted_tokens
            num_forwards += spec.stats.num_target_forwards
            num_tokens += len(spec.token_ids)
    assert 0 < num_accepted < num_drafted  # accepted and rejected drafts: the KV rollback ran on both sides
    assert num_forwards < num_tokens  # accepted drafts rode in one decoder forward with the target's token
    assert len({tuple(o) for o in plain_outputs}) == len(ENCODER_INPUTS)  # the encoder input steers the output
    assert target.kv_usage().free_blocks == target.kv_usage().total_blocks  # every session freed
    assert draft.kv_usage().free_blocks == draft.kv_usage().total_blocks


def test_bf16_self_draft_keeps_the_fp32_output(pairs):
    """The CLI's default drafter: the target's own weights in bf16."""
    target_dir = pairs["t5"][0]
    target, draft = load_engine(target_dir), load_engine(target_dir, dtype="bfloat16")
    encoder_ids = ENCODER_INPUTS[1]
    plain = generate(TargetVerifier(target.bind(encoder_ids)), None, target.decoder_prompt_ids, GREEDY)
    spec = generate(TargetVerifier(target.bind(encoder_ids)), ModelDrafter(draft.bind(encoder_ids)),
                    target.decoder_prompt_ids, GREEDY, k_policy=FixedK(4))
    assert spec.token_ids == plain.token_ids
    assert spec.stats.num_accepted_tokens > 0


def test_decoder_only_draft_for_an_encoder_decoder_target_is_refused(pairs, tiny_model_dir):
    target = load_engine(pairs["t5"][0])
    decoder_only = load_engine(tiny_model_dir("gpt2"))
    with pytest.raises(IncompatibleDraftError, match="target is an encoder-decoder model but the draft is a decoder-only model"):
        check_draft_compatible(target, decoder_only)
    with pytest.raises(IncompatibleDraftError, match="target is a decoder-only model but the draft is an encoder-decoder"):
        check_draft_compatible(decoder_only, target)


def test_mismatched_vocabularies_are_refused(pairs, tmp_path):
    target_dir = pairs["bart"][0]
    other_dir = make_tiny_encdec("bart", tmp_path / "small-vocab", vocab_size=320)
    with pytest.raises(IncompatibleDraftError, match="vocabulary has 320 tokens, the target's 384"):
        check_draft_compatible(load_engine(target_dir), load_engine(other_dir), target_dir, other_dir)
    # same width, other tokens: the tokenizers are compared when the folders are known
    same_width = make_tiny_encdec("bart", tmp_path / "other-tokens")
    tokenizer_file = same_width / "tokenizer.json"
    data = json.loads(tokenizer_file.read_text())
    vocab = data["model"]["vocab"]  # swap the ids of two tokens
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    tokenizer_file.write_text(json.dumps(data))
    target = load_engine(target_dir)
    with pytest.raises(IncompatibleDraftError, match="maps tokens to other ids"):
        check_draft_compatible(target, load_engine(same_width), target_dir, same_width)


def test_bad_encoder_inputs_and_backends_fail_clearly(pairs):
    engine = load_engine(pairs["t5"][0])
    with pytest.raises(ValueError, match="at least one token"):
        engine.new_sequence(encoder_input_ids=[])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.bind([5, engine.vocab_size])
    with pytest.raises(ContextLengthError):
        engine.bind([5] * (engine.max_encoder_tokens + 1))
    seq = engine.new_sequence()  # no encoder input: only a fork target
    with pytest.raises(ValueError, match="has no encoder input"):
        engine.forward([SeqInput(seq, [0], [0])])
    with pytest.raises(ValueError, match="encoder-decoder model: it runs on the hf backend"):
        load_engine(pairs["t5"][0], backend="native")
    with pytest.raises(ValueError, match="encoder-decoder model: it runs on the hf backend"):
        load_engine(pairs["t5"][0], quantize="int8")
