"""TextStream against full decodes: random token sequences, stop strings, split characters, cost."""

from __future__ import annotations

import random

import pytest

from specmesh.decoding.detokenize import TextStream
from specmesh.models.resolve import DEFAULT_MODEL_DIRNAME, specmesh_home

# Text whose characters take 1 to 4 bytes, so byte-level tokens split some of them.
SNIPPETS = ["naïve café", " 日本語", " 🙂", " Ωμέγα", " the capital of France", "\n", " ...", " déjà vu"]


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def default_tokenizer():
    from transformers import AutoTokenizer

    folder = specmesh_home() / "models" / DEFAULT_MODEL_DIRNAME
    if not (folder / "tokenizer.json").is_file():
        pytest.skip(f"the default model's tokenizer is not in {folder}")
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(params=["tiny", "default"])
def tokenizer(request):
    return request.getfixturevalue(f"{request.param}_tokenizer")


def decoder(tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def random_ids(rng: random.Random, tokenizer, num_pieces: int) -> list[int]:
    """Random vocabulary ids (special tokens included) mixed with encodings of multi-byte text."""
    ids: list[int] = []
    for _ in range(num_pieces):
        if rng.random() < 0.5:
            ids.append(rng.randrange(len(tokenizer)))
        else:
            ids.extend(tokenizer.encode(rng.choice(SNIPPETS), add_special_tokens=False))
    return ids


def random_chunks(rng: random.Random, ids: list[int]) -> list[list[int]]:
    chunks, start = [], 0
    while start < len(ids):
        size = rng.randint(1, 5)
        chunks.append(ids[start:start + size])
        start += size
    return chunks


def reference_stop(decode, ids: list[int], stops: list[str]) -> tuple[int | None, str]:
    """Brute force, the old rule: the shortest prefix whose full decode contains a stop string, and its
    text up to the earliest match; (None, full text) when no prefix has one."""
    for length in range(1, len(ids) + 1):
        text = decode(ids[:length])
        starts = [text.find(stop) for stop in stops if stop in text]
        if starts:
            return length, text[:min(starts)]
    return None, decode(ids)


def stream_all(rng: random.Random, stream: TextStream, ids: list[int]) -> tuple[int, list[str]]:
    """Add `ids` in random chunks, taking deltas at random moments; (tokens kept, every delta)."""
    num_kept, deltas = 0, []
    for chunk in random_chunks(rng, ids):
        keep = stream.add(chunk)
        if rng.random() < 0.7:
            deltas.append(stream.take_delta())
        if keep is not None:
            num_kept += keep
            break
        num_kept += len(chunk)
    deltas.append(stream.finish())
    return num_kept, deltas


@pytest.mark.parametrize("seed", range(8))
def test_deltas_concatenate_to_the_full_decode(tokenizer, seed):
    rng = random.Random(seed)
    decode = decoder(tokenizer)
    ids = random_ids(rng, tokenizer, 60)
    stream = TextStream(decode)
    num_kept, deltas = stream_all(rng, stream, ids)
    assert num_kept == len(ids)
    assert "".join(deltas) == stream.text == decode(ids)


@pytest.mark.parametrize("seed", range(4))
def test_prompt_context_gives_the_text_a_full_decode_would_add(tokenizer, seed):
    rng = random.Random(seed)
    decode = decoder(tokenizer)
    prompt_ids = tokenizer.encode("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)
    ids = random_ids(rng, tokenizer, 30)
    prompt_text, full_text = decode(prompt_ids), decode(prompt_ids + ids)
    assert full_text.startswith(prompt_text)
    _, deltas = stream_all(rng, TextStream(decode, prompt_ids=prompt_ids), ids)
    assert "".join(deltas) == full_text[len(prompt_text):]


@pytest.mark.parametrize("seed", range(12))
def test_stop_strings_match_the_old_rule(tokenizer, seed):
    rng = random.Random(seed)
    decode = decoder(tokenizer)
    ids = random_ids(rng, tokenizer, 40)
    full_text = decode(ids)
    stops = ["\x00never\x00"]  # absent: must change nothing
    while len(stops) < 3:  # substrings of the output's second half (multi-byte ones included)
        start = rng.randrange(len(full_text) // 2, len(full_text))
        stop = full_text[start:start + rng.randint(1, 4)]
        if "\ufffd" not in stop:
            stops.append(stop)
    expected_kept, expected_text = reference_stop(decode, ids, stops)
    stream = TextStream(decode, stop=stops)
    num_kept, deltas = stream_all(rng, stream, ids)
    assert num_kept == (len(ids) if expected_kept is None else expected_kept)
    assert "".join(deltas) == stream.text == expected_text
    if expected_kept is not None:
        with pytest.raises(ValueError):
            stream.add(ids[:1])


def test_split_characters_are_never_emitted_half(tiny_tokenizer):
    decode = decoder(tiny_tokenizer)
    text = "".join(SNIPPETS)
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in decode([token]) for token in ids)  # the test really splits characters
    stream = TextStream(decode)
    deltas = []
    for token in ids:
        assert stream.add([token]) is None
        deltas.append(stream.take_delta())
    deltas.append(stream.finish())
    assert not any("\ufffd" in delta for delta in deltas)
    assert "".join(deltas) == text


def test_decode_cost_is_linear_in_the_number_of_tokens(tiny_tokenizer):
    rng = random.Random(0)
    decode = decoder(tiny_tokenizer)
    calls: list[int] = []

    def counting_decode(ids):
        calls.append(len(ids))
        return decode(ids)

    ids = random_ids(rng, tiny_tokenizer, 1000)[:2000]
    assert len(ids) == 2000
    stream = TextStream(counting_decode, stop=["\x00never\x00"], prompt_ids=ids[:10])
    for token in ids:
        assert stream.add([token]) is None
        stream.take_delta()
    stream.finish()
    assert stream.text == decode(ids[:10] + ids)[len(decode(ids[:10])):]
    assert len(calls) <= 2 * len(ids) + 2
    assert sum(calls) <= 10 * len(ids)  # a window is a few tokens; decoding everything each time is ~n^2/2


# ---- worked examples with a toy byte-level vocabulary ------------------------------------------

PIECES = [b"a", b"b", b"c", b"d", b"\xc3", b"\xa9", b" "]  # 4 and 5 are the two bytes of "é"


def toy_decode(ids):
    return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


def test_text_that_may_start_a_stop_string_is_held_back_then_dropped():
    stream = TextStream(toy_decode, stop=["abc"])
    assert (stream.add([3, 0]), stream.take_delta()) == (None, "d")
    assert (stream.add([1]), stream.take_delta()) == (None, "")  # "ab" may start "abc"
    assert stream.add([2, 3]) == 1
    assert (stream.take_delta(), stream.finish(), stream.text) == ("", "", "d")


def test_the_earliest_starting_match_ends_the_text():
    stream = TextStream(toy_decode, stop=["cd", "bcd"])
    assert stream.add([0, 1, 2, 3, 0]) == 4  # both complete at "d"; "bcd" starts first
    assert stream.text == "a"


def test_a_stop_string_with_a_split_character():
    stream = TextStream(toy_decode, stop=["éa"])
    assert stream.add([0, 4]) is None
    assert stream.take_delta() == "a"  # half of "é" is not text yet
    assert stream.add([5]) is None
    assert stream.take_delta() == ""  # "é" may start the stop string
    assert stream.add([0, 0]) == 1
    assert stream.text == "a"


def test_finish_releases_held_text_and_unfinished_bytes():
    stream = TextStream(toy_decode, stop=["ab"])
    assert stream.add([0]) is None
    assert stream.take_delta() == ""
    assert stream.finish() == "a"
    with pytest.raises(ValueError):
        stream.add([1])
    stream = TextStream(toy_decode)
    stream.add([0, 4])
    assert stream.take_delta() == "a"
    assert stream.finish() == "\ufffd"  # generation ended inside a character: as a full decode shows it


def test_prompt_context_keeps_the_leading_space_of_the_first_token():
    from tokenizers import Tokenizer, decoders, models

    # sentencepiece style: "▁" marks a space, and a decode drops the space its first token starts with
    words = Tokenizer(models.WordLevel({"▁Hello": 0, "▁world": 1, "!": 2, "<unk>": 3}, unk_token="<unk>"))
    words.decoder = decoders.Metaspace()
    assert words.decode([1, 2]) == "world!"
    stream = TextStream(words.decode, prompt_ids=[0])
    assert stream.add([1, 2]) is None
    assert stream.finish() == " world!"
    stream = TextStream(words.decode)  # no prompt: like a decode of the output alone
    assert stream.add([1, 2]) is None
    assert stream.finish() == "world!"


@pytest.mark.parametrize("stop", [[""], "ab", [None]])
def test_bad_stop_strings_are_rejected(stop):
    with pytest.raises(ValueError):
        TextStream(toy_decode, stop=stop)
