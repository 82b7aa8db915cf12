"""Skeleton-of-Thought through the live cluster (in-process Verify, Draft and Coordinator services on
loopback, tiny random model): a streamed plan, >= 3 branches forked from the plan's session and
decoded side by side, the merged answer; every output compared token for token with target-only
decoding in-process (float64 engine).

What is forced: the tiny random model writes no useful plan on its own (it tends to pick [DIRECT]),
so the requests force the plan's start with `skeleton_prefix` (three points); the model writes the
rest under the grammar (more points or [END], then EOS). The tiny model's context is raised from 512
to 4096 positions (RoPE: nothing is learned per position), since the skeleton prompt alone is ~620
tokens with the tiny tokenizer.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import grpc
import pytest
from test_coordinator import Cluster  # the same module object pytest collected (tests/ is no package)

from servicekit.channels import open_channel as channel
from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.speculative import generate
from specmesh.decoding.verifier import TargetVerifier
from specmesh.models.chat import chat_messages_ids
from specmesh.models.engine import SeqInput
from specmesh.models.load import load_engine
from specmesh.proto.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, verify_pb2, verify_pb2_grpc
from specmesh.skeleton.automaton import DEAD_STATE, SkeletonFormat
from specmesh.skeleton.grammar import SkeletonGrammar
from specmesh.skeleton.merge import merge, section_header
from specmesh.skeleton.parse import parse_skeleton
from specmesh.skeleton.prompts import point_messages, skeleton_messages
from specmesh.skeleton.tools import PassageIndex, passages_for
from specmesh.skeleton.types import Skeleton
from target_service.grammars import GrammarConstraint

TIMEOUT_S = 60
QUESTION = "What are some tips for better sleep?"
FORCED_PLAN = "[PLAN]\n1.<12><None>[-]Sleep\n2.<12><None>[-]Food\n3.<12><None>[1]Move\n"  # the model goes on
FORMAT = SkeletonFormat(max_points=8)  # the coordinator's default skeleton_max_points


@pytest.fixture(scope="module")
def target(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("skeleton") / "tiny-llama-4k"
    shutil.copytree(tiny_model_dir("llama", init_std=0.2), folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 4096
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture(scope="module")
def tokenizer(target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target)


@pytest.fixture(scope="module")
def engine(target):
    """The in-process reference: target-only decoding on a float64 engine."""
    return load_engine(target, dtype="float64")


@pytest.fixture(scope="module")
def cluster(target):
    with Cluster(target) as c:
        yield c


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


def _request(prefix: str = FORCED_PLAN, layout: int = common_pb2.BRANCH_LAYOUT_UNSPECIFIED,
             **sampling) -> coordinator_pb2.GenerateRequest:
    sampling = {"temperature": 0.0, "max_new_tokens": 20, **sampling}
    return coordinator_pb2.GenerateRequest(prompt=QUESTION, mode=coordinator_pb2.GENERATION_MODE_SKELETON, drafter="ngram",
                                           skeleton_prefix=prefix, max_parallel=4, sampling=common_pb2.SamplingParams(**sampling),
                                           skeleton_layout=layout)


async def _stream(address: str, request) -> list[coordinator_pb2.GenerateResponse]:
    async with channel(address) as ch:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        return [r async for r in stub.Generate(request, timeout=TIMEOUT_S)]


def _by_branch(responses) -> dict[int, list[coordinator_pb2.GenerateResponse]]:
    branches: dict[int, list] = {}
    for response in responses:
        branches.setdefault(response.branch_id, []).append(response)
    return branches


def constrained_greedy(engine, grammar: SkeletonGrammar, prompt_ids: list[int], state: int) -> list[int]:
    """Target-only greedy decoding under the grammar, one token per forward, until EOS."""
    seq_id, feed, out = engine.new_sequence(), list(prompt_ids), []
    try:
        while not out or out[-1] not in grammar.eos_token_ids:
            logits = engine.forward([SeqInput(seq_id, feed, [len(feed) - 1])])[0]  # [1, vocab]
            token = int(grammar.constrain_logits(logits, [state]).argmax())
            state = grammar.advance(state, token)
            out.append(token)
            feed = [token]
    finally:
        engine.free(seq_id)
    return out


def _plan_texts(branches, tokenizer) -> tuple[str, list[int]]:
    """The plan's text as streamed, checked against its tokens; and the tokens the model wrote."""
    plan = branches[0]
    text = "".join(r.text for r in plan)
    assert text == tokenizer.decode([t for r in plan for t in r.token_ids], skip_special_tokens=True,
                                    clean_up_tokenization_spaces=False)
    return text, [t for r in plan[1:] for t in r.token_ids]  # plan[0] is the forced prefix


