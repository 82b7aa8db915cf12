"""The skeleton grammar: the byte DFA, exact token masks (multi-character and partial-UTF-8 tokens),
and the property that random logits under the mask always give a parseable skeleton in budget."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specmesh.decoding.sampling import SamplingParams, processed_probs
from specmesh.models.resolve import DEFAULT_MODEL_DIRNAME, specmesh_home
from specmesh.skeleton.automaton import DEAD_STATE, START_STATE, SkeletonFormat, build_skeleton_automaton
from specmesh.skeleton.grammar import SkeletonGrammar
from specmesh.skeleton.parse import parse_skeleton
from specmesh.skeleton.types import Direct, Skeleton

VALID = "[PLAN]\n1.<40><None>[-]Why sleep matters\n2.<60><Search>[1]How to sleep better\n3.<25><None>[1,2]Café tips\n[END]"


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir("llama"))


_GRAMMARS: dict = {}


def grammar_for(tokenizer, fmt: SkeletonFormat) -> SkeletonGrammar:
    key = (id(tokenizer), fmt)
    if key not in _GRAMMARS:
        _GRAMMARS[key] = SkeletonGrammar(tokenizer, max_points=fmt.max_points, max_title_bytes=fmt.max_title_bytes,
                                         max_est_digits=fmt.max_est_digits, max_direct_bytes=fmt.max_direct_bytes)
    return _GRAMMARS[key]


def longest_skeleton_bytes(fmt: SkeletonFormat) -> int:
    """By hand: every point with the longest id, estimate, tool, dependency list and title."""
    plan = len("[PLAN]\n") + len("[END]")
    for i in range(1, fmt.max_points + 1):
        deps = "[-]" if i == 1 else "[" + ",".join(str(j) for j in range(1, i)) + "]"
        plan += len(f"{i}.<") + fmt.max_est_digits + len("><Search>") + len(deps) + fmt.max_title_bytes + len("\n")
    return max(plan, len("[DIRECT]") + fmt.max_direct_bytes + len("[END]"))


# --- the byte automaton ---------------------------------------------------------------------------

automaton = functools.cache(build_skeleton_automaton)


@pytest.mark.parametrize("fmt", [SkeletonFormat(), SkeletonFormat(max_points=1, max_title_bytes=4, max_est_digits=1, max_direct_bytes=0),
                                 SkeletonFormat(max_points=12, max_title_bytes=10)])
def test_max_bytes_is_the_longest_skeleton(fmt):
    assert build_skeleton_automaton(fmt).max_bytes == longest_skeleton_bytes(fmt)


@pytest.mark.parametrize("text, accepted", [
    (VALID, True),
    ("[DIRECT]needs a calculation[END]", True),
    ("[DIRECT][END]", True),
    ("[PLAN]\n[END]", False),  # no points
    ("[PLAN]\n2.<40><None>[-]A\n[END]", False),  # ids start at 1
    ("[PLAN]\n1.<040><None>[-]A\n[END]", False),  # no leading zero
    ("[PLAN]\n1.<40><Web>[-]A\n[END]", False),  # unknown tool
    ("[PLAN]\n1.<40><None>[-]A\n2.<40><None>[2]B\n[END]", False),  # self dependency
    ("[PLAN]\n1.<40><None>[-]A\n2.<40><None>[3]B\n[END]", False),  # forward dependency
    ("[PLAN]\n1.<40><None>[-]A\n2.<4><None>[-]B\n3.<4><None>[2,1]C\n[END]", False),  # deps must increase
    ("[PLAN]\n1.<40><None>[-]A\n2.<4><None>[-]B\n3.<4><None>[1,1]C\n[END]", False),  # no repeats
    ("[PLAN]\n1.<40><None>[-] A\n[END]", False),  # leading space in the title
    ("[PLAN]\n1.<40><None>[-]\n[END]", False),  # empty title
    ("[PLAN]\n1.<40><None>[-]A\tB\n[END]", False),  # control character
    ("[PLAN]\n1.<40><None>[-]A\n[END]x", False),  # nothing after [END]
    ("[DIRECT]a [b][END]", False),  # no '[' inside a direct reason
])
def test_automaton_accepts_exactly_the_format(text, accepted):
    auto = automaton(SkeletonFormat())
    state = auto.walk(START_STATE, text.encode())
    assert auto.is_accepting(state) == accepted


@pytest.mark.parametrize("field, value", [("max_points", 0), ("max_points", 100), ("max_title_bytes", 0),
                                          ("max_est_digits", 0), ("max_direct_bytes", -1), ("max_points", 2.5)])
def test_format_bounds_are_validated(field, value):
    with pytest.raises(ValueError, match=field):
        build_skeleton_automaton(SkeletonFormat(**{field: value}))


def test_titles_and_reasons_are_valid_utf8_within_their_byte_bound():
    auto = build_skeleton_automaton(SkeletonFormat(max_title_bytes=5))
    line = b"[PLAN]\n1.<4><None>[-]"
    assert auto.walk(START_STATE, line + "abcé\n".encode()) != DEAD_STATE  # 5 bytes
    assert auto.walk(START_STATE, line + "abcdé".encode()) == DEAD_STATE  # 6 bytes
    assert auto.walk(START_STATE, line + b"abcd\xc3") == DEAD_STATE  # a lead byte with no room left for its end
    assert auto.walk(START_STATE, line + b"a\xc3\n") == DEAD_STATE  # newline inside a character
    assert auto.walk(START_STATE, line + b"a\xa9") == DEAD_STATE  # stray continuation byte
    assert auto.walk(START_STATE, line + b"\xed\xa0\x80") == DEAD_STATE  # a UTF-16 surrogate
    assert auto.walk(START_STATE, line + "🙂\n".encode()) != DEAD_STATE


def test_every_live_state_can_still_finish():
    """Random byte walks that take any allowed byte always end in [END] within max_bytes."""
    auto = build_skeleton_automaton(SkeletonFormat(max_points=3, max_title_bytes=8, max_direct_bytes=6))
    rng = random.Random(0)
    for _ in range(300):
        state, num_bytes = START_STATE, 0
        while not auto.is_accepting(state):
            allowed = [b for b in range(256) if auto.transitions[state, b] != DEAD_STATE]
            assert allowed, "a live state with no way on"
            state = auto.step(state, rng.choice(allowed))
            num_bytes += 1
        assert num_bytes <= auto.max_bytes


# --- token masks over a constructed vocabulary ------------------------------------------------------

EOS = 256
MULTI = [b"[PLAN]\n", b"\n2.", b"\n[END]", b"x\n2.", b"x\n3.", b"[1]", b"[-]", b"<None>", b"\xc3", b"\xa9",
         b"\xc3\xa9", b" ", b"Title\n", b"[END]", b"]Ti", b"<5><None>[-]"]


def constructed(max_points: int, max_title_bytes: int = 8) -> tuple[SkeletonGrammar, dict[bytes, int]]:
    vocab: list[bytes | None] = [bytes([b]) for b in range(256)] + [None] + MULTI
    ids = {token: i for i, token in enumerate(vocab) if token is not None and len(token) > 1 or token in MULTI}
    fmt = SkeletonFormat(max_points=max_points, max_title_bytes=max_title_bytes)
    return SkeletonGrammar.from_token_bytes(vocab, eos_token_ids=[EOS], fmt=fmt), ids


def allowed(grammar: SkeletonGrammar, state: int, token_ids: dict[bytes, int]) -> set[bytes]:
    mask = grammar.allowed_mask(state)
    return {token for token, i in token_ids.items() if mask[i]}


def test_multi_character_tokens_that_break_the_format_are_masked():
    one_point, ids = constructed(max_points=1)
    state = one_point.automaton.walk(START_STATE, b"[PLAN]\n1.<5><None>[-]Ti")
    # "\n" alone is fine (a first-character mask stops there), but "\n2." opens a point beyond
    # max_points, and "x\n3." skips an id: judged on all their bytes, both are refused.
    assert one_point.allowed_mask(state)[ord("\n")]
    assert allowed(one_point, state, ids) >= {b"\n[END]", b"Title\n", b"\xc3\xa9", b"]Ti", b" "}
    assert not allowed(one_point, state, ids) & {b"\n2.", b"x\n2.", b"x\n3."}

    two_points, ids = constructed(max_points=2)
    state = two_points.automaton.walk(START_STATE, b"[PLAN]\n1.<5><None>[-]Ti")
    assert {b"\n2.", b"x\n2."} <= allowed(two_points, state, ids)
    assert b"x\n3." not in allowed(two_points, state, ids)
    deps_1 = two_points.automaton.walk(START_STATE, b"[PLAN]\n1.<5><None>")
    deps_2 = two_points.automaton.walk(START_STATE, b"[PLAN]\n1.<5><None>[-]Ti\n2.<5><None>")
    assert b"[-]" in allowed(two_points, deps_1, ids) and b"[1]" not in allowed(two_points, deps_1, ids)
    assert {b"[-]", b"[1]"} <= allowed(two_points, deps_2, ids)
    assert allowed(two_points, two_points.automaton.walk(START_STATE, b"[PLAN]\n1."), ids) == {b"<5><None>[-]"}


def test_partial_utf8_tokens_are_judged_on_their_bytes():
    grammar, ids = constructed(max_points=1, max_title_bytes=4)
    title = grammar.automaton.walk(START_STATE, b"[PLAN]\n1.<5><None>[-]")
    assert grammar.allowed_mask(title)[ids[b"\xc3"]] and not grammar.allowed_mask(title)[ids[b"\xa9"]]
    half = grammar.advance(title, ids[b"\xc3"])
    assert allowed(grammar, half, ids) == {b"\xa9"}  # of the multi-byte tokens, only a continuation byte
    assert grammar.allowed_mask(half).nonzero().flatten().tolist() == [*range(0x80, 0xC0), ids[b"\xa9"]]
    two_left = grammar.automaton.walk(title, b"ab")
    assert grammar.allowed_mask(two_left)[ids[b"\xc3\xa9"]]
    assert not grammar.allowed_mask(grammar.automaton.walk(two_left, b"c"))[ids[b"\xc3\xa9"]]  # 1 byte left


def test_eos_only_after_end_and_dead_states():
    grammar, ids = constructed(max_points=1)
    state = grammar.walk(START_STATE, [ids[b"[PLAN]\n"], ord("1"), ord("."), ids[b"<5><None>[-]"], ids[b"Title\n"], ids[b"[END]"]])
    assert [grammar.is_complete(s) for s in state] == [False] * 6 + [True]
    assert grammar.allowed_mask(state[-1]).nonzero().flatten().tolist() == [EOS]
    assert grammar.advance(state[-1], EOS) == state[-1]
    assert grammar.advance(state[3], EOS) == DEAD_STATE
    assert grammar.walk(START_STATE, [ord("x"), ord("[")])[1:] == [DEAD_STATE, DEAD_STATE]
    assert not grammar.allowed_mask(DEAD_STATE).any()
    with pytest.raises(ValueError):
        grammar.advance(START_STATE, grammar.vocab_size)
    with pytest.raises(ValueError):
        grammar.allowed_mask(grammar.automaton.num_states)


def test_constrain_logits_masks_rows_and_leaves_dead_rows():
    grammar, ids = constructed(max_points=1)
    logits = torch.randn(3, grammar.vocab_size, generator=torch.Generator().manual_seed(0))
    states = [START_STATE, grammar.advance(START_STATE, ord("[")), DEAD_STATE]
    out = grammar.constrain_logits(logits, states)
    assert torch.equal(torch.isfinite(out[0]), grammar.allowed_mask(START_STATE))
    assert torch.isfinite(out[1]).sum() == 2 and torch.equal(out[2], logits[2])  # "[" -> "P" or "D"
    probs = processed_probs(out, SamplingParams(temperature=0.7, top_k=50))
    assert torch.allclose(probs.sum(-1), torch.ones(3)) and (probs[0][~grammar.allowed_mask(START_STATE)] == 0).all()
    with pytest.raises(ValueError):
        grammar.constrain_logits(logits, states[:2])


# --- real tokenizers --------------------------------------------------------------------------------


def test_canonical_tokenization_of_a_skeleton_is_allowed(tiny_tokenizer):
    grammar = grammar_for(tiny_tokenizer, SkeletonFormat())
    token_ids = tiny_tokenizer.encode(VALID, add_special_tokens=False) + [tiny_tokenizer.eos_token_id]
    states = grammar.walk(grammar.initial_state(), token_ids)
    assert all(grammar.allowed_mask(s)[t] for s, t in zip(states, token_ids))
    assert grammar.is_complete(states[-1]) and grammar.decode(token_ids) == VALID


def generate_constrained(grammar: SkeletonGrammar, seed: int, greedy: bool, scale: float, fresh_logits: bool) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(1, grammar.vocab_size, generator=generator)
    state, token_ids = grammar.initial_state(), []
    while not (token_ids and token_ids[-1] in grammar.eos_token_ids):
        assert len(token_ids) < grammar.max_tokens, "the grammar must end within max_tokens"
        if fresh_logits:
            logits = scale * torch.randn(1, grammar.vocab_size, generator=generator)
        row = grammar.constrain_logits(logits, [state])
        if greedy:
            token = int(row.argmax())
        else:
            token = int(torch.multinomial(torch.softmax(row, -1), 1, generator=generator))
        state = grammar.advance(state, token)
        assert state != DEAD_STATE
        token_ids.append(token)
    return token_ids


# a few formats (each distinct one builds a grammar), from the tightest bounds to roomy ones
formats = st.sampled_from([SkeletonFormat(1, 4, 1, 0), SkeletonFormat(2, 7, 2, 5), SkeletonFormat(4, 16, 3, 24),
                           SkeletonFormat(11, 5, 1, 3)])


@settings(max_examples=60, deadline=None)
@given(fmt=formats, seed=st.integers(0, 2**32 - 1), greedy=st.booleans(), scale=st.sampled_from([0.1, 1.0, 10.0]),
       fresh_logits=st.booleans())
def test_random_logits_under_the_grammar_always_parse(tiny_tokenizer, fmt, seed, greedy, scale, fresh_logits):
    grammar = grammar_for(tiny_tokenizer, fmt)
    token_ids = generate_constrained(grammar, seed, greedy, scale, fresh_logits)
    text = grammar.decode(token_ids)  # strict UTF-8
    assert tiny_tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) == text
    parsed = parse_skeleton(text, max_points=fmt.max_points)
    if isinstance(parsed, Direct):
        assert parsed.by_model, parsed.reason
        assert len(parsed.text.encode()) <= fmt.max_direct_bytes
    else:
        assert isinstance(parsed, Skeleton) and parse_skeleton(parsed.render()) == parsed
        raw_titles = [line.split("]", 1)[1] for line in text.split("\n")[1:-1]]
        assert [p.title for p in parsed.points] == [t.strip() for t in raw_titles]
        for point in parsed.points:
            assert len(point.title.encode()) <= fmt.max_title_bytes and all(d < point.id for d in point.deps)
            assert point.est_tokens < 10 ** fmt.max_est_digits


@pytest.fixture(scope="module")
def default_tokenizer():
    from transformers import AutoTokenizer

    folder = specmesh_home() / "models" / DEFAULT_MODEL_DIRNAME
    if not (folder / "tokenizer.json").is_file():
        pytest.skip(f"the default model's tokenizer is not in {folder}")
    return AutoTokenizer.from_pretrained(folder)


def test_default_model_tokenizer(default_tokenizer):
    """SmolLM2's 49k vocabulary: its own tokenization of a skeleton is allowed, and constrained random
    runs end in a parseable skeleton."""
    grammar = grammar_for(default_tokenizer, SkeletonFormat())
    token_ids = default_tokenizer.encode(VALID, add_special_tokens=False) + [default_tokenizer.eos_token_id]
    states = grammar.walk(grammar.initial_state(), token_ids)
    assert all(grammar.allowed_mask(s)[t] for s, t in zip(states, token_ids)) and grammar.is_complete(states[-1])
    small = grammar_for(default_tokenizer, SkeletonFormat(max_points=2, max_title_bytes=12, max_direct_bytes=8))
    for seed in range(3):
        token_ids = generate_constrained(small, seed, greedy=seed % 2 == 0, scale=1.0, fresh_logits=True)
        text = default_tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert text == small.decode(token_ids)
        parsed = parse_skeleton(text)
        assert isinstance(parsed, Skeleton) or parsed.by_model
