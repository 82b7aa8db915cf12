"""The in-one-sequence layout: forked branches packed into one attention row (engine.py: layouts).

Every check compares a group's logits with each member's sequence run alone; the members are forks
of one prefix, as Skeleton-of-Thought's branches are, with decode steps, verify chunks, trees and
rollbacks inside a member's own region.
"""

import pytest
import torch
from engine_helpers import random_ids, run_alone, with_sliding_window

from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.speculative import generate
from specmesh.decoding.verifier import TargetVerifier
from specmesh.models.engine import NO_PARENT, SeqInput
from specmesh.models.load import load_engine
from specmesh.models.native_engine import attention_rows

ATOL = 1e-9  # float64: only the summation order may differ


@pytest.fixture(scope="module", params=["qwen3", "mistral-window-6"])
def engine(request, tiny_model_dir, tmp_path_factory):
    if request.param == "qwen3":
        path = tiny_model_dir("qwen3")
    else:  # a sliding window shorter than these sequences: the window applies per member, by its own positions
        path = with_sliding_window(tiny_model_dir("mistral"), tmp_path_factory.mktemp("mistral-window"), 6)
    return load_engine(path, dtype="float64", max_kv_tokens=2048, block_size=4)


def fork_members(engine, prefix, num_members):
    root = engine.new_sequence()
    engine.forward([SeqInput(root, prefix, [len(prefix) - 1])])
    return root, [engine.fork(root) for _ in range(num_members)]


def test_group_of_forks_equals_each_member_alone(engine):
    prefix = random_ids(engine.vocab_size, 11, seed=1)  # 11 tokens: a partly filled shared block (block size 4)
    root, members = fork_members(engine, prefix, 3)
    tails = [random_ids(engine.vocab_size, n, seed=10 + n) for n in (5, 1, 3)]
    got = engine.forward([SeqInput(m, tail, list(range(len(tail))), group=root) for m, tail in zip(members, tails)])
    for logits, tail in zip(got, tails):
        torch.testing.assert_close(logits, run_alone(engine, prefix + tail, [11, len(tail)])[11:], atol=ATOL, rtol=0)
    for seq in [root, *members]:
        engine.free(seq)


def test_rollback_inside_a_region_leaves_prefix_and_siblings_intact(engine):
    prefix = random_ids(engine.vocab_size, 9, seed=2)
    root, (a, b) = fork_members(engine, prefix, 2)
    a_tokens = random_ids(engine.vocab_size, 12, seed=3)
    b_tokens = random_ids(engine.vocab_size, 12, seed=4)
    rejected = random_ids(engine.vocab_size, 4, seed=5)
    # round 1: a verifies 4 tokens, b decodes its first 3; round 2: a's draft is wrong, rolled back in its region
    engine.forward([SeqInput(a, a_tokens[:4], [0], group=root), SeqInput(b, b_tokens[:3], [0], group=root)])
    engine.forward([SeqInput(a, rejected, [0], group=root), SeqInput(b, b_tokens[3:6], [0], group=root)])
    engine.truncate(a, 9 + 4)
    assert engine.seq_len(b) == 9 + 6
    # round 3: a member with a tree draft beside a plain chain, then the chain continued after keep_tree_path
    tree = [a_tokens[4], rejected[0], a_tokens[5]]
    parents = [NO_PARENT, NO_PARENT, 0]
    got_a, got_b = engine.forward([SeqInput(a, tree, [0, 1, 2], parents=parents, group=root),
                                   SeqInput(b, b_tokens[6:12], list(range(6)), group=root)])
    alone_a = run_alone(engine, prefix + a_tokens[:6], [13, 2])
    torch.testing.assert_close(got_a[[0, 2]], alone_a[13:15], atol=ATOL, rtol=0)
    torch.testing.assert_close(got_b, run_alone(engine, prefix + b_tokens, [15, 6])[15:], atol=ATOL, rtol=0)
    engine.keep_tree_path(a, [0, 2])
    more = engine.forward([SeqInput(a, a_tokens[6:9], [0, 1, 2], group=root)])[0]  # a group of one
    torch.testing.assert_close(more, run_alone(engine, prefix + a_tokens[:9], [15, 3])[15:], atol=ATOL, rtol=0)
    for seq in (root, a, b):
        engine.free(seq)


