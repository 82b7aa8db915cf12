"""`make demo`: the most that works today, on the embedded default model (SmolLM2-135M-Instruct).

Stage 1 (foundation): resolve/convert the default model, load it with transformers and stream a
greedy answer to a chat prompt.
"""

from __future__ import annotations

import sys
import time

DEMO_PROMPT = "Give me three tips for writing clear code."


def main() -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

    from specmesh.models.resolve import resolve_model_spec

    folder = resolve_model_spec("default")
    print(f"model: SmolLM2-135M-Instruct from {folder}")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    messages = [{"role": "user", "content": DEMO_PROMPT}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")["input_ids"]
    print(f"\nuser: {DEMO_PROMPT}\nassistant: ", end="", flush=True)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=96, do_sample=False, streamer=streamer)
    elapsed_s = time.perf_counter() - start
    num_new = out.shape[1] - ids.shape[1]
    print(f"\n[{num_new} tokens in {elapsed_s:.2f} s: {num_new / elapsed_s:.1f} tokens/s, transformers generate, fp32]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
