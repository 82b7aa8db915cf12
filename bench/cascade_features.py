"""Cost of the adaptive cascade's per-chunk work (budget for feature extraction: 0.3 ms per call).

    .venv/bin/python bench/cascade_features.py [--calls 20000] [--chunk-tokens 4 8 16]

Times, per call, on rigged token features (no model): `SessionFeatures.chunk` (feature extraction,
the window update included) and the whole decision `AdaptiveStopper.decide` (predictor forward,
shrinkage, dynamic programming) for a 3-stage cascade with an untrained predictor of the default
size. Prints the median and 99th percentile of per-call times, in microseconds.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specmesh.cascade.features import FeatureSchema, SessionFeatures  # noqa: E402
from specmesh.cascade.identity import StageIdentity  # noqa: E402
from specmesh.cascade.policy import AdaptiveStopper  # noqa: E402
from specmesh.cascade.predictor import AgreementPredictor  # noqa: E402
from specmesh.cascade.stage_model import TokenFeatures  # noqa: E402

BUDGET_US = 300.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--chunk-tokens", type=int, nargs="+", default=[4, 8, 16])
    args = parser.parse_args()
    rng = random.Random(0)
    schema = FeatureSchema(3)
    stages = [StageIdentity(f"stage{i}", str(i) * 64) for i in range(3)]
    stopper = AdaptiveStopper(AgreementPredictor(schema, stages), [0.3, 0.5, 1.0], lam=4.0)
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{args.calls} calls each")
    for n in args.chunk_tokens:
        chunks = [[TokenFeatures(rng.uniform(0, 4), rng.random(), -rng.uniform(0, 5)) for _ in range(n)] for _ in range(64)]
        session = SessionFeatures(schema, num_prompt_tokens=200)
        extract_us, decide_us = [], []
        for i in range(args.calls):
            chunk = chunks[i % len(chunks)]
            start = time.perf_counter()
            x = session.chunk(i % 2, chunk, num_draft_tokens=n, num_accepted=n // 2, num_generated_tokens=i)
            middle = time.perf_counter()
            stopper.decide(i % 2, x)
            end = time.perf_counter()
            extract_us.append((middle - start) * 1e6)
            decide_us.append((end - middle) * 1e6)
        median = statistics.median(extract_us)
        print(f"chunk of {n:>2} tokens: feature extraction median {median:.1f} us (p99 {percentile(extract_us, 0.99):.1f}), "
              f"{'within' if median < BUDGET_US else 'OVER'} the {BUDGET_US:.0f} us budget; "
              f"predictor + shrinkage + DP median {statistics.median(decide_us):.1f} us (p99 {percentile(decide_us, 0.99):.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
