"""Quick GPU probe: B=1 decode tok/s (graphs vs eager), batch sweep, verify ratios, for one shape."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from transformers import LlamaConfig  # noqa: E402

from specmesh.decoding.proposal import DraftProposal  # noqa: E402
from specmesh.decoding.sampling import SamplingParams  # noqa: E402
from specmesh.decoding.verifier import TargetVerifier  # noqa: E402
from specmesh.models.config import LlamaFamilyConfig  # noqa: E402
from specmesh.models.engine import SeqInput  # noqa: E402
from specmesh.models.llama import LlamaFamilyModel  # noqa: E402
from specmesh.models.native_engine import NativeEngine  # noqa: E402

SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               head_dim=64, vocab_size=128256, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               head_dim=128, vocab_size=128256, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, vocab_size=512, tie_word_embeddings=True),
}
BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}


def build(shape: str, device: str, dtype: torch.dtype):
    hf = LlamaConfig(**SHAPES[shape], max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5)
    c = hf
    g = torch.Generator(device=device).manual_seed(0)
    t = {}

    def r(*s):
        return (torch.randn(*s, generator=g, device=device, dtype=dtype) * 0.02)

    kv = c.num_key_value_heads * c.head_dim
    t["model.embed_tokens.weight"] = r(c.vocab_size, c.hidden_size)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = torch.ones(c.hidden_size, device=device, dtype=dtype)
        t[p + "post_attention_layernorm.weight"] = torch.ones(c.hidden_size, device=device, dtype=dtype)
        t[p + "self_attn.q_proj.weight"] = r(c.num_attention_heads * c.head_dim, c.hidden_size)
        t[p + "self_attn.k_proj.weight"] = r(kv, c.hidden_size)
        t[p + "self_attn.v_proj.weight"] = r(kv, c.hidden_size)
        t[p + "self_attn.o_proj.weight"] = r(c.hidden_size, c.num_attention_heads * c.head_dim)
        t[p + "mlp.gate_proj.weight"] = r(c.intermediate_size, c.hidden_size)
        t[p + "mlp.up_proj.weight"] = r(c.intermediate_size, c.hidden_size)
        t[p + "mlp.down_proj.weight"] = r(c.hidden_size, c.intermediate_size)
    t["model.norm.weight"] = torch.ones(c.hidden_size, device=device, dtype=dtype)
    if not c.tie_word_embeddings:
        t["lm_head.weight"] = r(c.vocab_size, c.hidden_size)
    model = LlamaFamilyModel(LlamaFamilyConfig.from_hf(hf), t, dtype, torch.device(device), "plain")
    return model


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def main():
    shape = sys.argv[1] if len(sys.argv) > 1 else "1b"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build(shape, device, dtype)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    bw = next((v for k, v in BANDWIDTH.items() if k in name), None)
    roofline = bw / model.weight_bytes if bw else None
    print(f"{shape} on {name}: {model.weight_bytes / 1e9:.2f} GB/token, roofline {roofline and round(roofline)} tok/s", flush=True)
    new_tokens = 128 if device == "cuda" else 8
    for graphs_on in (True, False):
        engine = NativeEngine(model, max_kv_tokens=160 * 300)
        engine.cuda_graphs = graphs_on and engine.cuda_graphs
        verifier = TargetVerifier(engine)
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=10**6)
        prompt = list(range(100, 132))
        # B=1 library path (verify_many with empty drafts)
        rates = []
        for _ in range(3):
            s = verifier.open(prompt, params, torch.Generator(device=device))
            empty = DraftProposal(token_ids=[])
            verifier.verify(s, empty)
            sync(device)
            t0 = time.perf_counter()
            for _ in range(new_tokens):
                verifier.verify(s, empty)
            sync(device)
            rates.append(new_tokens / (time.perf_counter() - t0))
            verifier.close(s)
        rates.sort()
        b1 = rates[1]
        pct = f"{100 * b1 / roofline:.1f}%" if roofline else "-"
        print(f"[{'graphs' if graphs_on else 'eager'}] B=1 verifier decode {b1:.1f} tok/s ({pct} of roofline)", flush=True)
        # bare engine loop, argmax on device
        seq = engine.new_sequence()
        engine.forward([SeqInput(seq, prompt, [len(prompt) - 1])])
        tok = 5
        sync(device)
        t0 = time.perf_counter()
        for _ in range(new_tokens):
            logits = engine.forward([SeqInput(seq, [tok], [0])])[0]
            tok = int(logits.argmax())
        sync(device)
        bare = new_tokens / (time.perf_counter() - t0)
        print(f"[{'graphs' if graphs_on else 'eager'}] B=1 bare engine loop {bare:.1f} tok/s", flush=True)
        step_ms = 1e3 / bare
        for k1 in (5, 9, 17):
            ids = list(range(7, 7 + k1))
            times = []
            for _ in range(5):
                n = engine.seq_len(seq)
                sync(device)
                t0 = time.perf_counter()
                engine.forward([SeqInput(seq, ids, list(range(k1)))])[0].argmax(-1).tolist()
                times.append(time.perf_counter() - t0)
                engine.truncate(seq, n)
            times.sort()
            print(f"[{'graphs' if graphs_on else 'eager'}] verify {k1} tokens {times[2] * 1e3:.2f} ms = {times[2] * 1e3 / step_ms:.2f}x step",
                  flush=True)
        engine.free(seq)
        base = None
        for batch in ((1, 8, 32, 64, 128) if device == "cuda" else (1, 4)):
            ss = verifier.open_many([prompt] * batch, [params] * batch, [torch.Generator(device=device) for _ in range(batch)])
            props = [DraftProposal(token_ids=[])] * batch
            for _ in range(3):
                verifier.verify_many(ss, props)
            sync(device)
            steps = 32 if device == "cuda" else 3
            t0 = time.perf_counter()
            for _ in range(steps):
                verifier.verify_many(ss, props)
            sync(device)
            dt = (time.perf_counter() - t0) / steps
            agg = batch / dt
            base = base or agg
            print(f"[{'graphs' if graphs_on else 'eager'}] B={batch}: {dt * 1e3:.2f} ms/step, {agg:.0f} tok/s, {agg / base:.1f}x B=1",
                  flush=True)
            for s in ss:
                verifier.close(s)
        if engine.step_graphs is not None:
            print(f"graphs captured {engine.step_graphs.num_captured}, replays {engine.step_graphs.num_replays}", flush=True)
        del engine, verifier
        if device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
