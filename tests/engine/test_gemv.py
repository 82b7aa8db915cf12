"""The Triton row-wise linear (specmesh/models/gemv_triton.py), its chooser (specmesh/models/gemv.py) and
`Linear`'s use of it.

Under TRITON_INTERPRET the kernel runs on the CPU in float32 (the interpreter computes in numpy, which
has no bfloat16); on a GPU in bfloat16 and float32, with the chooser timing real layers.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from specmesh.models.gemv import choose_row_kernels, format_report
from specmesh.models.linear import Linear, RowKernel
from specmesh.models.paged_attention import triton_available

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_RUNS = triton_available() and (torch.cuda.is_available() or INTERPRETED)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if torch.cuda.is_available() else [torch.float32]
SHAPES = [(40, 300), (24, 200), (3, 130)]  # (out_features, in_features): neither a multiple of every block
kernel_runs = pytest.mark.skipif(not KERNEL_RUNS,
                                 reason="needs Triton and a GPU, or TRITON_INTERPRET=1 (test_under_the_interpreter)")


def configs():
    """Every candidate on a GPU (two under the slow interpreter), and a small one: several uneven K steps."""
    from specmesh.models.gemv_triton import CANDIDATES, RowConfig

    return [*(CANDIDATES[::5] if INTERPRETED else CANDIDATES), RowConfig(8, 64, 4, 1)]


def case(num_rows: int, out_features: int, in_features: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, in_features, generator=generator) / in_features**0.5
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    return x.to(DEVICE, dtype), weight.to(DEVICE, dtype), bias.to(DEVICE, dtype)


def tolerance(dtype: torch.dtype) -> dict:
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1.6e-2)


@kernel_runs
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows_matches_the_matmul(dtype):
    from specmesh.models.gemv_triton import linear_rows

    for index, (out_features, in_features) in enumerate(SHAPES):
        x, weight, bias = case(8, out_features, in_features, dtype, seed=index)
        with_bias = index % 2 == 0
        want = x.double() @ weight.double().T + (bias.double() if with_bias else 0)  # rounded once, below
        for config in configs()[-2:]:  # every candidate: test_a_row_has_the_same_bits... and the chooser's check
            for num_rows in (1, 2, 3, 5, 8):  # every bucket, masked rows too
                got = linear_rows(x[:num_rows], weight, bias if with_bias else None, config)
                assert got.dtype == dtype and got.shape == (num_rows, out_features)
                torch.testing.assert_close(got, want[:num_rows].to(dtype), **tolerance(dtype), msg=lambda m, config=config: f"{config}: {m}")


@kernel_runs
@pytest.mark.parametrize("dtype", DTYPES[-1:])  # the row kernel's dtype on a GPU (bf16); float32 interpreted
def test_a_row_has_the_same_bits_alone_and_among_others(dtype):
    """Row r of a call of M rows: the same bits as the row alone, in every bucket, whatever the other rows hold."""
    from specmesh.models.gemv_triton import MAX_ROWS, linear_rows

    x, weight, bias = case(MAX_ROWS, 40, 300, dtype)
    others = case(MAX_ROWS, 40, 300, dtype, seed=7)[0] * 1000  # other rows, far larger
    for config in configs():
        alone = torch.cat([linear_rows(x[r : r + 1], weight, bias, config) for r in range(MAX_ROWS)])
        for num_rows in (2, 3, 5, MAX_ROWS):
            assert torch.equal(linear_rows(x[:num_rows], weight, bias, config), alone[:num_rows]), (config, num_rows)
        for r in (0, 3, MAX_ROWS - 1):
            mixed = others.clone()
            mixed[r] = x[r]
            assert torch.equal(linear_rows(mixed, weight, bias, config)[r], alone[r]), (config, r)
            assert torch.equal(linear_rows(mixed[: r + 1], weight, bias, config)[r], alone[r]), (config, r)


@kernel_runs
def test_linear_rows_rejects_more_rows_than_it_takes():
    from specmesh.models.gemv_triton import MAX_ROWS, RowConfig, linear_rows

    x, weight, bias = case(MAX_ROWS + 1, 8, 64, torch.float32)
    with pytest.raises(ValueError):
        linear_rows(x, weight, bias, RowConfig(16, 64, 4, 1))


def test_linear_takes_its_row_kernel_only_up_to_max_rows():
    """Up to max_rows rows `Linear` calls its row kernel; past that, F.linear exactly as without one."""
    x, weight, bias = case(12, 16, 32, torch.float32)
    calls = []

    def fake(x, weight, bias):
        calls.append(x.shape[0])
        return torch.zeros(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)

    layer = Linear(weight, bias)
    layer.row_kernel = RowKernel(run=fake, max_rows=8, config=None)
    assert torch.equal(layer(x), F.linear(x, weight, bias))  # 12 rows: not the row kernel
    assert torch.equal(layer(x[:9]), Linear(weight, bias)(x[:9]))
    assert torch.equal(layer(x[:8]), torch.zeros(8, 16, device=DEVICE)) and calls == [8]
    assert Linear(weight, bias).row_kernel is None  # a class default: the CPU path never sees one


@kernel_runs
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_with_the_triton_row_kernel(dtype):
    from specmesh.models.gemv_triton import MAX_ROWS, RowConfig, linear_rows

    x, weight, bias = case(MAX_ROWS + 3, 40, 300, dtype)
    config = RowConfig(16, 128, 4, 1)
    layer = Linear(weight, bias)
    layer.row_kernel = RowKernel(run=lambda x, w, b: linear_rows(x, w, b, config), max_rows=MAX_ROWS, config=config)
    assert torch.equal(layer(x), F.linear(x, weight, bias))  # past MAX_ROWS: cuBLAS / torch, as before
    for num_rows in (1, 5, MAX_ROWS):
        assert torch.equal(layer(x[:num_rows]), linear_rows(x[:num_rows], weight, bias, config))
        torch.testing.assert_close(layer(x[:num_rows]), F.linear(x[:num_rows], weight, bias), **tolerance(dtype))


def test_the_chooser_leaves_cpu_layers_alone(monkeypatch):
    layers = [Linear(torch.randn(16, 32), None), Linear(torch.randn(16, 32, dtype=torch.bfloat16), torch.zeros(16))]
    for mode in ("auto", "on"):
        report = choose_row_kernels(layers, mode=mode)
        assert report == [{"shape": None, "chosen": None, "reason": "no plain bf16/fp16 Linear layer on CUDA"}]
    monkeypatch.setenv("SPECMESH_ROW_KERNEL", "off")
    assert choose_row_kernels(layers)[0]["reason"] == "SPECMESH_ROW_KERNEL=off"
    assert all(layer.row_kernel is None for layer in layers)
    assert format_report(choose_row_kernels(layers)) == "row kernel not used: SPECMESH_ROW_KERNEL=off"
    with pytest.raises(ValueError):
        choose_row_kernels(layers, mode="fast")


@pytest.mark.skipif(not (triton_available() and torch.cuda.is_available()), reason="needs Triton and a CUDA device")
def test_the_chooser_times_cuda_layers():
    from specmesh.models.gemv_triton import MAX_ROWS

    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(3072, 2048, generator=generator) * 0.02 for _ in range(4)] + [torch.randn(512, 2048) * 0.02]
    layers = [Linear(w.to("cuda", torch.bfloat16), None) for w in weights]
    report = choose_row_kernels(layers, mode="on")
    print(format_report(report))
    assert [entry["shape"] for entry in report] == [(3072, 2048), (512, 2048)]
    assert report[0]["layers"] == 4 and set(report[0]["cublas_us"]) == {1, MAX_ROWS}
    for entry in report:
        assert entry["chosen"] is not None, entry
        assert all("us" in c for c in entry["candidates"]), entry["candidates"]  # every candidate compiled and passed
    x = torch.randn(MAX_ROWS, 2048, device="cuda", dtype=torch.bfloat16)
    for layer in layers:
        assert layer.row_kernel is not None
        assert layer.weight is not None
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), atol=1e-2, rtol=1.6e-2)
        assert torch.equal(layer(x[:1]), layer(x)[:1])
    auto = [Linear(w.to("cuda", torch.bfloat16), None) for w in weights]
    print(format_report(choose_row_kernels(auto, mode="auto")))  # whichever it picks, it runs


@pytest.mark.skipif(not (triton_available() and torch.cuda.is_available()), reason="needs Triton and a CUDA device")
def test_load_engine_reports_its_choice(tiny_model_dir, monkeypatch):
    from specmesh.models.engine import SeqInput
    from specmesh.models.load import load_engine

    folder = tiny_model_dir("llama", init_std=0.2)
    monkeypatch.setenv("SPECMESH_ROW_KERNEL", "on")
    engine = load_engine(folder, dtype="bfloat16", device="cuda")
    assert engine.row_kernel_report and all(entry["chosen"] is not None for entry in engine.row_kernel_report)
    monkeypatch.setenv("SPECMESH_ROW_KERNEL", "off")
    plain = load_engine(folder, dtype="bfloat16", device="cuda")
    assert plain.row_kernel_report[0]["reason"] == "SPECMESH_ROW_KERNEL=off"
    ids = list(range(3, 20))
    seqs = {id(e): e.new_sequence() for e in (engine, plain)}
    got, want = (e.forward([SeqInput(seqs[id(e)], ids, list(range(len(ids))))])[0] for e in (engine, plain))
    torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)  # prefill (17 rows): cuBLAS in both
    got, want = (e.forward([SeqInput(seqs[id(e)], [5], [0])])[0] for e in (engine, plain))  # a decode row: 1 row
    torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)


@pytest.mark.skipif(not triton_available() or torch.cuda.is_available() or INTERPRETED,
                    reason="needs Triton on a machine without a GPU")
def test_under_the_interpreter():
    """This file again with TRITON_INTERPRET=1 in a process of its own (Triton reads the switch when it is
    first imported): the kernel runs on the CPU."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", __file__, "-p", "no:cacheprovider"],
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "6 passed" in done.stdout
