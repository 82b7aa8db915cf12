"""The CPU fast path (specmesh/models/fastpath.py), float32 and bfloat16: the same numbers as the torch forward
up to float rounding, on every layout the engine serves; each row's numbers independent of the rest of the call
and of the thread count, bit for bit; the models it must not serve keep the torch path."""

from __future__ import annotations

import shutil

import pytest
import torch
from engine_helpers import random_ids, with_sliding_window
from safetensors.torch import load_file, save_file

from specmesh.models import fastpath
from specmesh.models.engine import SeqInput
from specmesh.models.load import load_engine

pytestmark = pytest.mark.skipif(fastpath.library() is None, reason="no C++ compiler: the torch path serves all")


def _scenario(engine, use_fast: bool) -> list[torch.Tensor]:
    """Prefill, decode steps, a verify chain, a tree, a ragged batch and a one-sequence group; every
    forward's logits (through the fast path when on, the short prefill included; else the torch path)."""
    saved = fastpath.MAX_ROWS, fastpath.MAX_MEAN_KEYS
    if not use_fast:
        fastpath.MAX_ROWS = fastpath.MAX_MEAN_KEYS = 0
    try:
        out = []
        vocab = engine.vocab_size
        a, b = engine.new_sequence(), engine.new_sequence()
        out += engine.forward([SeqInput(a, random_ids(vocab, 40, seed=1), [39]), SeqInput(b, random_ids(vocab, 23, seed=2), [22])])
        for token in random_ids(vocab, 3, seed=3):  # decode steps
            out += engine.forward([SeqInput(a, [token], [0])])
        out += engine.forward([SeqInput(a, random_ids(vocab, 5, seed=4), list(range(5)))])  # a verify chain
        engine.truncate(a, 43)
        out += engine.forward([SeqInput(a, random_ids(vocab, 5, seed=5), list(range(5)), [-1, 0, 0, 1, -1])])  # a tree
        engine.truncate(a, 43)
        # a ragged batch: a chain, a decode step and a tree side by side
        c = engine.fork(b)
        out += engine.forward([SeqInput(a, random_ids(vocab, 4, seed=6), [0, 3]), SeqInput(b, [7], [0]),
                               SeqInput(c, random_ids(vocab, 3, seed=7), [0, 1, 2], [-1, 0, 0])])
        # two forks of one sequence as one attention row (the one-sequence layout)
        d, e = engine.fork(a), engine.fork(a)
        out += engine.forward([SeqInput(d, random_ids(vocab, 3, seed=8), [0, 1, 2], group=a),
                               SeqInput(e, random_ids(vocab, 2, seed=9), [0, 1], group=a)])
        for seq in (a, b, c, d, e):
            engine.free(seq)
        assert engine.num_free_blocks == engine.cache.blocks.num_blocks
        return out
    finally:
        fastpath.MAX_ROWS, fastpath.MAX_MEAN_KEYS = saved


@pytest.mark.parametrize("family", ["llama", "smollm2", "smollm2-d64", "llama3", "qwen2", "qwen3", "mistral-window"])
def test_fast_path_matches_the_torch_forward(family, tiny_model_dir, tmp_path):
    if family == "mistral-window":
        path = with_sliding_window(tiny_model_dir("mistral", init_std=0.2), tmp_path / "window", 6)
    elif family == "smollm2-d64":  # heads of 64 values, as the real models' (the attention's 64-value path)
        path = tiny_model_dir("smollm2", init_std=0.2, hidden_size=256)
    else:
        path = tiny_model_dir(family, init_std=0.2)
    engine = load_engine(path, dtype="float32", block_size=4)
    assert engine.model.fast is not None
    fast, torch_path = _scenario(engine, True), _scenario(engine, False)
    assert len(fast) == len(torch_path)
    for got, expected in zip(fast, torch_path):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["smollm2", "qwen3", "mistral-window"])
