"""The real default model (SmolLM2-135M-Instruct): native greedy decode == transformers `generate`."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specmesh.models.chat import chat_prompt_ids
from specmesh.models.engine import SeqInput
from specmesh.models.load import load_engine

NUM_NEW_TOKENS = 64
MAX_TIE_GAP = 1e-3
PROMPTS = (
    "What is the capital of France? Answer with a paragraph about its history.",
    "Write a short poem of at least eight lines about the sea.",
    "List three benefits of exercise.",
    "Explain what a hash table is in two sentences.",
    "Translate 'good morning' into Spanish and German.",
)


@pytest.fixture(scope="module")
def default_model():
    from specmesh.models.resolve import resolve_model_spec

    path = resolve_model_spec("default")
    tokenizer = AutoTokenizer.from_pretrained(path)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, tokenizer, reference


def greedy_with_logits(engine, prompt_ids: list[int], num_new: int):
    seq = engine.new_sequence()
    logits = engine.forward([SeqInput(seq, prompt_ids, [len(prompt_ids) - 1])])[0][0]
    tokens, all_logits = [], []
    for _ in range(num_new):
        all_logits.append(logits)
        tokens.append(int(logits.argmax()))
        if tokens[-1] in engine.eos_token_ids:  # generate stops at EOS too
            break
        logits = engine.forward([SeqInput(seq, [tokens[-1]], [0])])[0][0]
    engine.free(seq)
    return tokens, all_logits


def top2_gap(logits: torch.Tensor) -> float:
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


@pytest.mark.slow
def test_greedy_decode_matches_transformers_generate(default_model):
    path, tokenizer, reference = default_model
    engine = load_engine(path, dtype="float32")
    num_identical, report, lengths = 0, [], []
    for prompt in PROMPTS:
        prompt_ids = chat_prompt_ids(tokenizer, prompt)
        with torch.inference_mode():
            generated = reference.generate(
                torch.tensor([prompt_ids]),
                max_new_tokens=NUM_NEW_TOKENS,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )[0, len(prompt_ids) :].tolist()
        ours, our_logits = greedy_with_logits(engine, prompt_ids, NUM_NEW_TOKENS)
        if ours == generated:
            num_identical += 1
            lengths.append(len(ours))
            continue
        first = next(i for i, (a, b) in enumerate(zip(ours, generated)) if a != b)
        with torch.inference_mode():
            target_logits = reference(torch.tensor([prompt_ids + generated[:first]])).logits[0, -1]
        gap = top2_gap(target_logits)
        report.append(f"{prompt!r}: first difference at token {first}, target top-2 gap {gap:.2e}")
        assert gap < MAX_TIE_GAP, report[-1]
        # our engine's choice must be one of the two near-tied tokens
        assert ours[first] in target_logits.topk(2).indices.tolist(), report[-1]
    print(f"{num_identical}/{len(PROMPTS)} identical (lengths {lengths}); " + "; ".join(report))
    assert num_identical >= len(PROMPTS) - 1
    assert all(length == NUM_NEW_TOKENS for length in lengths), f"every answer runs to {NUM_NEW_TOKENS} tokens: {lengths}"
