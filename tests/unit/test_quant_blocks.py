"""Low-bit block formats: our K-quant writers against gguf's dequantization, the QuantWeight numbers
against the format's, and the fused kernel's rows against one-row calls (bit for bit)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specmesh.models.lowbit.blocks import FORMATS, dequantize, from_ggml, quantize, quantize_weight
from specmesh.models.lowbit.gguf_file import hf_name, unpermute_rows
from specmesh.models.lowbit.kernel import (
    BUILDS,
    build,
    fused_matmul,
    invariant_attention,
    library,
    load,
    quantize_activations,
    reference_matmul,
)
from specmesh.models.lowbit.qlinear import QuantLinear
from specmesh.models.lowbit.quantize import format_for, quantize_checkpoint
from specmesh.models.lowbit.qweight import concatenate

ALL_FORMATS = list(FORMATS)


def _weight(rows=48, cols=512, seed=0):
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=generator)
    w[0] = 0.0  # an all-zero row: zero scales must not divide by zero
    w[1] = w[1].abs() + 0.5  # all positive: Q4_K's min clamps at 0
    return w


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_quant_weight_equals_the_formats_dequantization(fmt):
    w = _weight()
    rows = quantize(w, fmt)
    expected = dequantize(rows, fmt)  # gguf's reference dequantization of the bytes
    got = from_ggml(rows, fmt).dequantize()
    assert torch.equal(got, expected)


@pytest.mark.parametrize("fmt,max_rel_error", [("q4_0", 0.2), ("q4_1", 0.12), ("q8_0", 0.01), ("q4_k", 0.15), ("q6_k", 0.04)])
def test_round_trip_error_is_small(fmt, max_rel_error):
    w = _weight()
    error = (quantize_weight(w, fmt).dequantize() - w).abs().max(dim=1).values
    assert (error <= max_rel_error * w.abs().max(dim=1).values + 1e-6).all()


def test_k_quant_block_sizes_and_errors():
    assert quantize(_weight(cols=512), "q4_k").shape == (48, 2 * 144)
    assert quantize(_weight(cols=512), "q6_k").shape == (48, 2 * 210)
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(_weight(cols=96), "q4_k")
    assert format_for("q4_k", 96) == "q4_1" and format_for("q6_k", 96) == "q8_0" and format_for("q4_1", 48) is None


def test_quantized_bytes_use_fewer_bits():
    w = _weight(cols=1024)
    bits = {fmt: quantize_weight(w, fmt).nbytes * 8 / w.numel() for fmt in ALL_FORMATS}
    assert bits["q4_1"] == 5.0 and bits["q4_0"] == 5.0 and bits["q8_0"] == 8.5  # float16 scales (and offsets)
    assert bits["q4_k"] == 6.0 and bits["q6_k"] == 10.0  # float32 scales: exact products d * sc


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_rows_are_bit_identical_whatever_the_batch(fmt):
    if library() is None:
        pytest.skip("no C++ compiler: the fallback is only invariant up to rounding")
    layer = QuantLinear(quantize_weight(_weight(rows=40, cols=512), fmt), torch.randn(40))
    x = torch.randn(19, 512, generator=torch.Generator().manual_seed(1))
    together = layer(x)
    for start, size in [(0, 1), (3, 5), (8, 9), (17, 2)]:
        assert torch.equal(layer(x[start : start + size]), together[start : start + size])
    assert torch.allclose(together, reference_matmul(x, layer.weight) + layer.bias, atol=1e-4)


def test_fused_kernel_matches_reference_on_odd_shapes():
    if library() is None:
        pytest.skip("no C++ compiler")
    weight = quantize_weight(_weight(rows=7, cols=96), "q4_1")  # 7 outputs: uneven thread chunks
    x = torch.randn(3, 96)
    got = fused_matmul(x, weight)
    assert got is not None and torch.allclose(got, reference_matmul(x, weight), atol=1e-5)


# The older instruction-set levels the kernel has a path for (kernel.BUILDS): x86-64-v2 has no AVX2 (the plain
# loops), x86-64-v3 has AVX2, FMA and F16C but no AVX-512 (the AVX2 path); the native build takes the VNNI path
# where the CPU has it.
ARCH_LEVELS = ("portable", "avx2")


def _build_levels(tmp_path):
    """{name: library} for every instruction-set level this compiler and CPU can build and run, native included."""
    native = library()
    if native is None:
        pytest.skip("needs a C++ compiler")
    libraries = {"native": native}
    for name in ARCH_LEVELS:
        try:
            libraries[name] = load(build("g++", tmp_path / name, BUILDS[name]))
        except (RuntimeError, OSError):
            continue  # not an x86-64 compiler, or a CPU below this level
    if "portable" not in libraries:
        pytest.skip("cannot build the x86-64-v2 (plain loops) kernel here")
    return libraries


def test_every_instruction_set_path_gives_the_same_numbers_bit_for_bit(tmp_path):
    """A CPU without VNNI, or without AVX2 (the plain-loop integer dots), computes the same floats in the same
    order as the native build (the VNNI path on a CPU with AVX-512 VNNI)."""
    libraries = _build_levels(tmp_path)
    assert libraries["portable"].lowbit_has_vnni() == 0 and libraries["portable"].lowbit_has_avx2() == 0
    if "avx2" in libraries:
        assert libraries["avx2"].lowbit_has_vnni() == 0 and libraries["avx2"].lowbit_has_avx2() == 1
    x = torch.randn(11, 576, generator=torch.Generator().manual_seed(3))
    x[2, :32] = 0.0  # an all-zero activation block
    x[4, 64:96] = -x[4, 64:96].abs()  # a block at -127 codes against every weight sign
    # 576: blocks not a whole 16 (the offsets' masked tail); 96: a last chunk of 32 inputs (the portable tail)
    shapes = [(fmt, 512 if fmt in ("q4_k", "q6_k") else 576) for fmt in ALL_FORMATS] + [("q4_1", 96), ("q8_0", 96)]
    for fmt, cols in shapes:
        weight = quantize_weight(_weight(rows=21, cols=cols), fmt)
        for scales in (torch.float16, torch.float32):
            w = weight.to_scale_dtype(scales)
            outputs = {name: fused_matmul(x[:, :cols], w, lib) for name, lib in libraries.items()}
            plain = outputs.pop("portable")
            assert plain is not None
            for name, got in outputs.items():
                assert got is not None and torch.equal(got, plain), (name, fmt, cols, scales)


def test_attention_gives_the_same_numbers_on_every_instruction_set_bit_for_bit(tmp_path):
    """The fixed-order attention's dot products are fused multiply-adds on every build: with and without FMA
    instructions (a compiler left to contract a * b + c would fuse them on one CPU only). Head dim 72: a tail."""
    libraries = _build_levels(tmp_path)
    generator = torch.Generator().manual_seed(5)
    for head_dim in (64, 72):
        q = torch.randn(4, 6, head_dim, generator=generator)
        keys, values = torch.randn(50, 2, head_dim, generator=generator), torch.randn(50, 2, head_dim, generator=generator)
        outputs = {name: invariant_attention(q, keys, values, None, 0, 50, None, 4, None, head_dim ** -0.5, lib)
                   for name, lib in libraries.items()}
        plain = outputs.pop("portable")
        assert plain is not None
        for name, got in outputs.items():
            assert got is not None and torch.equal(got, plain), (name, head_dim)


def test_the_q8_path_meets_the_extreme_codes_exactly(tmp_path):
    """q8 codes of -128 (magnitude 128, the u8 x s8 products' largest) against activations of +-127: the AVX2
    path's 16-bit pair sums are at their largest here and must not saturate."""
    libraries = _build_levels(tmp_path)
    weight = quantize_weight(_weight(rows=5, cols=128), "q8_0")
    codes = weight.codes.clone()
    codes[:, ::2], codes[:, 1::2] = -128, 127
    extreme = type(weight)(weight.layout, codes, weight.scales, None, weight.group_size, weight.source)
    x = torch.full((3, 128), 1.0)
    x[1] = -1.0
    x[2, ::3] = -1.0
    dense = extreme.dequantize()
    for name, lib in libraries.items():
        got = fused_matmul(x, extreme, lib)
        assert got is not None and torch.allclose(got, x @ dense.T, rtol=1e-5), name


def test_activations_are_quantized_per_row_block():
    x = torch.tensor([[0.5, -1.0, 0.25, 0.0] * 8 + [0.0] * 32])
    q = quantize_activations(x)
    assert torch.equal(q[0, 32:], torch.zeros(32))  # an all-zero block stays zero
    assert torch.allclose(q[0, :32], x[0, :32], atol=1.0 / 254)  # max |x| = 1: steps of 1/127
    assert q[0, 1] == -1.0  # the block's largest magnitude is exact
    together = quantize_activations(torch.cat([x, 3 * x]))
    assert torch.equal(together[0], q[0])  # each row on its own scales


def test_torch_fallback_without_a_compiler(monkeypatch):
    import specmesh.models.lowbit.kernel as kernel

    layer = QuantLinear(quantize_weight(_weight(rows=16, cols=64), "q4_0"), None)
    x = torch.randn(5, 64)
    compiled = layer(x)
    monkeypatch.setattr(kernel, "library", lambda: None)
    assert fused_matmul(x, layer.weight) is None
    fallback = QuantLinear(layer.weight, None)
    assert fallback._matmul is None
    assert torch.allclose(fallback(x), compiled, atol=1e-5)


def test_concatenate_mixes_scale_precisions():
    a, b = quantize_weight(_weight(rows=8), "q4_1"), quantize_weight(_weight(rows=4, seed=2), "q4_k")
    both = concatenate([a, b])
    assert both.scales.dtype == torch.float32 and both.source == "q4_1+q4_k"
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))