def _branch_text(messages) -> str:
    return "".join(r.text for r in messages[1:])  # messages[0] is the header line


LAYOUTS = {"batching": common_pb2.BRANCH_LAYOUT_BATCHING, "one_sequence": common_pb2.BRANCH_LAYOUT_ONE_SEQUENCE}
BRANCH_TOKENS: dict[str, dict[int, list[int]]] = {}  # layout -> point id -> the branch's tokens (the layouts compared)


def _engine_counters(engine) -> tuple[int, ...]:
    s = engine.stats
    return s.num_forwards, s.num_sequences_forwarded, s.num_tokens_forwarded, s.num_attention_rows


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_skeleton_answer_streams_forked_branches_each_exact(cluster, tokenizer, engine, layout):
    verify_engine = cluster.verify[0].servicer.engine
    before = _engine_counters(verify_engine)
    responses = _run(_stream(cluster.address, _request(layout=LAYOUTS[layout])))
    branches = _by_branch(responses)

    # the plan: the forced prefix, then what the model wrote = constrained target-only greedy decoding
    skeleton_text, plan_ids = _plan_texts(branches, tokenizer)
    prefix_ids = tokenizer.encode(FORCED_PLAN, add_special_tokens=False)
    assert list(branches[0][0].token_ids) == prefix_ids
    grammar = SkeletonGrammar(tokenizer, max_points=FORMAT.max_points, vocab_size=engine.vocab_size,
                              eos_token_ids=engine.eos_token_ids)
    plan_prompt = chat_messages_ids(tokenizer, skeleton_messages(QUESTION, FORMAT)) + prefix_ids
    assert plan_ids == constrained_greedy(engine, grammar, plan_prompt, grammar.walk(grammar.initial_state(), prefix_ids)[-1])
    assert branches[0][-1].finish_reason == common_pb2.FINISH_REASON_EOS
    skeleton = parse_skeleton(skeleton_text, FORMAT.max_points)
    assert isinstance(skeleton, Skeleton) and len(skeleton.points) >= 3

    # every point streamed as its own branch: header, tokens, a last message with stats
    assert set(branches) == {-1, 0, *(p.id for p in skeleton.points)}
    texts = {p.id: _branch_text(branches[p.id]) for p in skeleton.points}
    params = SamplingParams(temperature=0.0, max_new_tokens=20)
    num_branch_prompt_tokens = 0
    for point in skeleton.points:
        messages = branches[point.id]
        assert messages[0].text == section_header(point) + "\n" and not messages[0].token_ids
        assert messages[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED and not messages[-1].error_message
        tokens = [t for r in messages for t in r.token_ids]
        assert messages[-1].stats.num_generated_tokens == len(tokens)
        # exact: target-only greedy decoding of the branch's whole prompt (the point conversation)
        dependencies = [(skeleton.point(d), texts[d]) for d in point.deps]
        prompt = chat_messages_ids(tokenizer, point_messages(QUESTION, skeleton_text, point, dependencies, (), FORMAT))
        num_branch_prompt_tokens += len(prompt)
        assert tokens == generate(TargetVerifier(engine), None, prompt, params).token_ids, f"point {point.id}"
        BRANCH_TOKENS.setdefault(layout, {})[point.id] = tokens

    # the answer: merged in plan order, with the request's stats
    answer = branches[-1]
    assert len(answer) == 1 and answer[0].text == merge(skeleton, texts)
    summary = answer[0].skeleton
    assert [b.point_id for b in summary.branches] == [p.id for p in skeleton.points]
    assert [b.num_tokens for b in summary.branches] == [len([t for r in branches[p.id] for t in r.token_ids])
                                                        for p in skeleton.points]
    assert summary.num_prefilled_branches == 0 and summary.route_reason == "requested" and not summary.direct_reason
    assert summary.layout == LAYOUTS[layout]
    # the siblings' rounds left the coordinator as VerifyBatch RPCs, most of them
    # the branches launched together (the independent points) forked in one Fork RPC
    assert summary.num_fork_rpcs < len(skeleton.points)
    longest = max(b.num_rounds for b in summary.branches)
    assert summary.num_verify_batches >= longest // 2 and summary.num_batched_rounds >= 2 * summary.num_verify_batches
    assert summary.num_skeleton_tokens == len(plan_ids) and 0 < summary.skeleton_ms < summary.total_ms
    assert answer[0].stats.num_generated_tokens == len(plan_ids) + sum(b.num_tokens for b in summary.branches)
    assert answer[0].stats.plan == "skeleton"

    # forked, not prefilled again: the engine fed fewer tokens in all than the branch prompts hold;
    # and the branches' rounds shared forwards: as rows of a batch, or as regions of one attention row
    forwards, sequences, tokens_fed, rows = (a - b for a, b in zip(_engine_counters(verify_engine), before))
    assert tokens_fed < num_branch_prompt_tokens
    assert sequences / forwards > 1.2, f"{sequences} sequences in {forwards} forwards: the branches did not batch"
    if layout == "one_sequence":
        assert rows / forwards < 1.05 < sequences / forwards, f"{sequences} sequences in {rows} rows: not one sequence"
    else:
        assert rows == sequences
    # the two layouts give identical branches
    if len(BRANCH_TOKENS) == len(LAYOUTS):
        assert BRANCH_TOKENS["one_sequence"] == BRANCH_TOKENS["batching"]
    _assert_sessions_closed(cluster)


def _assert_sessions_closed(cluster) -> None:
    """Every Verify session of the request (the plan's, each branch's) is closed soon after its end."""
    deadline = time.monotonic() + 5.0
    while cluster.verify[0].servicer.num_sessions and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cluster.verify[0].servicer.num_sessions == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_seeded_sampled_branches_equal_the_in_process_runs(cluster, tokenizer, engine, layout):
    """The whole plan forced (only EOS is left to write): each branch samples with seed + point id,
    which equals plain seeded sampling of its prompt (n-gram drafts are deterministic)."""
    plan = FORCED_PLAN + "[END]"
    responses = _run(_stream(cluster.address, _request(plan, LAYOUTS[layout], temperature=1.0, seed=11, max_new_tokens=12)))
    branches = _by_branch(responses)
    skeleton_text, plan_ids = _plan_texts(branches, tokenizer)
    assert plan_ids == list(engine.eos_token_ids[:1]) and skeleton_text == plan
    skeleton = parse_skeleton(skeleton_text)
    assert isinstance(skeleton, Skeleton)
    texts = {p.id: _branch_text(branches[p.id]) for p in skeleton.points}
    for point in skeleton.points:
        dependencies = [(skeleton.point(d), texts[d]) for d in point.deps]
        prompt = chat_messages_ids(tokenizer, point_messages(QUESTION, skeleton_text, point, dependencies, (), FORMAT))
        params = SamplingParams(temperature=1.0, seed=11 + point.id, max_new_tokens=12)
        tokens = [t for r in branches[point.id] for t in r.token_ids]
        assert tokens == generate(TargetVerifier(engine), None, prompt, params).token_ids, f"point {point.id}"
    assert branches[-1][-1].text == merge(skeleton, texts)
    _assert_sessions_closed(cluster)


def test_a_search_point_gets_passages_from_the_documents(cluster, tokenizer, engine):
    """A <Search> point's prompt carries the BM25 passages of the request's documents."""
    plan = "[PLAN]\n1.<8><Search>[-]Dark bedroom\n2.<8><None>[-]Food\n3.<8><None>[-]Move\n[END]"
    documents = ["Keep the bedroom cool and dark at night.\n\nBread is baked from flour and water."]
    request = _request(plan, max_new_tokens=8)
    request.documents.extend(documents)
    branches = _by_branch(_run(_stream(cluster.address, request)))
    skeleton = parse_skeleton(plan)
    assert isinstance(skeleton, Skeleton)
    index = PassageIndex(documents)
    for point in skeleton.points:
        passages = [p.text for p in passages_for(point, QUESTION, index)]
        assert bool(passages) == (point.id == 1) and all("Bread" not in p for p in passages)
        prompt = chat_messages_ids(tokenizer, point_messages(QUESTION, plan, point, (), passages, FORMAT))
        expected = generate(TargetVerifier(engine), None, prompt, SamplingParams(temperature=0.0, max_new_tokens=8)).token_ids
        assert [t for r in branches[point.id] for t in r.token_ids] == expected, f"point {point.id}"


def test_grammar_row_states_of_chain_and_tree_drafts():
    """The worked example of target_service/grammars.py on a toy vocabulary of single characters."""
    vocabulary = [None, *(bytes([b]) for b in range(1, 128))]  # id = the byte; 0 = EOS
    grammar = SkeletonGrammar.from_token_bytes(vocabulary, eos_token_ids=[0])
    s = grammar.walk(grammar.initial_state(), list(b"[PLAN]\n1."))[-1]
    a, b, c = ord("<"), ord("7"), ord("x")  # after "1." only "<" continues; "x" is refused anywhere here
    constraint = GrammarConstraint(grammar, s)
    sa = grammar.advance(s, a)
    assert constraint.row_states(DraftProposal(token_ids=[a, b])) == [s, sa, grammar.advance(sa, b)]
    tree = DraftProposal(token_ids=[a, b, c], parents=[-1, 0, 0])
    assert constraint.row_states(tree) == [s, sa, grammar.advance(sa, b), DEAD_STATE]
    assert constraint.row_states(DraftProposal(token_ids=[c, a])) == [s, DEAD_STATE, DEAD_STATE]
    constraint.commit([a, b])
    assert constraint.state == grammar.advance(sa, b)


def test_a_direct_plan_answers_the_question_plainly(cluster, tokenizer, engine):
    """[DIRECT] forced: the model writes the reason and [END]; the answer is plain decoding of the
    request's own prompt, on the main stream."""
    responses = _run(_stream(cluster.address, _request("[DIRECT]", max_new_tokens=16, ignore_eos=True)))
    branches = _by_branch(responses)
    assert set(branches) == {-1, 0}
    answer = branches[-1]
    expected = generate(TargetVerifier(engine), None, tokenizer.encode(QUESTION, add_special_tokens=False),
                        SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)).token_ids
    assert [t for r in answer for t in r.token_ids] == expected
    assert answer[-1].skeleton.direct_reason == "the model chose to answer directly"
    assert answer[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH and not answer[-1].skeleton.branches


def test_a_plan_that_repeats_its_points_is_answered_plainly(cluster, tokenizer, engine):
    """A plan whose points repeat (what the embedded model wrote for sleep tips) would lose to a plain
    answer: no branch runs, the request's own prompt is decoded plainly on the main stream, and the
    skeleton stats say why."""
    plan = "[PLAN]\n1.<40><None>[-]Dark room\n2.<40><None>[1]dark room.\n[END]"
    responses = _run(_stream(cluster.address, _request(plan, max_new_tokens=16, ignore_eos=True)))
    branches = _by_branch(responses)
    assert set(branches) == {-1, 0}
    expected = generate(TargetVerifier(engine), None, tokenizer.encode(QUESTION, add_special_tokens=False),
                        SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)).token_ids
    assert [t for r in branches[-1] for t in r.token_ids] == expected
    assert branches[-1][-1].skeleton.direct_reason == 'plan rejected, repeated points: 1 and 2 ("dark room")'