def test_groups_and_plain_sequences_share_one_forward(engine):
    prefix_1, prefix_2 = random_ids(engine.vocab_size, 6, seed=6), random_ids(engine.vocab_size, 14, seed=7)
    root_1, members_1 = fork_members(engine, prefix_1, 2)
    root_2, members_2 = fork_members(engine, prefix_2, 2)
    lone = engine.new_sequence()
    lone_tokens = random_ids(engine.vocab_size, 5, seed=8)
    tails = [random_ids(engine.vocab_size, n, seed=20 + n) for n in (2, 3, 4, 1)]
    # interleaved: group 1, lone, group 2, group 1, group 2
    batch = [SeqInput(members_1[0], tails[0], [0, 1], group=root_1), SeqInput(lone, lone_tokens, [4]),
             SeqInput(members_2[0], tails[1], [2], group=root_2), SeqInput(members_1[1], tails[2], [3, 0], group=root_1),
             SeqInput(members_2[1], tails[3], [0], group=root_2)]
    assert attention_rows(batch) == [[0, 3], [1], [2, 4]]
    got = engine.forward(batch)
    torch.testing.assert_close(got[0], run_alone(engine, prefix_1 + tails[0], [6, 2])[6:], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1], run_alone(engine, lone_tokens, [5])[4:], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[2], run_alone(engine, prefix_2 + tails[1], [14, 3])[16:], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[3], run_alone(engine, prefix_1 + tails[2], [6, 4])[[9, 6]], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[4], run_alone(engine, prefix_2 + tails[3], [14, 1])[14:], atol=ATOL, rtol=0)
    for seq in [root_1, root_2, lone, *members_1, *members_2]:
        engine.free(seq)


def test_the_prefix_keys_are_read_once_per_group(engine, monkeypatch):
    prefix = random_ids(engine.vocab_size, 16, seed=9)
    root, members = fork_members(engine, prefix, 4)
    seen = {}
    original = engine._grouped_attention

    def spy(*args):
        attention = original(*args)
        seen["keys"] = attention.key_slots.shape
        return attention

    monkeypatch.setattr(engine, "_grouped_attention", spy)
    engine.forward([SeqInput(m, [5 + i, 6], [1], group=root) for i, m in enumerate(members)])
    assert seen["keys"] == (1, 16 + 4 * 2)  # one row: the prefix once, then four regions of 2 tokens
    for seq in [root, *members]:
        engine.free(seq)


@pytest.mark.parametrize("one_fork", [False, True], ids=["fork-each", "one-fork-per-child-appends"])
@pytest.mark.parametrize("one_sequence", [False, True], ids=["batching", "one_sequence"])
def test_forked_branches_verify_exactly_in_either_layout(tiny_model_dir, one_sequence, one_fork):
    """Skeleton-of-Thought's shape in-process: a parent prompt, children forked at a shared prefix with
    their own appended prompts, rounds of every child verified in one forward, half-wrong drafts (so
    regions roll back); each child's tokens equal greedy decoding of its full prompt alone."""
    engine = load_engine(tiny_model_dir("llama", init_std=0.2), dtype="float64", block_size=4)
    verifier = TargetVerifier(engine)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    prefix = random_ids(engine.vocab_size, 30, seed=40)
    parent = verifier.open(prefix + random_ids(engine.vocab_size, 3, seed=41), greedy, torch.Generator())
    appends = [random_ids(engine.vocab_size, n, seed=50 + n) for n in (4, 7, 2)]
    expected = [generate(TargetVerifier(engine), None, prefix + a, greedy).token_ids for a in appends]
    forwards_before = engine.stats.num_forwards
    if one_fork:  # every child's own tail, their first tokens from one forward
        children = verifier.fork(parent, [greedy] * 3, [torch.Generator() for _ in appends], num_prefix_tokens=30,
                                 one_sequence=one_sequence, child_appends=appends)
    else:
        children = [verifier.fork(parent, [greedy], [torch.Generator()], a, num_prefix_tokens=30, one_sequence=one_sequence)[0]
                    for a in appends]
    assert engine.stats.num_forwards - forwards_before == (1 if one_fork else 3)
    assert [c.group for c in children] == ([parent.seq_id] * 3 if one_sequence else [None] * 3)
    emitted = [[c.pending_token_id] for c in children]
    rows_before = engine.stats.num_attention_rows
    for round_index in range(8):
        proposals = []
        for i, tokens in enumerate(emitted):
            ahead = expected[i][len(tokens) : len(tokens) + 3]
            wrong_at = (round_index + i) % 3  # a draft right up to `wrong_at`, then one wrong token
            draft = ahead[:wrong_at] + [(ahead[wrong_at] + 1) % engine.vocab_size] if len(ahead) > wrong_at else ahead
            proposals.append(DraftProposal(token_ids=draft))
        for tokens, outcome in zip(emitted, verifier.verify_many(children, proposals)):
            tokens += outcome.token_ids
    rows = engine.stats.num_attention_rows - rows_before
    assert rows == (8 if one_sequence else 24)
    for tokens, reference in zip(emitted, expected):
        assert tokens == reference[: len(tokens)] and len(tokens) >= 12
    for session in [parent, *children]:
        verifier.close(session)


