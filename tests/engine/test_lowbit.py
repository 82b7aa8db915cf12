"""Low-bit targets are exact: a verify forward over k + 1 tokens gives, row for row, the logits of
one-token steps (batch invariance), so speculative decoding on a quantized target equals that target's
own plain decoding; a GGUF's blocks load to the same model as quantizing the checkpoint in process."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_helpers import random_ids

from specmesh.decoding.adaptive import FixedK
from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.speculative import generate
from specmesh.decoding.verifier import TargetVerifier
from specmesh.drafters.ngram import PromptLookupDrafter
from specmesh.models.config import LlamaFamilyConfig
from specmesh.models.engine import SeqInput
from specmesh.models.llama import LlamaFamilyModel
from specmesh.models.load import load_engine
from specmesh.models.lowbit.blocks import FORMATS, quantize
from specmesh.models.lowbit.gguf_file import read_gguf
from specmesh.models.lowbit.quantize import HEAD_FORMATS, quantize_checkpoint
from specmesh.models.native_engine import NativeEngine
from specmesh.models.weights import load_tensors

PROMPTS = [[5, 17, 33, 5, 17, 33, 5, 17, 33, 5], [100, 7, 250, 31, 9, 60, 12, 200, 4, 4, 99, 1, 3], [42, 43]]
# (family, tiny-model options, quantize kind): every kind, tied and untied heads, qkv bias, K-quant rows
CASES = [
    ("llama", {}, "int8"),
    ("smollm2", {}, "int4"),
    ("qwen2", {}, "q4_0"),
    ("llama", {"hidden_size": 256}, "q4_k"),
    ("qwen3", {"hidden_size": 256}, "q6_k"),
]
ROW_TOLERANCE = 0.0  # bit for bit: the low-bit forward (8-bit activations, fixed-order attention) is batch-invariant


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    cache: dict = {}

    def get(family, options, kind):
        key = (family, tuple(sorted(options.items())), kind)
        if key not in cache:
            cache[key] = load_engine(tiny_model_dir(family, init_std=0.2, **options), quantize=kind)
        return cache[key]

    return get


def _verify_rows(engine, prompt, draft):
    """Logits after prompt + each draft token: one forward over the draft, and one token at a time."""
    together_seq, single_seq = engine.new_sequence(), engine.new_sequence()
    engine.forward([SeqInput(together_seq, prompt, [len(prompt) - 1]), SeqInput(single_seq, prompt, [len(prompt) - 1])])
    together = engine.forward([SeqInput(together_seq, draft, list(range(len(draft))))])[0]
    single = torch.cat([engine.forward([SeqInput(single_seq, [token], [0])])[0] for token in draft])
    engine.free(together_seq)
    engine.free(single_seq)
    return together, single


@pytest.mark.parametrize("family,options,kind", CASES)
def test_verify_rows_equal_single_steps(engines, family, options, kind):
    engine = engines(family, options, kind)
    for seed, prompt in enumerate(PROMPTS):
        for k in (1, 4, 8):
            together, single = _verify_rows(engine, prompt, random_ids(engine.vocab_size, k + 1, seed=10 * seed + k))
            scale = single.abs().max()
            assert (together - single).abs().max() <= ROW_TOLERANCE * scale, (kind, seed, k)
            assert torch.equal(together.argmax(-1), single.argmax(-1))


@pytest.mark.parametrize("family,options,kind", CASES[:2])
def test_rows_do_not_depend_on_other_sessions_or_on_prefill_chunks(engines, family, options, kind):
    """Cross-session verify batches and chunked prefills give the logits of each sequence alone, bit for bit."""
    engine = engines(family, options, kind)
    prompt = random_ids(engine.vocab_size, 90, seed=5)  # more rows than a verify batch: the prefill path too
    whole, chunked, other = engine.new_sequence(), engine.new_sequence(), engine.new_sequence()
    expected = engine.forward([SeqInput(whole, prompt, [len(prompt) - 1])])[0]
    for start in range(0, len(prompt), 7):
        piece = prompt[start : start + 7]
        got = engine.forward([SeqInput(chunked, piece, [len(piece) - 1])])[0]
    assert torch.equal(got, expected)
    draft = random_ids(engine.vocab_size, 5, seed=6)
    alone = engine.forward([SeqInput(whole, draft, list(range(5)))])[0]
    engine.forward([SeqInput(other, PROMPTS[1], [0])])
    batched = engine.forward([SeqInput(other, draft[:3], [0, 1, 2]), SeqInput(chunked, draft, list(range(5)))])[1]
    assert torch.equal(batched, alone)
    for seq in (whole, chunked, other):
        engine.free(seq)


def test_dynamic_int8_is_not_batch_invariant(engines):
    """The check above has teeth: per-call activation scales move the logits far past rounding."""
    engine = engines("llama", {}, "int8-dynamic")
    together, single = _verify_rows(engine, PROMPTS[1], random_ids(engine.vocab_size, 9, seed=3))
    assert (together - single).abs().max() > 1e-3 * single.abs().max()


@pytest.mark.parametrize("family,options,kind", CASES)
def test_ngram_speculation_equals_plain_decoding(engines, family, options, kind):
    verifier = TargetVerifier(engines(family, options, kind))
    params = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    for prompt in PROMPTS:
        plain = generate(verifier, None, prompt, params)
        for k in (2, 6):
            spec = generate(verifier, PromptLookupDrafter(min_n=1, max_n=3), prompt, params, k_policy=FixedK(k))
            assert spec.token_ids == plain.token_ids, (kind, prompt, k)
        # random tiny models rarely repeat themselves, so n-gram drafts are mostly rejected: a drafter
        # that knows the answer (wrong at every fifth token) makes long accepted runs certain
        spec = generate(verifier, ScriptDrafter(plain.token_ids), prompt, params, k_policy=FixedK(6))
        assert spec.token_ids == plain.token_ids, (kind, prompt, "script")
        assert spec.stats.num_target_forwards < plain.stats.num_target_forwards / 2


class ScriptDrafter(PromptLookupDrafter):
    """Proposes a known continuation, with every fifth token wrong (so verification accepts a part)."""

    def __init__(self, script: list[int]):
        super().__init__()
        self.script = script

    def open(self, prompt_ids):
        return {"num_generated": 0}

    def propose(self, state, accepted_since_last, max_tokens, params, generator):
        state["num_generated"] += len(accepted_since_last)
        start = state["num_generated"]
        tokens = [t if (start + i) % 5 != 4 else t + 1 for i, t in enumerate(self.script[start : start + max_tokens])]
        return DraftProposal(token_ids=tokens)


def _permute_like_llama_cpp(rows: np.ndarray, num_heads: int) -> np.ndarray:
    index = np.arange(rows.shape[0]).reshape(num_heads, 2, -1).swapaxes(1, 2).reshape(-1)
    return rows[index]


def _write_gguf(path, folder, config: LlamaFamilyConfig, fmt: str) -> None:
    """The tiny model as llama.cpp would store it: GGUF names, q/k rows permuted, matrices in `fmt`
    (the tied embedding in the vocab projection's format), norms in F32."""
    import gguf

    names = {v: k for k, v in {
        "token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}.items()}
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, tensor in load_tensors(folder, torch.float32).items():
        if name in names:
            gguf_name = names[name]
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gguf_name = f"blk.{layer}.{parts[rest.rsplit('.', 1)[0]]}.weight"
        if tensor.dim() == 1:
            writer.add_tensor(gguf_name, tensor.numpy())
            continue
        tensor_fmt = HEAD_FORMATS[fmt] if name == "model.embed_tokens.weight" else fmt
        rows = quantize(tensor, tensor_fmt)
        if ".q_proj." in name or ".k_proj." in name:
            rows = _permute_like_llama_cpp(rows, config.num_heads if ".q_proj." in name else config.num_kv_heads)
        writer.add_tensor(gguf_name, rows, raw_dtype=FORMATS[tensor_fmt])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("fmt,options", [("q4_1", {}), ("q4_k", {"hidden_size": 256})])
def test_gguf_blocks_load_as_the_same_model(tiny_model_dir, tmp_path, fmt, options):
    from transformers import AutoConfig

    folder = tiny_model_dir("smollm2", init_std=0.2, **options)
    config = LlamaFamilyConfig.from_hf(AutoConfig.from_pretrained(folder))
    _write_gguf(tmp_path / "tiny.gguf", folder, config, fmt)
    from_file = read_gguf(tmp_path / "tiny.gguf", config)
    in_process = quantize_checkpoint(load_tensors(folder, torch.float32), fmt, tie_word_embeddings=True)
    assert from_file.keys() == in_process.keys()
    assert from_file["model.layers.0.self_attn.q_proj.weight"].source == fmt
    assert from_file["model.embed_tokens.weight"].source == HEAD_FORMATS[fmt]
    logits = []
    for tensors in (from_file, in_process):
        engine = NativeEngine(LlamaFamilyModel(config, tensors, torch.float32, torch.device("cpu"), "onednn"))
        seq = engine.new_sequence()
        logits.append(engine.forward([SeqInput(seq, PROMPTS[1], list(range(len(PROMPTS[1]))))])[0])
    assert torch.equal(logits[0], logits[1])


def test_quantize_argument_errors(tiny_model_dir):
    folder = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="unknown quantize"):
        load_engine(folder, quantize="int3")
    with pytest.raises(ValueError, match="float32"):
        load_engine(folder, quantize="int4", dtype="bfloat16")
    with pytest.raises(ValueError, match="GGUF"):
        load_engine(folder, quantize="gguf")


def test_weight_bytes_shrink(engines):
    int8, int4 = engines("llama", {}, "int8"), engines("smollm2", {}, "int4")
    assert int8.model.weight_bytes < 0.3 * 4 * _num_weights(int8)
    assert int4.model.weight_bytes < 0.3 * 4 * _num_weights(int4)


def _num_weights(engine) -> int:
    model = engine.model
    total = model.lm_head.out_features * model.lm_head.in_features
    for layer in model.layers:
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            total += lin.out_features * getattr(lin, "in_features", model.config.hidden_size)
    return total