def test_a_forced_prefix_outside_the_grammar_is_invalid(cluster):
    with pytest.raises(grpc.aio.AioRpcError) as error:
        _run(_stream(cluster.address, _request("Sure! Here is a plan")))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_constrained_verify_session_steps_with_the_fused_drafter(cluster, tokenizer, engine):
    """The Verify service alone: OpenSession with the constraint, then fused Step rounds (n-gram
    drafts, masked target rows) until EOS; equals constrained target-only decoding."""
    prefix_ids = tokenizer.encode("[PLAN]\n", add_special_tokens=False)
    prompt = chat_messages_ids(tokenizer, skeleton_messages(QUESTION, FORMAT)) + prefix_ids
    fmt = SkeletonFormat(max_points=3, max_title_bytes=12)
    grammar = SkeletonGrammar(tokenizer, max_points=3, max_title_bytes=12, vocab_size=engine.vocab_size,
                              eos_token_ids=engine.eos_token_ids)

    async def main() -> list[int]:
        async with channel(f"127.0.0.1:{cluster.verify[0].port}") as ch:
            stub = verify_pb2_grpc.VerifyServiceStub(ch)
            opened = await stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(
                prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(temperature=0.0, max_new_tokens=grammar.max_tokens),
                skeleton=verify_pb2.SkeletonConstraint(max_points=fmt.max_points, max_title_bytes=fmt.max_title_bytes,
                                                       num_forced_tokens=len(prefix_ids))), timeout=TIMEOUT_S)
            tokens, finish = [opened.first_token_id], opened.finish_reason
            while not finish:
                step = await stub.Step(verify_pb2.StepRequest(session_id=opened.session_id, num_draft_tokens=4), timeout=TIMEOUT_S)
                tokens += step.result.accepted_token_ids
                finish = step.result.finish_reason
            await stub.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=opened.session_id), timeout=TIMEOUT_S)
            return tokens

    tokens = _run(main())
    expected = constrained_greedy(engine, grammar, prompt, grammar.walk(grammar.initial_state(), prefix_ids)[-1])
    assert tokens[:len(expected)] == expected  # a round may emit past EOS; the session ends at EOS
    assert isinstance(parse_skeleton(tokenizer.decode(prefix_ids + expected, skip_special_tokens=True)), Skeleton)


