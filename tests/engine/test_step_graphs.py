"""The fixed-shape step (specmesh/models/graphs.py) against the engine's eager forward.

On the CPU the static step runs eagerly (what CUDA graphs capture and replay), its attention the
torch reference of the paged kernel; under TRITON_INTERPRET the Triton kernel itself runs on the CPU.
The CUDA half (graphs captured and replayed; the kernel compiled) runs where a GPU is.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from engine_helpers import hf_logits, random_ids

from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.speculative import generate
from specmesh.decoding.verifier import TargetVerifier
from specmesh.drafters.ngram import PromptLookupDrafter
from specmesh.models import graphs
from specmesh.models.engine import NO_PARENT, SeqInput
from specmesh.models.load import load_engine
from specmesh.models.paged_attention import PagedBatch, paged_attention_reference, triton_available

PROMPTS = [[5, 17, 33, 5, 17, 33, 5, 17], [100, 7, 250, 31, 9, 60, 12, 200, 4, 4, 99, 1, 3]]


def with_static_step(engine):
    """The engine with its chains and decode rows on the fixed-shape step, run eagerly. Its cache starts
    as NaN: a slot read before it is written (padding, past a sequence's keys) shows in the logits."""
    engine.cache.k.fill_(float("nan"))
    engine.cache.v.fill_(float("nan"))
    engine.step_graphs = graphs.StepGraphs(engine, capture=False)
    engine.cuda_graphs = True
    return engine


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("llama", init_std=0.2)  # peaked logits: no greedy near-ties


@pytest.fixture(scope="module")
def engines(folder):
    eager = load_engine(folder, dtype="float64", max_kv_tokens=1024, block_size=4)
    static = with_static_step(load_engine(folder, dtype="float64", max_kv_tokens=1024, block_size=4))
    return eager, static


def forward_chunks(engine, seqs, chunks):
    """Feed each step's (sequence index, token ids) pairs as one batch; logits of every token."""
    out = []
    for step in chunks:
        batch = [SeqInput(seqs[i], ids, list(range(len(ids)))) for i, ids in step]
        out += engine.forward(batch)
    return out


def test_ragged_steps_match_the_eager_forward(engines):
    eager, static = engines
    ids = [random_ids(eager.vocab_size, 50, seed=s) for s in range(3)]
    steps_before = static.step_graphs.num_steps
    chunks = [
        [(0, ids[0][:12]), (1, ids[1][:3])],  # short prefills (bucket 2 x 16)
        [(0, ids[0][12:13]), (1, ids[1][3:8]), (2, ids[2][:1])],  # a decode row, a verify chain (4 x 8)
        [(0, ids[0][13:14]), (1, ids[1][8:9]), (2, ids[2][1:2])],  # decode rows (4 x 1)
        [(1, ids[1][9:40])],  # a 31-token chunk: the largest row bucket
        [(0, ids[0][14:50])],  # 36 tokens: over the largest row bucket, eager
    ]
    got = forward_chunks(static, [static.new_sequence() for _ in range(3)], chunks)
    want = forward_chunks(eager, [eager.new_sequence() for _ in range(3)], chunks)
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-9, rtol=0)
    assert static.step_graphs.num_steps - steps_before == 4  # all but the 36-token chunk; nothing captured on the CPU
    assert static.step_graphs.num_captured == 0


def test_float32_steps_match_the_eager_forward(folder):
    """In float32 the static step takes the kernels' dtype: under TRITON_INTERPRET its attention and fused
    elementwise work are the Triton kernels themselves."""
    eager = load_engine(folder, dtype="float32", max_kv_tokens=1024, block_size=4)
    static = with_static_step(load_engine(folder, dtype="float32", max_kv_tokens=1024, block_size=4))
    ids = [random_ids(eager.vocab_size, 20, seed=s) for s in range(2)]
    chunks = [[(0, ids[0][:9]), (1, ids[1][:3])], [(0, ids[0][9:10]), (1, ids[1][3:8])], [(0, ids[0][10:11])]]
    got = forward_chunks(static, [static.new_sequence() for _ in range(2)], chunks)
    want = forward_chunks(eager, [eager.new_sequence() for _ in range(2)], chunks)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=16)
    assert (generate(TargetVerifier(static), PromptLookupDrafter(min_n=1, max_n=3), PROMPTS[0], params).token_ids
            == generate(TargetVerifier(eager), None, PROMPTS[0], params).token_ids)