def test_a_low_bit_group_is_bit_identical_to_each_member_alone(tiny_model_dir):
    """The low-bit path's fixed-order attention visits a member's visible keys in key order, and the
    one-sequence row lists the prefix first, then the member's region: the same keys in the same
    order as the member alone, so its logits are equal to the last bit."""
    engine = load_engine(tiny_model_dir("llama", init_std=0.2), quantize="q8_0", block_size=4)
    if not engine.model.invariant_attention:
        pytest.skip("the low-bit kernels are not built here")
    prefix = random_ids(engine.vocab_size, 13, seed=60)
    root, members = fork_members(engine, prefix, 3)
    tails = [random_ids(engine.vocab_size, n, seed=61 + n) for n in (3, 1, 4)]
    got = engine.forward([SeqInput(m, tail, list(range(len(tail))), group=root) for m, tail in zip(members, tails)])
    for logits, tail in zip(got, tails):
        assert torch.equal(logits, run_alone(engine, prefix + tail, [13, len(tail)])[13:])
    for seq in [root, *members]:
        engine.free(seq)


@pytest.mark.parametrize("one_sequence", [False, True], ids=["batching", "one_sequence"])
def test_a_common_head_of_the_children_tails_is_prefilled_once(tiny_model_dir, one_sequence):
    """Point prompts share their instruction: a fork with per-child tails that begin alike feeds that
    head once (a trunk forward), then each child's own rest; every child still equals greedy decoding
    of its full prompt alone."""
    engine = load_engine(tiny_model_dir("llama", init_std=0.2), dtype="float64", block_size=4)
    verifier = TargetVerifier(engine)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)
    prefix = random_ids(engine.vocab_size, 21, seed=70)
    parent = verifier.open(prefix, greedy, torch.Generator())
    head = random_ids(engine.vocab_size, 12, seed=71)
    appends = [head + random_ids(engine.vocab_size, n, seed=72 + n) for n in (3, 1, 5)]
    before = (engine.stats.num_forwards, engine.stats.num_tokens_forwarded)
    children = verifier.fork(parent, [greedy] * 3, [torch.Generator() for _ in appends], num_prefix_tokens=21,
                             one_sequence=one_sequence, child_appends=appends)
    forwards, tokens = (a - b for a, b in zip((engine.stats.num_forwards, engine.stats.num_tokens_forwarded), before))
    assert forwards == 2 and tokens == 12 + (3 + 1 + 5)  # the head once, then each child its own rest
    for child, append in zip(children, appends):
        emitted = [child.pending_token_id]
        while len(emitted) < 10:
            emitted += verifier.verify(child, DraftProposal(token_ids=[])).token_ids
        assert emitted == generate(TargetVerifier(engine), None, prefix + append, greedy).token_ids
    for session in [parent, *children]:
        verifier.close(session)
    assert engine.kv_usage().free_blocks == engine.kv_usage().total_blocks  # the trunk's blocks went with its children