def test_bad_constraints_and_forks_are_invalid_arguments(cluster, tokenizer):
    prompt = tokenizer.encode("[PLAN]\n", add_special_tokens=False)

    async def code(call) -> grpc.StatusCode:
        try:
            await call
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    async def main() -> list[grpc.StatusCode]:
        async with channel(f"127.0.0.1:{cluster.verify[0].port}") as ch:
            stub = verify_pb2_grpc.VerifyServiceStub(ch)
            sampling = common_pb2.SamplingParams(temperature=0.0, max_new_tokens=8)

            def open_session(**constraint):
                return stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(
                    prompt_token_ids=prompt, sampling=sampling, skeleton=verify_pb2.SkeletonConstraint(**constraint)),
                    timeout=TIMEOUT_S)

            codes = [await code(open_session(max_points=1000)),  # past the service's skeleton_max_points
                     await code(open_session(num_forced_tokens=len(prompt) + 1)),
                     await code(open_session(num_forced_tokens=len(prompt) - 1))]  # "PLAN]\n..." is no plan start
            opened = await open_session(num_forced_tokens=len(prompt))
            parent = opened.session_id

            def fork(num_prefix_tokens: int, append: list[int]):
                return stub.Fork(verify_pb2.ForkRequest(session_id=parent, num_children=1, num_prefix_tokens=num_prefix_tokens,
                                                        append_token_ids=append), timeout=TIMEOUT_S)

            def fork_each(num_children: int, appends: list[list[int]], **kw):
                return stub.Fork(verify_pb2.ForkRequest(
                    session_id=parent, num_children=num_children, num_prefix_tokens=2,
                    child_appends=[verify_pb2.ChildAppend(token_ids=a) for a in appends], **kw), timeout=TIMEOUT_S)

            codes += [await code(fork(len(prompt) + 2, [5])),  # longer than the parent
                      await code(fork(2, [])),  # cut to a prefix with nothing to sample from
                      await code(fork_each(2, [[5]])),  # one append for two children
                      await code(fork_each(2, [[5], []])),  # a child with nothing to sample from
                      await code(fork_each(1, [[5]], append_token_ids=[6])),  # both kinds of append
                      await code(fork_each(1, [[5]], layout=7))]  # no such layout
            # the same sequence rebuilt from a shared prefix of 2; a child is not constrained, so its
            # next token is the unconstrained session's first
            child = await fork(2, prompt[2:])
            free = await stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=prompt, sampling=sampling),
                                          timeout=TIMEOUT_S)
            codes.append(grpc.StatusCode.OK if child.next_token_ids[0] == free.first_token_id else grpc.StatusCode.UNKNOWN)
            for session_id in (parent, child.child_session_ids[0], free.session_id):
                await stub.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=session_id), timeout=TIMEOUT_S)
            return codes

    assert _run(main()) == [grpc.StatusCode.INVALID_ARGUMENT] * 9 + [grpc.StatusCode.OK]