def test_bfloat16_fast_path_computes_the_bfloat16_weights_in_float32(family, tiny_model_dir, tmp_path, monkeypatch):
    """bfloat16 weights and KV, float32 activations: close to the float32 forward of the same (bfloat16-rounded)
    weights, only the keys' and values' rounding between them, and closer to it than the bfloat16 torch path,
    which rounds every activation too."""
    if family == "mistral-window":
        path = with_sliding_window(tiny_model_dir("mistral", init_std=0.2), tmp_path / "window", 6)
    else:
        path = tiny_model_dir(family, init_std=0.2)
    monkeypatch.setattr(fastpath, "bf16_matmul_in_hardware", lambda: False)  # the prefills on the fast path too
    rounded = tmp_path / "rounded"
    shutil.copytree(path, rounded)
    weights = load_file(rounded / "model.safetensors")
    save_file({name: w.to(torch.bfloat16).to(w.dtype) for name, w in weights.items()}, rounded / "model.safetensors")
    engine = load_engine(rounded, dtype="bfloat16", block_size=4)
    assert engine.model.fast is not None and engine.cache.k.dtype == torch.bfloat16
    reference = _scenario(load_engine(rounded, dtype="float32", block_size=4), True)
    fast, torch_path = _scenario(engine, True), _scenario(engine, False)
    assert len(fast) == len(torch_path) == len(reference)
    fast_error = max((got - want).abs().max().item() for got, want in zip(fast, reference))
    torch_error = max((got.float() - want).abs().max().item() for got, want in zip(torch_path, reference))
    scale = max(want.abs().max().item() for want in reference)
    assert all(got.dtype == torch.float32 for got in fast)
    assert fast_error < 0.02 * scale and fast_error < torch_error, (fast_error, torch_error, scale)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("hidden_size", [64, 256])  # heads of 16 and of 64 values
def test_each_row_is_bit_identical_to_the_row_alone(tiny_model_dir, hidden_size, dtype):
    """A verify chain of k + 1 tokens == k + 1 one-token steps; a sequence in a batch == alone; two threads
    == one thread: the last bit, logits and KV alike (so speculative decoding equals plain decoding)."""
    engine = load_engine(tiny_model_dir("smollm2", init_std=0.2, hidden_size=hidden_size), dtype=dtype, block_size=4)
    assert engine.model.fast is not None
    vocab = engine.vocab_size
    a, b = engine.new_sequence(), engine.new_sequence()
    engine.forward([SeqInput(a, random_ids(vocab, 30, seed=11), []), SeqInput(b, random_ids(vocab, 9, seed=12), [])])
    for length in (6, 10, 16, 20):  # row tiles (fastpath.cpp's gemv): AVX2 6; 5 + 5; 6 + 5 + 5; 4 x 5. AVX-512 6 x 2 panels; 10 x 2; 16 x 1; 7 + 7 + 6 x 2
        chain = random_ids(vocab, length, seed=13)
        together = engine.forward([SeqInput(a, chain, list(range(length)))])[0]
        keys_together = engine.cache.k[:, engine.cache.slot_tensor(a)].clone()
        engine.truncate(a, 30)
        steps = torch.cat([engine.forward([SeqInput(a, [t], [0])])[0] for t in chain])
        assert torch.equal(together, steps), length
        assert torch.equal(keys_together, engine.cache.k[:, engine.cache.slot_tensor(a)]), length
        engine.truncate(a, 30)
    chain = chain[:6]
    alone = engine.forward([SeqInput(b, [5, 6], [0, 1])])[0]
    engine.truncate(b, 9)
    batched = engine.forward([SeqInput(a, chain[:3], [2]), SeqInput(b, [5, 6], [0, 1])])[1]
    assert torch.equal(alone, batched)
    engine.truncate(a, 30)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(engine.forward([SeqInput(a, chain, list(range(6)))])[0])
            engine.truncate(a, 30)
        assert torch.equal(results[0], results[1])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("hardware", [True, False])
def test_a_bfloat16_prefill_takes_the_torch_path_where_the_cpu_multiplies_bfloat16(tiny_model_dir, monkeypatch, hardware):
    """Past MAX_ROWS rows a bfloat16 forward goes to oneDNN's bf16 matmuls where the CPU has bf16 dot products;
    a verify chain of up to MAX_ROWS tokens stays on the fast path (its one-token steps' numbers)."""
    monkeypatch.setattr(fastpath, "bf16_matmul_in_hardware", lambda: hardware)
    engine = load_engine(tiny_model_dir("smollm2"), dtype="bfloat16", block_size=4)
    calls = []
    fast = engine.model.fast
    monkeypatch.setattr(engine.model, "fast", lambda *args: calls.append(args[2]) or fast(*args))
    seq = engine.new_sequence()
    engine.forward([SeqInput(seq, random_ids(engine.vocab_size, 40, seed=1), [39])])
    assert len(calls) == (0 if hardware else 1)
    engine.forward([SeqInput(seq, random_ids(engine.vocab_size, fastpath.MAX_ROWS, seed=2), [0])])
    assert len(calls) == (1 if hardware else 2)
    assert fastpath.serves(40, 40 * 20, torch.float32) and fastpath.serves(40, 40 * 20, torch.bfloat16) != hardware


