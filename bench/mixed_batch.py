"""Mixed batches on the native engine: decode steps beside a draft or a prefill chunk, attended as one
padded batch (every sequence padded to the longest one's new tokens) or split (decode rows apart:
`NativeEngine.split_attention`), same process, same sequences, medians.

    .venv/bin/python bench/mixed_batch.py     # ~1 minute; writes bench/results/mixed_batch.{json,md}

Default model (SmolLM2-135M), float32, CPU, 2 torch threads; 16 sequences with 160 cached tokens each.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specmesh.models.engine import SeqInput  # noqa: E402
from specmesh.models.load import load_engine  # noqa: E402
from specmesh.models.resolve import resolve_model_spec  # noqa: E402

THREADS = 2
NUM_SEQUENCES = 16
CACHED = 160
REPEATS = 9
CASES = {  # name: new tokens of the first sequence (the other 15 decode one token each)
    "16 decode steps": 1,
    "15 decode + a draft of 4 (k + 1 = 5)": 5,
    "15 decode + a draft of 8": 9,
    "15 decode + a 64-token prefill chunk": 64,
    "15 decode + a 256-token prefill chunk": 256,
}


def forward_ms(engine, seqs: list[int], first: int) -> float:
    counts = [first] + [1] * (len(seqs) - 1)
    times = []
    for _ in range(REPEATS + 2):
        batch = [SeqInput(s, [7] * n, [n - 1]) for s, n in zip(seqs, counts)]
        start = time.perf_counter()
        engine.forward(batch)
        times.append((time.perf_counter() - start) * 1e3)
        for s, n in zip(seqs, counts):  # back to the same cache for the next repeat
            engine.truncate(s, engine.seq_len(s) - n)
    return statistics.median(times[2:])


def main() -> int:
    torch.set_num_threads(THREADS)
    engine = load_engine(str(resolve_model_spec("default")), dtype="float32")
    seqs = []
    for i in range(NUM_SEQUENCES):
        seq = engine.new_sequence()
        ids = [(i * 131 + j * 17) % 40000 + 100 for j in range(CACHED)]
        engine.forward([SeqInput(seq, ids, [CACHED - 1])])
        seqs.append(seq)
    rows = []
    for name, first in CASES.items():
        engine.split_attention = False
        padded = forward_ms(engine, seqs, first)
        engine.split_attention = True
        split = forward_ms(engine, seqs, first)
        rows.append({"case": name, "padded_ms": padded, "split_ms": split, "speedup": padded / split})
        print(f"  {name}: padded {padded:.1f} ms, split {split:.1f} ms ({padded / split:.2f}x)", flush=True)
    out = {"model": "default (SmolLM2-135M-Instruct)", "machine": platform.processor() or platform.machine(),
           "threads": THREADS, "rows": rows}
    results = ROOT / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "mixed_batch.json").write_text(json.dumps(out, indent=2))
    lines = ["# Mixed batches: one padded attention vs decode rows apart", "",
             f"`.venv/bin/python bench/mixed_batch.py`: model {out['model']}, float32, CPU ({out['machine']}), "
             f"{THREADS} torch threads, {NUM_SEQUENCES} sequences with {CACHED} cached tokens each; one forward, median "
             f"of {REPEATS}.", "",
             "| batch | padded ms | split ms | padded / split |", "|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['padded_ms']:.1f} | {r['split_ms']:.1f} | {r['speedup']:.2f}x |" for r in rows]
    (results / "mixed_batch.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
