"""Where one B=1 decode step's time goes: kernel time against wall time, and the top kernels.

    PYTHONPATH=. python3 bench/tools/gpu_profile.py [llama-3.2-1b] [--library]

The shape's random weights as bench/gpu.py builds them, the engine's default mode (CUDA graphs on a
GPU), a 32-token prompt, then 20 one-token steps under torch.profiler (which inflates the wall time;
the kernel time is per step). The kernels inside replayed graphs are listed one by one. The steps are
`engine.forward` and an argmax read back, one after the other; with --library, 20 rounds of the
library's plain decoding loop (`speculative_stream`, its steps launched ahead where the engine can).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.gpu import make_config, random_prompt, random_weights  # noqa: E402
from specmesh.decoding.sampling import SamplingParams  # noqa: E402
from specmesh.decoding.speculative import speculative_stream  # noqa: E402
from specmesh.decoding.verifier import TargetVerifier  # noqa: E402
from specmesh.models.config import LlamaFamilyConfig  # noqa: E402
from specmesh.models.engine import SeqInput  # noqa: E402
from specmesh.models.linear import default_kernel  # noqa: E402
from specmesh.models.llama import LlamaFamilyModel  # noqa: E402
from specmesh.models.native_engine import NativeEngine  # noqa: E402

STEPS = 20


def device_us(event) -> float:
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    library = "--library" in sys.argv[1:]
    shape = args[0] if args else "llama-3.2-1b"
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

    verifier = TargetVerifier(engine)
    params = SamplingParams(temperature=0.0, max_new_tokens=STEPS + 1, ignore_eos=True)

    def library_rounds():
        rounds = speculative_stream(verifier, None, prompt, params, eos_token_ids=())
        next(rounds)  # the prefill's token, before the clock
        return rounds

    for _ in range(5):
        step()
    if library:
        sum(1 for _ in library_rounds())
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    rounds = library_rounds() if library else None
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        if rounds is not None:
            assert sum(1 for _ in rounds) == STEPS
        else:
            for _ in range(STEPS):
                step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = (time.perf_counter() - start) / STEPS * 1e3
    if library:
        print(f"library loop, steps ahead {'on' if verifier.plain_ahead else 'off'}: {verifier.num_ahead_taken} launched "
              "forwards taken")
    events = [e for e in prof.key_averages() if "CUDA" in str(getattr(e, "device_type", ""))]
    print(f"{shape}: wall {wall:.3f} ms/step (profiled), kernels {sum(device_us(e) for e in events) / STEPS / 1e3:.3f} "
          f"ms/step, {sum(e.count for e in events) / STEPS:.0f} kernels/step")
    for e in sorted(events, key=lambda e: -device_us(e))[:14]:
        print(f"  {device_us(e) / STEPS:8.1f} us/step {e.count // STEPS:4d}x  {e.key[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