def test_a_cancelled_answer_closes_every_session(cluster):
    """The client leaves while the branches run: the coordinator cancels them and closes the plan's
    session and every branch's."""
    async def main() -> int:
        async with channel(cluster.address) as ch:
            call = coordinator_pb2_grpc.CoordinatorServiceStub(ch).Generate(
                _request(FORCED_PLAN + "[END]", max_new_tokens=400, ignore_eos=True), timeout=TIMEOUT_S)
            num_branch_tokens = 0
            async for response in call:
                num_branch_tokens += len(response.token_ids) if response.branch_id > 0 else 0
                if num_branch_tokens >= 12:
                    break
            num_open = cluster.verify[0].servicer.num_sessions
            call.cancel()
            return num_open

    assert _run(main()) >= 3  # the branches' sessions (and the plan's) were open when the client left
    _assert_sessions_closed(cluster)


@pytest.mark.parametrize("drafter", ["none", "service"])
def test_independent_branches_verify_together_and_release_the_plan_session(cluster, tokenizer, engine, drafter):
    """Three independent points: the branches' rounds leave together (RoundGate), so target only,
    after the forks every round is one forward of all three; once all three have forked the plan's
    session is closed (nothing forks from it any more). The branches stay exact (Draft service
    drafts too)."""
    plan = "[PLAN]\n1.<8><None>[-]Sleep\n2.<8><None>[-]Food\n3.<8><None>[-]Move\n[END]"
    max_new_tokens = 10
    request = _request(plan, max_new_tokens=max_new_tokens, ignore_eos=True)
    request.drafter = drafter
    servicer = cluster.verify[0].servicer
    verify_engine = servicer.engine

    opened: list[str] = []  # the request's Verify sessions in the order they open: the plan's first
    add = servicer.sessions.add

    def recording_add(value, owner):
        opened.append(add(value, owner))
        return opened[-1]

    async def main() -> tuple[list[coordinator_pb2.GenerateResponse], list[set[str]]]:
        async with channel(cluster.address) as ch:
            responses, sessions_while_all_run = [], []
            async for response in coordinator_pb2_grpc.CoordinatorServiceStub(ch).Generate(request, timeout=TIMEOUT_S):
                responses.append(response)
                counts = {b: len([t for r in responses if r.branch_id == b for t in r.token_ids]) for b in (1, 2, 3)}
                if all(1 <= n < max_new_tokens for n in counts.values()):
                    # the stream runs rounds ahead of what the client has read: a branch may already be done
                    sessions_while_all_run.append(servicer.sessions.session_ids())
            return responses, sessions_while_all_run

    before = (verify_engine.stats.num_forwards, verify_engine.stats.num_sequences_forwarded)
    servicer.sessions.add = recording_add
    try:
        responses, sessions_while_all_run = _run(main())
    finally:
        servicer.sessions.add = add
    plan_ids = set(opened[:1])
    forwards, sequences = (a - b for a, b in zip((verify_engine.stats.num_forwards,
                                                  verify_engine.stats.num_sequences_forwarded), before))
    branches = _by_branch(responses)
    skeleton = parse_skeleton(plan)
    assert isinstance(skeleton, Skeleton)
    for point in skeleton.points:
        prompt = chat_messages_ids(tokenizer, point_messages(QUESTION, plan, point, (), (), FORMAT))
        expected = generate(TargetVerifier(engine), None, prompt,
                            SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)).token_ids
        assert [t for r in branches[point.id] for t in r.token_ids] == expected, f"point {point.id}"
    if drafter == "none":  # each branch: its fork gives token 1, then 9 rounds; 9 forwards of 3 sequences
        # add 2 * 9 = 18 sequences over the forwards (allow one round that split)
        assert sequences - forwards >= 2 * (max_new_tokens - 1) - 2, f"{sequences} sequences in {forwards} forwards"
    assert len(opened) == 4 and sessions_while_all_run, (opened, sessions_while_all_run)  # the plan and 3 branches
    assert not sessions_while_all_run[-1] & plan_ids  # the plan's session is closed once every branch forked
    assert any(len(ids) == 3 and not ids & plan_ids for ids in sessions_while_all_run)  # three branches at once
    _assert_sessions_closed(cluster)


