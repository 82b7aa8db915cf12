"""A quantized target behind the Verify service (`--quantize`): n-gram speculative decoding over the
wire equals that quantized target's own plain decoding in-process (the low-bit layers are
batch-invariant, so verifying k + 1 tokens at once changes nothing)."""

from __future__ import annotations

import asyncio

import pytest

from draft_service.options import DraftOptions
from draft_service.server import create_server as create_draft
from servicekit.background import BackgroundServices
from servicekit.wire_loop import wire_generation
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.speculative import generate
from specmesh.decoding.verifier import TargetVerifier
from specmesh.models.load import load_engine
from target_service.options import VerifyOptions
from target_service.server import create_server as create_verify

PROMPT = [5, 17, 33, 5, 17, 33, 5, 17, 33, 5, 17]


@pytest.mark.parametrize("quantize", ["int8", "q4_1"])
def test_quantized_target_over_the_wire_equals_its_plain_decoding(tiny_model_dir, quantize):
    target = str(tiny_model_dir("llama", init_std=0.2))
    params = SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=30)
    plain = generate(TargetVerifier(load_engine(target, dtype="float32", quantize=quantize)), None, PROMPT, params)
    with BackgroundServices() as services:
        verify = services.start(create_verify(VerifyOptions(model=target, dtype="float32", quantize=quantize, port=0)))
        draft = services.start(create_draft(DraftOptions(model=target, drafter="ngram", ngram_max_n=3, port=0)))
        wire = asyncio.run(asyncio.wait_for(wire_generation(f"127.0.0.1:{draft.port}", f"127.0.0.1:{verify.port}", PROMPT,
                                                            params, 4), 60))
    assert wire.token_ids == plain.token_ids
    assert wire.stats.num_draft_tokens > 0
