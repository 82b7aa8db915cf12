"""A KV cache shared with another process (`specmesh.kv.shared`): the target keeps writing where it
did, a mapping of it (here or in another process) reads the same rows, and a self-draft taking its
context from that mapping proposes exactly what one taking it from the engine does. Mappings of
another host, model or shape are refused, and so is a block table whose blocks went back to the
writer's pool since it was tagged: rows another session may hold now are never taken."""

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
    shared = share_cache(target.cache, str(model_dir))
    return target, shared.region, shared


def _set(mapped, key, blocks, length):
    """The table as the writer's epochs stand now (what a vouched tag gives)."""
    mapped.set(key, blocks, length, [mapped.epochs[b] for b in blocks])


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
    target, region, _ = shared_target
    seq, _ = _filled(target)
    mapped = attach(region, str(model_dir), target.cache.k.shape)
    assert mapped is not None
    blocks = target.cache.blocks.block_table(seq)
    _set(mapped, 7, blocks, len(PROMPT))
    slots = target.cache.slot_tensor(seq)
    assert torch.equal(mapped.slot_tensor(7, len(PROMPT)), slots)
    assert torch.equal(mapped.k[:, slots], target.cache.k[:, slots])
    assert torch.equal(mapped.v[:, slots], target.cache.v[:, slots])
    target.forward([SeqInput(seq, [42], logits_at=[0])])  # written after the mapping: seen through it
    last = target.cache.slot_tensor(seq)[-1]
    assert torch.equal(mapped.k[:, last], target.cache.k[:, last])
    with pytest.raises(ValueError, match="cannot hold"):
        _set(mapped, 7, blocks[:1], len(PROMPT))


def test_only_the_writers_tag_vouches_for_a_block_table(model_dir, shared_target):
    """The mapping reads the writer's key from the file; a tag made for another principal, other blocks, other
    epochs or another length, or with another key, vouches for nothing."""
    target, region, shared = shared_target
    mapped = attach(region, str(model_dir), target.cache.k.shape)
    assert mapped is not None and mapped.key == shared.key and len(shared.key) == 32
    tag = shared.tag("alice", [3, 4], 20)
    assert tag == kv_tag(shared.key, "alice", [3, 4], [0, 0], 20)  # no block released yet
    assert mapped.vouch("alice", [3, 4], 20, tag) == [0, 0]
    assert mapped.vouch("bob", [3, 4], 20, tag) is None
    assert mapped.vouch("alice", [3, 5], 20, tag) is None
    assert mapped.vouch("alice", [3, 4], 21, tag) is None
    assert mapped.vouch("alice", [3, 4], 20, kv_tag(shared.key, "alice", [3, 4], [0, 1], 20)) is None
    assert mapped.vouch("alice", [3, 4], 20, kv_tag(bytes(32), "alice", [3, 4], [0, 0], 20)) is None
    assert mapped.vouch("alice", [3, 4], 20, b"") is None
    with pytest.raises(ValueError, match="outside"):
        mapped.vouch("alice", [3, 10**6], 20, tag)


def test_a_table_whose_blocks_were_released_gives_nothing(model_dir, shared_target):
    """Alice's session ends and Bob's takes its blocks: Alice's tag, genuine when it was made, no longer
    vouches, and a table vouched for before the release has no positions left to take."""
    target, region, shared = shared_target
    mapped = attach(region, str(model_dir), target.cache.k.shape)
    assert mapped is not None
    seq, _ = _filled(target)
    blocks = target.cache.blocks.block_table(seq)
    tag = shared.tag("alice", blocks, len(PROMPT))
    epochs = mapped.vouch("alice", blocks, len(PROMPT), tag)
    assert epochs is not None
    mapped.set(1, blocks, len(PROMPT), epochs)
    assert mapped.intact(1) and mapped.seq_len(1) == len(PROMPT)
    target.free(seq)
    other, _ = _filled(target, [5, 6, 7] * 7)
    assert set(target.cache.blocks.block_table(other)) & set(blocks)  # Bob's rows where Alice's were
    assert mapped.vouch("alice", blocks, len(PROMPT), tag) is None
    assert not mapped.intact(1) and mapped.seq_len(1) == 0
    assert mapped.vouch("bob", target.cache.blocks.block_table(other), 21,
                        shared.tag("bob", target.cache.blocks.block_table(other), 21)) is not None


def test_rows_copied_while_their_block_was_released_are_dropped(model_dir, shared_target):
    """The session's blocks go back to the writer's pool while a draft copies from them: the copy is
    taken back, and the draft feeds its context instead (it proposes what a draft that never shared does)."""
    target, region, _ = shared_target
    mapped = attach(region, str(model_dir), target.cache.k.shape)
    assert mapped is not None
    seq, _ = _filled(target)
    _set(mapped, 1, target.cache.blocks.block_table(seq), len(PROMPT))
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=20)
    drafts = []
    for shares in (False, True):
        engine = load_engine(model_dir, dtype="bfloat16")
        drafter = ModelDrafter(engine)
        state = drafter.open(PROMPT)
        if shares:
            drafter.share_kv(state, 1, mapped)
            copy = engine.import_kv

            def import_then_release(*args, copy=copy):
                copy(*args)
                target.free(seq)  # (as a session closed by its Verify service meanwhile)

            engine.import_kv = import_then_release
        drafts.append(drafter.propose(state, [], 5, params, torch.Generator().manual_seed(9)).token_ids)
        assert drafter.kv_taken == 0 and engine.seq_len(state.seq_id) == len(PROMPT) + 4  # all fed
    assert drafts[0] == drafts[1]


def test_another_process_maps_the_same_memory(model_dir, shared_target):
    target, region, _ = shared_target
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
    target, region, _ = shared_target
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
    target, region, _ = shared_target
    seq, _ = _filled(target)
    mapped = attach(region, str(model_dir), target.cache.k.shape)
    assert mapped is not None
    _set(mapped, 1, target.cache.blocks.block_table(seq), len(PROMPT))
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


def test_a_mapping_knows_when_its_writer_is_gone(model_dir, shared_target):
    """While the writer holds the file, its descriptor names it; once the writer exits (here: a descriptor
    naming another file, or none), the mapping says so and its reader can drop it."""
    target, region, _ = shared_target
    mapped = attach(region, str(model_dir), target.cache.k.shape)
    assert mapped is not None and mapped.writer_alive()
    mapped.region = dataclasses.replace(region, inode=region.inode + 1)
    assert not mapped.writer_alive()
    mapped.region = dataclasses.replace(region, pid=2**22 + 12345)
    assert not mapped.writer_alive()
