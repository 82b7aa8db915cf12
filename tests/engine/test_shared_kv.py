"""A KV cache shared with another process (`specmesh.kv.shared`): the target keeps writing where it
did, a mapping of it (here or in another process) reads the same rows, and a self-draft taking its
context from that mapping proposes exactly what one taking it from the engine does. Mappings of
another host, model or shape are refused."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys

import pytest
import torch

from specmesh.decoding.sampling import SamplingParams
from specmesh.drafters.model import ModelDrafter
from specmesh.kv.shared import attach, kv_tag, share_cache
from specmesh.models.engine import SeqInput
from specmesh.models.load import load_engine

PROMPT = [100, 7, 250, 31, 9, 60, 12, 200, 4, 4, 99, 1, 3, 17, 18, 19, 20, 21]  # > one block of 16


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama", init_std=0.2)


@pytest.fixture()
def shared_target(model_dir):
    target = load_engine(model_dir, dtype="float32")
    region, key = share_cache(target.cache, str(model_dir))
    return target, region, key


def _filled(target, prompt=PROMPT):
    seq = target.new_sequence()
    logits = target.forward([SeqInput(seq, prompt, logits_at=[len(prompt) - 1])])
    return seq, logits


def test_a_shared_cache_computes_what_a_private_one_does(model_dir, shared_target):
    target, _, _ = shared_target
    private = load_engine(model_dir, dtype="float32")
    (seq, shared_logits), (other, private_logits) = _filled(target), _filled(private)
    assert torch.equal(shared_logits[0], private_logits[0])
    step = [SeqInput(seq, [5], logits_at=[0])], [SeqInput(other, [5], logits_at=[0])]
    assert torch.equal(target.forward(step[0])[0], private.forward(step[1])[0])


def test_a_mapping_reads_the_targets_rows(model_dir, shared_target):
    target, region, key = shared_target
    seq, _ = _filled(target)
    mapped = attach(region, str(model_dir), target.cache.k.shape)
    assert mapped is not None
    blocks = target.cache.blocks.block_table(seq)
    mapped.set(7, blocks, len(PROMPT))
    slots = target.cache.slot_tensor(seq)
    assert torch.equal(mapped.slot_tensor(7, len(PROMPT)), slots)
    assert torch.equal(mapped.k[:, slots], target.cache.k[:, slots])
    assert torch.equal(mapped.v[:, slots], target.cache.v[:, slots])
    target.forward([SeqInput(seq, [42], logits_at=[0])])  # written after the mapping: seen through it
    last = target.cache.slot_tensor(seq)[-1]
    assert torch.equal(mapped.k[:, last], target.cache.k[:, last])
    with pytest.raises(ValueError, match="cannot hold"):
        mapped.set(7, blocks[:1], len(PROMPT))


def test_only_the_writers_tag_vouches_for_a_block_table(model_dir, shared_target):
    """The mapping reads the writer's key from the file; a tag made for another principal, other blocks or
    another length, or with another key, vouches for nothing."""
    target, region, key = shared_target
    mapped = attach(region, str(model_dir), target.cache.k.shape)
    assert mapped is not None and mapped.key == key and len(key) == 32
    tag = kv_tag(key, "alice", [3, 4], 20)
    assert mapped.vouched("alice", [3, 4], 20, tag)
    assert not mapped.vouched("bob", [3, 4], 20, tag)
    assert not mapped.vouched("alice", [3, 5], 20, tag)
    assert not mapped.vouched("alice", [3, 4], 21, tag)
    assert not mapped.vouched("alice", [3, 4], 20, kv_tag(bytes(32), "alice", [3, 4], 20))
    assert not mapped.vouched("alice", [3, 4], 20, b"")


def test_another_process_maps_the_same_memory(model_dir, shared_target):
    target, region, key = shared_target
    seq, _ = _filled(target)
    slot = int(target.cache.slot_tensor(seq)[3])
    code = (
        "import sys, torch\n"
        "from specmesh.kv.shared import KvRegion, attach\n"
        f"region = KvRegion(**{dataclasses.asdict(region)!r})\n"
        f"mapped = attach(region, {str(model_dir)!r}, torch.Size({list(region.shape)!r}))\n"
        f"print(repr(mapped.k[:, {slot}].sum().item()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert float(out) == target.cache.k[:, slot].sum().item()


def test_refused_where_it_cannot_serve(model_dir, tiny_model_dir, shared_target, caplog):
    target, region, key = shared_target
    shape = target.cache.k.shape
    caplog.set_level(logging.INFO, logger="specmesh.kv.shared")
    assert attach(dataclasses.replace(region, boot_id="another-host"), str(model_dir), shape) is None
    assert attach(region, str(tiny_model_dir("llama", init_std=0.3, num_layers=3)), shape) is None
    assert attach(region, str(model_dir), torch.Size([shape[0] + 1, *shape[1:]])) is None
    assert attach(dataclasses.replace(region, inode=region.inode + 1), str(model_dir), shape) is None
    assert attach(dataclasses.replace(region, pid=2**22 + 12345), str(model_dir), shape) is None
    assert "another host" in caplog.text and "this draft's" in caplog.text and "do not fit" in caplog.text


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=20),
                                    SamplingParams(temperature=0.8, top_k=0, seed=3, ignore_eos=True, max_new_tokens=20)],
                         ids=["greedy", "seeded"])
def test_a_draft_taking_the_mapping_proposes_what_one_taking_the_engine_does(model_dir, shared_target, params):
    target, region, key = shared_target
    seq, _ = _filled(target)
    mapped = attach(region, str(model_dir), target.cache.k.shape)
    assert mapped is not None
    mapped.set(1, target.cache.blocks.block_table(seq), len(PROMPT))
    drafts = []
    for source in (None, mapped):  # the engine itself (in-process), then the mapping (another process's view)
        engine = load_engine(model_dir, dtype="bfloat16")
        drafter = ModelDrafter(engine, kv_source=target)
        state = drafter.open(PROMPT)
        drafter.share_kv(state, 1 if source is mapped else seq, source)
        generator = torch.Generator().manual_seed(9)
        proposal = drafter.propose(state, [], 5, params, generator)
        assert engine.seq_len(state.seq_id) == len(PROMPT) + 4  # the prompt taken (but its last token), 5 fed
        drafts.append(proposal.token_ids)
    assert drafts[0] == drafts[1] and len(drafts[0]) == 5
