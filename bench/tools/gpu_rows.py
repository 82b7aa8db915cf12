"""Does a verify forward give each row the logits one-token steps give? (DESIGN.md: batch invariance,
"up to float rounding at most".) On the GPU, for a random-weight shape in bf16:

    PYTHONPATH=. python3 bench/tools/gpu_rows.py [llama-3.2-1b]

A 32-token prompt, then the same 9 tokens fed as one chain (a verify forward: cuBLAS's many-row
products) and as 9 one-token steps (one-row products: the Triton kernel where `Linear` takes it, else
cuBLAS), both through the engine's CUDA graphs. Prints, with the one-row kernel on and off, the largest
logit difference and whether every row's argmax agrees.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.gpu import make_config, random_prompt, random_weights  # noqa: E402
from specmesh.models import linear  # noqa: E402
from specmesh.models.config import LlamaFamilyConfig  # noqa: E402
from specmesh.models.engine import SeqInput  # noqa: E402
from specmesh.models.llama import LlamaFamilyModel  # noqa: E402
from specmesh.models.native_engine import NativeEngine  # noqa: E402

CHAIN = 9


def compare(model, prompt: list[int]) -> str:
    engine = NativeEngine(model, max_kv_tokens=1024)  # its own graphs, captured under the current switch
    seq = engine.new_sequence()
    engine.forward([SeqInput(seq, prompt, [len(prompt) - 1])])
    start = engine.seq_len(seq)
    chain = prompt[:CHAIN]
    together = engine.forward([SeqInput(seq, chain, list(range(CHAIN)))])[0]
    engine.truncate(seq, start)
    apart = torch.cat([engine.forward([SeqInput(seq, [t], [0])])[0] for t in chain])
    diff = (together - apart).abs().max().item()
    agree = bool((together.argmax(-1) == apart.argmax(-1)).all())
    return f"max |logit difference| {diff:.3g}, argmax of every row agrees: {agree}, bit-identical: {torch.equal(together, apart)}"


def main() -> int:
    shape = sys.argv[1] if len(sys.argv) > 1 else "llama-3.2-1b"
    device = torch.device("cuda")
    config = make_config(shape)
    model = LlamaFamilyModel(LlamaFamilyConfig.from_hf(config), dict(random_weights(config, device, torch.bfloat16)),
                             torch.bfloat16, device, "plain")
    prompt = random_prompt(config.vocab_size, seed=0)
    for switch in (True, False):
        linear.ONE_ROW_KERNEL = switch
        print(f"{shape}, one-row kernel {'on' if switch else 'off'}: a {CHAIN}-token chain vs one-token steps: {compare(model, prompt)}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
