"""Low-bit weights: GGUF blocks read as they are, HF checkpoints quantized, one fused CPU kernel.

qweight.py   QuantWeight: codes + scales (+ offsets) in the two layouts the kernel reads
blocks.py    ggml Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K rows <-> QuantWeight; kquants.py writes K-quant blocks
gguf_file.py a GGUF's tensors under Hugging Face names (q/k rows unpermuted)
quantize.py  `quantize="int8" | "int4" | "q4_k" | ...` for any Llama-family checkpoint
kernel.cpp   the fused dequantize-matmul (batch-invariant by construction); kernel.py builds and calls it
qlinear.py   QuantLinear, the layer the native forward uses
"""
