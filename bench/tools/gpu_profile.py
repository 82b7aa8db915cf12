"""Where one B=1 decode step's time goes: kernel time against wall time, and the top kernels.

    PYTHONPATH=. python3 bench/tools/gpu_profile.py [llama-3.2-1b]

The shape's random weights as bench/gpu.py builds them, the engine's default mode (CUDA graphs on a
GPU), a 32-token prompt, then 20 one-token steps under torch.profiler (which inflates the wall time;
the kernel time is per step). The kernels inside replayed graphs are listed one by one.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.gpu import make_config, random_prompt, random_weights  # noqa: E402
from specmesh.models.config import LlamaFamilyConfig  # noqa: E402
from specmesh.models.engine import SeqInput  # noqa: E402
from specmesh.models.linear import default_kernel  # noqa: E402
from specmesh.models.llama import LlamaFamilyModel  # noqa: E402
from specmesh.models.native_engine import NativeEngine  # noqa: E402

STEPS = 20


def device_us(event) -> float:
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)


def main() -> int:
    shape = sys.argv[1] if len(sys.argv) > 1 else "llama-3.2-1b"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = make_config(shape)
    model = LlamaFamilyModel(LlamaFamilyConfig.from_hf(config), dict(random_weights(config, device, dtype)), dtype, device,
                             default_kernel(dtype, device))
    engine = NativeEngine(model, max_kv_tokens=4096)
    seq = engine.new_sequence()
    prompt = random_prompt(engine.vocab_size, seed=0)
    engine.forward([SeqInput(seq, prompt, [len(prompt) - 1])])

    def step():
        engine.forward([SeqInput(seq, [5], [0])])[0].argmax().item()

    for _ in range(5):
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(STEPS):
            step()
        wall = (time.perf_counter() - start) / STEPS * 1e3
    events = [e for e in prof.key_averages() if "CUDA" in str(getattr(e, "device_type", ""))]
    print(f"{shape}: wall {wall:.3f} ms/step (profiled), kernels {sum(device_us(e) for e in events) / STEPS / 1e3:.3f} "
          f"ms/step, {sum(e.count for e in events) / STEPS:.0f} kernels/step")
    for e in sorted(events, key=lambda e: -device_us(e))[:14]:
        print(f"  {device_us(e) / STEPS:8.1f} us/step {e.count // STEPS:4d}x  {e.key[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