def _ask_list_question() -> coordinator_pb2.GenerateRequest:
    """A list question with no mode named: `default_mode: auto` routes it."""
    return coordinator_pb2.GenerateRequest(
        chat=coordinator_pb2.ChatMessages(messages=[coordinator_pb2.ChatMessage(role="user", content=QUESTION)]),
        drafter="ngram", sampling=common_pb2.SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))


def test_auto_stops_picking_skeleton_once_it_lost_on_this_target(target):
    """default_mode auto without the start-up probe: the first list question tries SoT (nothing is measured
    yet); a SoT answer whose plan is rejected loses, and from then on auto answers list questions in
    speculative mode, its reason saying why (specmesh/skeleton/gate.py)."""
    with Cluster(target, default_mode="auto", skeleton_probe=False) as auto:
        first = _run(_stream(auto.address, _ask_list_question()))[-1]
        assert first.mode_choice.mode == coordinator_pb2.GENERATION_MODE_SKELETON and first.mode_choice.routed
        plan = "[PLAN]\n1.<40><None>[-]Dark room\n2.<40><None>[1]dark room.\n[END]"
        lost = _run(_stream(auto.address, _request(plan, max_new_tokens=8, ignore_eos=True)))[-1]
        assert lost.skeleton.direct_reason.startswith("plan rejected")
        routed = _run(_stream(auto.address, _ask_list_question()))[-1]
        assert routed.mode_choice.mode == coordinator_pb2.GENERATION_MODE_SPECULATIVE and routed.mode_choice.routed
        assert routed.mode_choice.reason.startswith("list of points")
        assert routed.mode_choice.reason.endswith(f"; SoT lost on this target: {lost.skeleton.direct_reason}")
        assert not routed.HasField("skeleton")


def test_auto_measures_skeleton_against_plain_at_start(target):
    """default_mode auto with the probe (the default): one plain and one SoT answer are measured before
    any question is routed to SoT, and routed list questions then follow the measured verdict."""
    with Cluster(target, default_mode="auto") as auto:
        gate = auto.coordinator.servicer.skeleton_gate
        deadline_s = time.monotonic() + TIMEOUT_S
        while gate.probing and time.monotonic() < deadline_s:
            time.sleep(0.1)
        assert not gate.probing and gate.num_skeleton_answers == 1 and len(gate.plain_ms_per_token) == 1
        closed = gate.closed_reason()  # the verdict the question is routed by (its own answer is measured too)
        routed = _run(_stream(auto.address, _ask_list_question()))[-1]
        expected = coordinator_pb2.GENERATION_MODE_SPECULATIVE if closed else coordinator_pb2.GENERATION_MODE_SKELETON
        assert routed.mode_choice.mode == expected, (routed.mode_choice.reason, closed)
        if closed:
            assert routed.mode_choice.reason.endswith(f"; {closed}")
