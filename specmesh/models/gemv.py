"""Which `Linear` layers run their few-row calls in the Triton row-wise kernel, chosen by measurement.

A decode step multiplies 1 row (a verify k + 1 <= 8 rows) by every weight matrix. cuBLAS reaches only
part of the HBM bandwidth on some of these shapes (Llama-3.2-1B's qkv and o on an H100: ~1.6 of 3.35
TB/s), and its kernel choice changes with the row count, so one row's logits differ in the last bits
between a decode and a verify. The row kernel (specmesh/models/gemv_triton.py) reads the weight once for
all rows and is batch-invariant. Whether it is faster depends on the shape and the card, so at engine
load on CUDA `choose_row_kernels` times, per distinct (out_features, in_features, dtype):
- `F.linear` and each candidate config at 1 row and at MAX_ROWS rows (CUDA events; the calls rotate
  over the model's layers of that shape, so the weights come from HBM as in a real step);
- checks each candidate's output against `F.linear` (bf16 / fp16 tolerance) and row 0 of the MAX_ROWS
  call against the 1-row call bit for bit; a candidate failing either is rejected;
- picks the fastest candidate at 1 row among those not slower than `F.linear` at MAX_ROWS rows by more
  than MAX_ROWS_MARGIN, and uses it where it beats `F.linear` at 1 row.

On an H100 no candidate passes the MAX_ROWS test on the Llama shapes (they are 2-3x slower than cuBLAS
at 8 rows; see gemv_triton.py), so "auto" keeps cuBLAS there.

SPECMESH_ROW_KERNEL: "auto" (the default: as above), "off" (cuBLAS everywhere), "on" (the fastest
correct candidate at 1 row, whatever `F.linear` takes). Without Triton, or when anything raises,
the layers stay on `F.linear`; the report says why.

The report is a list of dicts, one per shape (or one saying why nothing was tried): `format_report`.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from specmesh.models.linear import Linear, RowKernel
from specmesh.models.paged_attention import triton_available

MODES = ("auto", "off", "on")
ROW_DTYPES = (torch.bfloat16, torch.float16)
MAX_ROWS_MARGIN = 0.05  # a candidate may take up to 5% longer than F.linear at MAX_ROWS rows
ONE_ROW_MARGIN = 0.02  # and must beat F.linear at 1 row by 2% (timing noise must not flip a layer)
NUM_GROUPS = 3  # timed groups of calls per measurement; the median is kept
GROUP_S = 1e-3  # aim of one group's GPU time
MAX_CALLS = 20  # calls per group at most
ASSUMED_BYTES_PER_S = 3e12  # to size a group before anything is measured
SLEEP_CYCLES_PER_CALL = 100_000  # GPU idles ~50 us per queued call: the host queues the group meanwhile


def model_linears(model: Any) -> list[Linear]:
    """The `Linear` layers of a LlamaFamilyModel (qkv, o, gate_up, down, lm_head); other kinds skipped."""
    layers: list[Any] = []
    for layer in model.layers:
        layers += [layer.qkv, layer.o, layer.gate_up, layer.down]
    layers.append(model.lm_head)
    return [layer for layer in layers if isinstance(layer, Linear)]


def choose_row_kernels(model_or_linears: Any, mode: str | None = None) -> list[dict]:
    """Time and set `row_kernel` on the eligible layers (plain, CUDA, bf16 / fp16 weights); the report.

    mode: one of MODES; None reads SPECMESH_ROW_KERNEL (default "auto")."""
    mode = mode if mode is not None else os.environ.get("SPECMESH_ROW_KERNEL", "auto")
    if mode not in MODES:
        raise ValueError(f"unknown row kernel mode {mode!r}; choose one of {', '.join(MODES)}")
    if isinstance(model_or_linears, Iterable):
        linears = [layer for layer in model_or_linears if isinstance(layer, Linear)]
    else:
        linears = model_linears(model_or_linears)
    eligible = [layer for layer in linears if _eligible(layer)]
    if mode == "off":
        return [_not_used("SPECMESH_ROW_KERNEL=off")]
    if not eligible:
        return [_not_used("no plain bf16/fp16 Linear layer on CUDA")]
    if not triton_available():
        return [_not_used("Triton is not installed")]
    groups: dict[tuple, list[Linear]] = {}
    for layer in eligible:
        assert layer.weight is not None  # `_eligible`
        groups.setdefault((layer.out_features, layer.in_features, layer.weight.dtype), []).append(layer)
    report = []
    for (out_features, in_features, dtype), layers in groups.items():
        entry: dict = {"shape": (out_features, in_features), "dtype": str(dtype).removeprefix("torch."),
                       "layers": len(layers), "chosen": None}
        started = time.perf_counter()
        try:
            _choose_shape(layers, mode, entry)
        except Exception as error:  # any failure keeps these layers on cuBLAS
            entry["chosen"] = None
            entry["reason"] = f"failed: {type(error).__name__}: {error}"[:300]
        entry["selection_s"] = round(time.perf_counter() - started, 3)
        report.append(entry)
    return report


def _eligible(layer: Linear) -> bool:
    weight = layer.weight
    return (layer.kernel == "plain" and weight is not None and weight.is_cuda and weight.dtype in ROW_DTYPES
            and weight.dim() == 2 and weight.stride(1) == 1)


def _not_used(reason: str) -> dict:
    return {"shape": None, "chosen": None, "reason": reason}


def _choose_shape(layers: Sequence[Linear], mode: str, entry: dict) -> None:
    """Measure one shape's candidates into `entry` and set the winner on `layers` (see the module doc)."""
    from specmesh.models import gemv_triton

    max_rows = gemv_triton.MAX_ROWS
    weights = [layer._plain_weight() for layer in layers]
    biases = [layer.bias for layer in layers]
    first = weights[0]
    generator = torch.Generator(device=first.device).manual_seed(0)
    x = torch.randn(max_rows, first.shape[1], generator=generator, device=first.device).to(first.dtype)
    calls = _calls_per_group(first)

    def cublas(i: int, rows: int) -> torch.Tensor:
        return F.linear(x[:rows], weights[i % len(weights)], biases[i % len(biases)])

    entry["cublas_us"] = {rows: time_us(cublas, rows, calls) for rows in (1, max_rows)}
    want = cublas(0, max_rows).float()
    candidates: list[dict] = []
    for config in gemv_triton.CANDIDATES:
        result: dict = {"config": tuple(config)}
        candidates.append(result)

        def rows_kernel(i: int, rows: int, config=config) -> torch.Tensor:
            return gemv_triton.linear_rows(x[:rows], weights[i % len(weights)], biases[i % len(biases)], config)

        try:
            got = rows_kernel(0, max_rows)
            problem = _check(got, rows_kernel(0, 1), want)
            if problem:
                result["error"] = problem
                continue
            result["us"] = {rows: time_us(rows_kernel, rows, calls) for rows in (1, max_rows)}
        except Exception as error:  # a config that does not compile or run is skipped
            result["error"] = f"{type(error).__name__}: {error}"[:200]
    entry["candidates"] = candidates
    timed = [c for c in candidates if "us" in c]
    if mode == "auto":
        limit = entry["cublas_us"][max_rows] * (1 + MAX_ROWS_MARGIN)
        timed = [c for c in timed if c["us"][max_rows] <= limit]
    if not timed:
        entry["reason"] = ("no candidate ran correctly" if mode == "on"
                           else f"no candidate within {MAX_ROWS_MARGIN:.0%} of cuBLAS at {max_rows} rows")
        return
    best = min(timed, key=lambda c: c["us"][1])
    if mode == "auto" and best["us"][1] > entry["cublas_us"][1] * (1 - ONE_ROW_MARGIN):
        entry["reason"] = "cuBLAS is faster at 1 row"
        return
    config = gemv_triton.RowConfig(*best["config"])
    kernel = RowKernel(run=lambda x, weight, bias: gemv_triton.linear_rows(x, weight, bias, config), max_rows=max_rows,
                       config=config)
    for layer in layers:
        layer.row_kernel = kernel
    entry["chosen"] = tuple(config)
    entry["reason"] = "forced (SPECMESH_ROW_KERNEL=on)" if mode == "on" else "faster than cuBLAS at 1 row"