def test_models_the_fast_path_does_not_serve_keep_the_torch_forward(tiny_model_dir, monkeypatch):
    path = tiny_model_dir("llama")
    assert load_engine(path, dtype="float64").model.fast is None
    assert load_engine(path, dtype="float32", quantize="q8_0").model.fast is None  # low-bit: batch-invariant kernels
    monkeypatch.setenv(fastpath.ENV_FASTPATH, "0")
    assert load_engine(path, dtype="float32").model.fast is None


def test_long_float32_prefills_go_where_this_machine_measured_them_faster(tiny_model_dir, monkeypatch, tmp_path):
    """Past MAX_ROWS rows a float32 prefill takes the fast path or oneDNN's matmuls, whichever measured faster
    here (once per machine and model shape, remembered under $SPECMESH_HOME): the next engine of that shape
    measures nothing. Verify chains of up to MAX_ROWS rows stay on the fast path either way."""
    monkeypatch.delenv(fastpath.ENV_PREFILL, raising=False)
    monkeypatch.setenv("SPECMESH_HOME", str(tmp_path))
    folder = tiny_model_dir("smollm2")
    for torch_faster in (True, False):
        timings: list[tuple[float, float]] = []
        measured = (2.0, 1.0) if torch_faster else (1.0, 2.0)
        for _ in range(2):
            engine = load_engine(folder, dtype="float32", block_size=4)
            monkeypatch.setattr(engine, "_time_long_prefills",
                                lambda timings=timings, measured=measured: timings.append(measured) or measured)
            calls: list[int] = []
            monkeypatch.setattr(engine.model, "fast", lambda *args, calls=calls, fast=engine.model.fast:
                                calls.append(args[2]) or fast(*args))
            seq = engine.new_sequence()
            engine.forward([SeqInput(seq, random_ids(engine.vocab_size, 40, seed=1), [39])])
            engine.forward([SeqInput(seq, random_ids(engine.vocab_size, fastpath.MAX_ROWS, seed=2), [0])])
            assert len(calls) == (1 if torch_faster else 2)
        assert len(timings) == 1  # the second engine of the shape read the first one's choice
        (tmp_path / "kernels" / "long-prefill.json").unlink()
    monkeypatch.setenv(fastpath.ENV_PREFILL, "sideways")
    with pytest.raises(ValueError, match="fast or torch"):
        fastpath.long_prefill_on_fast_path("x", lambda: None)


def test_the_measurement_of_long_prefills_leaves_the_engine_as_it_was(tiny_model_dir):
    engine = load_engine(tiny_model_dir("smollm2"), dtype="float32", block_size=4)
    free, stats = engine.num_free_blocks, dict(vars(engine.stats))
    fast_s, torch_s = engine._time_long_prefills()
    assert fast_s > 0 and torch_s > 0
    assert engine.num_free_blocks == free and vars(engine.stats) == stats and engine._long_prefill_fast is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_instruction_set_build_gives_the_same_numbers_bit_for_bit(tiny_model_dir, tmp_path, monkeypatch, dtype):
    """The matmuls' multiply-adds are fused on every build (fastpath.cpp's `maddV`): AVX-512, AVX2 + FMA, and the
    portable build without either (libm's fma, lane by lane) give the same logits, row tiles of every size
    included (a decode step, chains of 5 and of 17 rows, a 40-token prefill)."""
    from specmesh.models.lowbit.kernel import BUILDS, build

    path = tiny_model_dir("smollm2", init_std=0.2, hidden_size=64)
    monkeypatch.setattr(fastpath, "bf16_matmul_in_hardware", lambda: False)  # the prefill on the fast path too

    def logits() -> list[torch.Tensor]:
        engine = load_engine(path, dtype=dtype, block_size=4)
        assert engine.model.fast is not None
        vocab, seq = engine.vocab_size, engine.new_sequence()
        out = engine.forward([SeqInput(seq, random_ids(vocab, 40, seed=21), list(range(40)))])
        for length in (1, 5, 17):
            out += engine.forward([SeqInput(seq, random_ids(vocab, length, seed=length), list(range(length)))])
        return out

    native = logits()
    built = 0
    for level in ("avx2", "portable"):
        try:
            lib = fastpath.load(build("g++", tmp_path / level, BUILDS[level], sources=[fastpath.SOURCE], name="fastpath"))
        except (RuntimeError, OSError):
            continue  # not an x86-64 compiler, or a CPU below this level
        monkeypatch.setattr(fastpath, "library", lambda lib=lib: lib)
        for got, want in zip(logits(), native, strict=True):
            assert torch.equal(got, want), level
        built += 1
    if not built:
        pytest.skip("cannot build fastpath.cpp for another instruction set here")