def test_the_static_step_writes_only_its_own_slots(engines, folder):
    """Padding rows go to the scratch blocks: every sequence's KV equals the eager engine's, and no block leaks."""
    eager, static = engines
    free_before = static.num_free_blocks
    seqs = {}
    for engine in (eager, static):
        a, b = engine.new_sequence(), engine.new_sequence()
        engine.forward([SeqInput(a, PROMPTS[0], [7]), SeqInput(b, PROMPTS[1][:5], [4])])
        engine.forward([SeqInput(a, [9], [0]), SeqInput(b, PROMPTS[1][5:8], [2])])
        seqs[engine] = (a, b)
    for i in range(2):
        e, s = seqs[eager][i], seqs[static][i]
        assert eager.seq_len(e) == static.seq_len(s)
        for cache_e, cache_s in ((eager.cache.k, static.cache.k), (eager.cache.v, static.cache.v)):
            torch.testing.assert_close(cache_s[:, static.cache.slot_tensor(s)], cache_e[:, eager.cache.slot_tensor(e)],
                                       atol=1e-9, rtol=0)
    for engine in (eager, static):
        for seq in seqs[engine]:
            engine.free(seq)
    assert static.num_free_blocks == free_before


def test_trees_groups_and_long_chunks_stay_eager():
    assert graphs.step_shape([SeqInput(0, [1], [0])]) == (1, 1)
    assert graphs.step_shape([SeqInput(0, [1] * 5, [4]), SeqInput(1, [1], [0]), SeqInput(2, [1], [0])]) == (4, 8)
    assert graphs.step_shape([SeqInput(0, [1, 2, 3], [0, 1, 2], parents=[NO_PARENT, 0, 0])]) is None
    assert graphs.step_shape([SeqInput(0, [1], [0], group=3)]) is None
    assert graphs.step_shape([SeqInput(0, [1] * 33, [32])]) is None
    assert graphs.step_shape([SeqInput(i, [1] * 32, [0]) for i in range(65)]) is None  # 128 x 32 > MAX_ROWS


def test_greedy_plain_and_speculative_decoding_match(engines):
    eager, static = engines
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=24)
    for prompt in PROMPTS:
        want = generate(TargetVerifier(eager), None, prompt, params).token_ids
        assert generate(TargetVerifier(static), None, prompt, params).token_ids == want
        assert generate(TargetVerifier(static), PromptLookupDrafter(min_n=1, max_n=3), prompt, params).token_ids == want


def test_steps_launched_ahead_feed_the_static_step(engines):
    """Plain steps ahead (verifier.py) on the fixed-shape step: a greedy round's next step takes its token
    id from the device (`feed`), written into the static buffer after the packed copy."""
    eager, static = engines
    for params in (SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=24),
                   SamplingParams(temperature=1.0, top_k=20, seed=7, ignore_eos=True, max_new_tokens=24)):
        want = generate(TargetVerifier(eager, plain_ahead=False), None, PROMPTS[1], params).token_ids
        verifier = TargetVerifier(static, plain_ahead=True)
        steps = static.step_graphs.num_steps
        assert generate(verifier, None, PROMPTS[1], params).token_ids == want
        assert verifier.num_ahead_taken == 22 and static.step_graphs.num_steps - steps == 24  # prefill + 23 rounds


def test_seeded_sampling_matches(engines):
    eager, static = engines
    params = SamplingParams(temperature=1.0, top_k=20, seed=7, ignore_eos=True, max_new_tokens=20)
    for drafter in (None, PromptLookupDrafter(min_n=1, max_n=3)):
        want = generate(TargetVerifier(eager), drafter, PROMPTS[1], params).token_ids
        assert generate(TargetVerifier(static), drafter, PROMPTS[1], params).token_ids == want