def _check(got: torch.Tensor, got_one_row: torch.Tensor, want: torch.Tensor) -> str | None:
    """Why a candidate's output is wrong, or None: close to F.linear's within bf16 / fp16 rounding, and its
    row 0 the same bits alone as among MAX_ROWS rows."""
    error = (got.float() - want).abs().max().item()
    scale = want.abs().max().item()
    if not error <= 2e-2 * scale + 1e-3:  # also catches NaN
        return f"max error {error:.3g} against F.linear (largest |value| {scale:.3g})"
    if not torch.equal(got[:1], got_one_row):
        return "row 0 differs between a 1-row call and a MAX_ROWS-row call"
    return None


def _calls_per_group(weight: torch.Tensor) -> int:
    seconds = weight.numel() * weight.element_size() / ASSUMED_BYTES_PER_S
    return max(3, min(MAX_CALLS, int(GROUP_S / seconds)))


def time_us(run, rows: int, calls: int) -> float:
    """Median GPU time of one run(i, rows) call, i = 0, 1, ...: groups of `calls` queued behind a GPU sleep, so
    the host's launch cost stays outside the timed span (as in a replayed CUDA graph)."""
    run(0, rows)  # warm-up (compiles)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(NUM_GROUPS):
        torch.cuda._sleep(SLEEP_CYCLES_PER_CALL * calls)
        start.record()
        for i in range(calls):
            run(i, rows)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def format_report(report: Sequence[dict]) -> str:
    """One line per shape: the choice, why, and the 1-row / MAX_ROWS-row times of cuBLAS and the winner."""
    lines = []
    for entry in report:
        if entry.get("shape") is None:
            lines.append(f"row kernel not used: {entry['reason']}")
            continue
        out_features, in_features = entry["shape"]
        text = f"{in_features:>6} -> {out_features:<6} {entry['dtype']} x{entry['layers']}: "
        cublas = entry.get("cublas_us")
        if cublas:
            text += "cuBLAS " + " / ".join(f"{us:.1f}" for us in cublas.values()) + " us"
        chosen = entry.get("chosen")
        if chosen is not None:
            mine = next(c for c in entry["candidates"] if c["config"] == chosen)["us"]
            text += f", row kernel {chosen} " + " / ".join(f"{us:.1f}" for us in mine.values()) + " us"
        lines.append(f"{text} ({entry.get('reason', '')})")
    return "\n".join(lines)
