#!/usr/bin/env bash
# One lent-GPU session's checks, in one call (the device allows a few minutes): the CUDA tests, then
# bench/gpu.py twice (graphs; the two runs show what holds run to run), then profiles of B=1 steps.
# Run from the repository root with the machine's own python3 (torch with CUDA):
#     OUT=/some/dir bash bench/tools/gpu_session.sh [bench/gpu.py arguments]
# Logs and results land in $OUT: tests.log, bench.log, profile.log, r1/ and r2/gpu-<device>.{md,json}.
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
SHAPES=${SHAPES:-llama-3.2-1b,llama-3.1-8b}
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch, transformers, triton, grpc; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, 'grpcio', grpc.__version__)"
} 2>&1 | tee "$OUT/tests.log"
timeout "${TESTS_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider tests/engine/test_step_graphs.py \
    tests/engine/test_cuda_smoke.py tests/engine/test_plain_ahead.py 2>&1 | tee -a "$OUT/tests.log" | tail -15
for run in r1 r2; do
    timeout "${BENCH_TIMEOUT:-210}" python3 bench/gpu.py --shapes "$SHAPES" --modes graphs --no-hf --runs 5 --out "$OUT/$run" "$@" \
        >> "$OUT/bench.log" 2>&1
    echo "bench/gpu.py ($run) exit $?"; grep -E "^\| (graphs|in-process|Run|Generate) " "$OUT/$run"/gpu-*.md
done
for shape in ${SHAPES//,/ }; do
    for loop in "" --library; do
        timeout "${PROFILE_TIMEOUT:-60}" python3 bench/tools/gpu_profile.py "$shape" $loop 2>&1 | grep -v -e USDT -e Warn -e _warn_once \
            | tee -a "$OUT/profile.log" | head -4
    done
done