def paged_case(num_heads, num_kv_heads, head_dim, rows, block_size, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    num_blocks, width = 32, 6
    k = torch.randn(num_blocks * block_size, num_kv_heads, head_dim, generator=generator, dtype=dtype)
    v = torch.randn(num_blocks * block_size, num_kv_heads, head_dim, generator=generator, dtype=dtype)
    tables = torch.stack([torch.randperm(num_blocks, generator=generator)[:width] for _ in range(3)])
    batch = PagedBatch(block_tables=tables, seq_lens=torch.tensor([rows + 2, width * block_size, rows]),
                       query_lens=torch.tensor([rows, max(1, rows - 1), rows]), block_size=block_size,
                       rows_per_sequence=rows)
    q = torch.randn(3 * rows, num_heads, head_dim, generator=generator, dtype=dtype)
    return q, k, v, batch


def test_reference_attention_follows_the_worked_example():
    """paged_attention.py's docstring: block size 4, table [7, 3], 6 keys, 2 new queries."""
    q, k, v, _ = paged_case(2, 1, 8, 2, 4, torch.float64)
    batch = PagedBatch(block_tables=torch.tensor([[7, 3]]), seq_lens=torch.tensor([6]), query_lens=torch.tensor([2]),
                       block_size=4, rows_per_sequence=2)
    q = q[:2]
    got = paged_attention_reference(q, k, v, batch, 0.5)
    slots = torch.tensor([28, 29, 30, 31, 12, 13])
    for t, visible in ((0, 5), (1, 6)):
        keys, values = k[slots[:visible], 0], v[slots[:visible], 0]  # [keys, head_dim]
        for h in range(2):
            weights = torch.softmax(q[t, h] @ keys.T * 0.5, dim=-1)
            torch.testing.assert_close(got[t, h * 8 : (h + 1) * 8], weights @ values)


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_RUNS = triton_available() and (torch.cuda.is_available() or INTERPRETED)


@pytest.mark.skipif(not KERNEL_RUNS, reason="needs Triton and a GPU, or TRITON_INTERPRET=1 (test_under_the_interpreter)")
@pytest.mark.parametrize("shape", [(4, 2, 8, 1, 4), (8, 2, 16, 3, 16), (4, 4, 64, 5, 16), (32, 8, 64, 9, 16)])
def test_triton_kernel_matches_the_reference(shape):
    from specmesh.models.paged_attention_triton import paged_attention_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, batch = paged_case(*shape, dtype=torch.float32)
    q, k, v = q.to(device), k.to(device), v.to(device)
    batch = PagedBatch(*(t.to(device) for t in (batch.block_tables, batch.seq_lens, batch.query_lens)),
                       block_size=batch.block_size, rows_per_sequence=batch.rows_per_sequence)
    got = paged_attention_triton(q, k, v, batch, shape[2] ** -0.5)
    torch.testing.assert_close(got, paged_attention_reference(q, k, v, batch, shape[2] ** -0.5), atol=1e-5, rtol=1e-5)


def fused_cases(dtype, device):
    generator = torch.Generator().manual_seed(1)

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(dtype=dtype, device=device)

    num_tokens, heads, kv_heads, head_dim = 5, 4, 2, 16
    x, delta, weight = rand(num_tokens, 96), rand(num_tokens, 96), rand(96)
    yield "add_rms_norm", (x, delta, weight, 1e-5)
    yield "add_rms_norm", (x, None, weight, 1e-5)
    qkv = rand(num_tokens, heads + 2 * kv_heads, head_dim)
    cos, sin = rand(64, head_dim), rand(64, head_dim)
    positions = torch.tensor([3, 9, 0, 63, 10], device=device)
    slots = torch.tensor([7, 2, 30, 11, 12], device=device)
    yield "rope_and_write", (qkv[:, : heads + kv_heads], qkv[:, heads + kv_heads :], cos, sin, positions,
                             torch.zeros(32, kv_heads, head_dim, dtype=dtype, device=device),
                             torch.zeros(32, kv_heads, head_dim, dtype=dtype, device=device), slots, heads)
    yield "silu_mul", (rand(num_tokens, 2 * 2500),)


@pytest.mark.skipif(not KERNEL_RUNS, reason="needs Triton and a GPU, or TRITON_INTERPRET=1 (test_under_the_interpreter)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernels_match_the_eager_ops(dtype):
    from specmesh.models import fused, fused_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the interpreter computes in numpy, which has no bfloat16")
    for name, args in fused_cases(dtype, device):
        on_cpu = [a.cpu().clone() if isinstance(a, torch.Tensor) else a for a in args]  # the eager ops' copy
        with torch.inference_mode():
            want = getattr(fused, name)(*on_cpu)
            got = getattr(fused_triton, name)(*args)
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(g.cpu(), w, atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-5 if dtype == torch.float32 else 1e-2)
        if name == "rope_and_write":  # the caches were written alike
            for g, w in ((args[5], on_cpu[5]), (args[6], on_cpu[6])):
                torch.testing.assert_close(g.cpu(), w.cpu(), atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-2)


@pytest.mark.skipif(not KERNEL_RUNS, reason="needs Triton and a GPU, or TRITON_INTERPRET=1 (test_under_the_interpreter)")
@pytest.mark.parametrize("n,k,bias", [(5, 7, False), (40, 300, True), (64, 2048, False), (3, 2500, True)])
def test_one_row_kernel_matches_f_linear(n, k, bias, monkeypatch):
    """gemv_triton (a B=1 step's linears on CUDA, bf16 / fp16, opt-in) against F.linear: float32 in the
    interpreter; on a GPU also bf16 and fp16, and through `Linear`, which takes it for one row once on."""
    from specmesh.models import linear
    from specmesh.models.gemv_triton import gemv

    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(n + k)
    weight, x = torch.randn(n, k, generator=generator), torch.randn(1, k, generator=generator)
    b = torch.randn(n, generator=generator) if bias else None
    dtypes = [torch.float32] + ([torch.bfloat16, torch.float16] if device == "cuda" else [])
    for dtype in dtypes:
        w, xs, bs = weight.to(device, dtype), x.to(device, dtype), None if b is None else b.to(device, dtype)
        want = torch.nn.functional.linear(xs.float(), w.float(), None if bs is None else bs.float())
        tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.05, rtol=0.02)
        torch.testing.assert_close(gemv(xs, w, bs).float(), want, **tolerance)
        layer = linear.Linear(w, bs)
        monkeypatch.setattr(linear, "ONE_ROW_KERNEL", True)
        if dtype != torch.float32:  # Linear takes the kernel for one bf16 / fp16 row, F.linear otherwise
            assert torch.equal(layer(xs), gemv(xs, w, bs))
            two = torch.cat([xs, xs])
            assert torch.equal(layer(two), torch.nn.functional.linear(two, w, bs))


@pytest.mark.skipif(not triton_available() or torch.cuda.is_available() or INTERPRETED,
                    reason="needs Triton on a machine without a GPU")
def test_under_the_interpreter():
    """This file again with TRITON_INTERPRET=1 in a process of its own (Triton reads the switch when it is
    first imported): the kernel runs on the CPU, in the tests above and inside the engine's static step."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", __file__, "-p", "no:cacheprovider"],
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "17 passed" in done.stdout


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_cuda_graphs_match_the_eager_path_and_transformers(folder):
    from transformers import AutoModelForCausalLM

    graphed = load_engine(folder, dtype="float32", device="cuda")
    eager = load_engine(folder, dtype="float32", device="cuda")
    eager.cuda_graphs = False
    assert graphed.cuda_graphs
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=32)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for prompt in PROMPTS:
        want = generate(TargetVerifier(eager, plain_ahead=False), None, prompt, params).token_ids
        ahead = TargetVerifier(graphed)  # plain steps launched ahead, the greedy ones fed on the device
        assert ahead.plain_ahead
        assert generate(ahead, None, prompt, params).token_ids == want
        assert ahead.num_ahead_taken == 30
        assert generate(TargetVerifier(graphed, plain_ahead=False), None, prompt, params).token_ids == want
        assert generate(TargetVerifier(graphed), PromptLookupDrafter(min_n=1, max_n=3), prompt, params).token_ids == want
        ids = prompt + want
        assert hf_logits(hf, ids)[len(prompt) - 1 : -1].argmax(-1).tolist() == want
    assert graphed.step_graphs.num_captured > 0 and graphed.step_graphs.num_replays > 0
    sampled = SamplingParams(temperature=1.0, top_k=20, seed=3, ignore_eos=True, max_new_tokens=24)
    for drafter in (None, PromptLookupDrafter(min_n=1, max_n=3)):
        assert (generate(TargetVerifier(graphed), drafter, PROMPTS[1], sampled).token_ids
                == generate(TargetVerifier(eager, plain_ahead=False), drafter, PROMPTS[1], sampled).token_ids)


@cuda
def test_cuda_graph_logits_match_eager_logits(folder):
    graphed = load_engine(folder, dtype="float32", device="cuda")
    eager = load_engine(folder, dtype="float32", device="cuda")
    eager.cuda_graphs = False
    ids = [random_ids(graphed.vocab_size, 30, seed=s) for s in range(3)]
    chunks = [[(0, ids[0][:10]), (1, ids[1][:4]), (2, ids[2][:20])],
              [(0, ids[0][10:11]), (1, ids[1][4:9]), (2, ids[2][20:21])],
              [(0, ids[0][11:12])]]
    got = forward_chunks(graphed, [graphed.new_sequence() for _ in range(3)], chunks)
    want = forward_chunks(eager, [eager.new_sequence() for _ in range(3)], chunks)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