def test_quantize_checkpoint_picks_formats():
    tensors = {
        "model.embed_tokens.weight": _weight(rows=10, cols=256),
        "model.layers.0.self_attn.q_proj.weight": _weight(rows=8, cols=256),
        "model.layers.0.mlp.down_proj.weight": _weight(rows=8, cols=64),
        "model.layers.0.input_layernorm.weight": torch.ones(256),
    }
    out = quantize_checkpoint(tensors, "q4_k", tie_word_embeddings=True)
    assert out["model.embed_tokens.weight"].source == "q6_k"  # the tied vocab projection gets more bits
    assert out["model.layers.0.self_attn.q_proj.weight"].source == "q4_k"
    assert out["model.layers.0.mlp.down_proj.weight"].source == "q4_1"  # 64 inputs: no K-quant block fits
    assert isinstance(out["model.layers.0.input_layernorm.weight"], torch.Tensor)
    with pytest.raises(ValueError, match="unknown quantization kind"):
        quantize_checkpoint(tensors, "int3", tie_word_embeddings=True)


def test_gguf_names_and_unpermute():
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.0.unknown.weight") is None
    assert unpermute_rows(4, 1).tolist() == [0, 2, 1, 3]
    num_heads, head_dim = 3, 8
    permute = np.arange(num_heads * head_dim).reshape(num_heads, 2, head_dim // 2).swapaxes(1, 2).reshape(-1)  # llama.cpp
    assert torch.equal(torch.from_numpy(permute)[unpermute_rows(num_heads * head_dim, num_heads)], torch.arange(num_heads * head_dim))


def test_fixed_order_attention_matches_sdpa_and_is_row_invariant():
    from specmesh.models.lowbit.kernel import invariant_attention

    if library() is None:
        pytest.skip("no C++ compiler")
    generator = torch.Generator().manual_seed(4)
    heads, kv_heads, dim, keys = 6, 2, 48, 70  # head_dim not a multiple of 16: the dot's tail
    cache_k = torch.randn(128, kv_heads, dim, generator=generator) * 3  # scores spread far: exp's range
    cache_v = torch.randn(128, kv_heads, dim, generator=generator)
    slots = torch.randperm(128, generator=generator)[:keys].unsqueeze(0)
    q = torch.randn(4, heads, dim, generator=generator)
    mask = torch.ones(1, 1, 4, keys, dtype=torch.bool).tril(diagonal=keys - 4)  # causal over the last 4 keys
    got = invariant_attention(q, cache_k, cache_v, slots, 0, keys, mask, 4, None, dim**-0.5)
    k_rows, v_rows = cache_k[slots[0]].unsqueeze(0), cache_v[slots[0]].unsqueeze(0)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(0).transpose(1, 2), k_rows.transpose(1, 2), v_rows.transpose(1, 2), attn_mask=mask,
        scale=dim**-0.5, enable_gqa=True).transpose(1, 2).reshape(4, -1)
    assert got is not None and torch.allclose(got, expected, atol=2e-6, rtol=1e-5)
    last = invariant_attention(q[3:], cache_k, cache_v, slots, 0, keys, None, 1, None, dim**-0.5)
    assert torch.equal(last, got[3:])  # the last query alone, every key visible: the same bits


def test_the_kernel_build_is_picked_by_the_environment(monkeypatch):
    import specmesh.models.lowbit.kernel as kernel

    try:
        monkeypatch.setenv(kernel.ENV_KERNEL, "sse9")
        kernel.library.cache_clear()
        with pytest.raises(ValueError, match="native, avx2, portable, torch"):
            kernel.library()
        monkeypatch.setenv(kernel.ENV_KERNEL, "torch")
        kernel.library.cache_clear()
        assert kernel.library() is None
    finally:
        monkeypatch.delenv(kernel.ENV_KERNEL)
        kernel.library.cache_clear()
