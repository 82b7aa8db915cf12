#!/usr/bin/env bash
# One lent-GPU session's checks, in one call (the device allows a few minutes): the CUDA tests, then
# bench/gpu.py, then a profile of one B=1 step. Run from the repository root with the machine's own
# python3 (torch with CUDA):
#     OUT=/some/dir bash bench/tools/gpu_session.sh [bench/gpu.py arguments]
# Logs and results land in $OUT: tests.log, bench.log, profile.log, gpu-<device>.{md,json}.
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/tests.log"
timeout "${TESTS_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider tests/engine/test_step_graphs.py tests/engine/test_cuda_smoke.py 2>&1 \
    | tee -a "$OUT/tests.log" | tail -15
timeout "${BENCH_TIMEOUT:-330}" python3 bench/gpu.py --out "$OUT" "$@" > "$OUT/bench.log" 2>&1
echo "bench/gpu.py exit $?"; grep -v "^\s*$" "$OUT/bench.log" | tail -60
timeout "${PROFILE_TIMEOUT:-60}" python3 bench/tools/gpu_profile.py 2>&1 | grep -v USDT | tee "$OUT/profile.log"
