"""The grammar mask keeps speculative decoding exact for the constrained model (tiny random models).

Target-only decoding of a skeleton under the grammar is compared token for token with speculative
decoding where the target's rows are masked with `grammar.walk(state, draft)` states:
- greedy, with a drafter masked by the same grammar and with an unconstrained drafter (whose
  refused tokens make DEAD rows, left unmasked and never reached);
- seeded sampling with one-hot drafts judged positionally, which reads the uniforms plain sampling
  reads, so the two runs emit the same tokens.
Every output parses as a skeleton (or the model's own [DIRECT]). The random target picks [DIRECT] on
its own, so a second case starts after a forced "[PLAN]\n" (the grammar state after those tokens),
as a coordinator that already routed the question to SoT may do.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specmesh.decoding.rejection import verify_greedy, verify_sampled
from specmesh.decoding.sampling import SamplingParams, processed_probs, sample_with_uniforms
from specmesh.models.chat import chat_messages_ids
from specmesh.skeleton.automaton import SkeletonFormat
from specmesh.skeleton.grammar import SkeletonGrammar
from specmesh.skeleton.parse import parse_skeleton
from specmesh.skeleton.prompts import skeleton_messages
from specmesh.skeleton.types import Skeleton

FORMAT = SkeletonFormat(max_points=3, max_title_bytes=12, max_est_digits=2, max_direct_bytes=8)
SAMPLING = SamplingParams(temperature=1.0)
K = 4


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    target_dir = tiny_model_dir("llama", init_std=0.2)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama", seed=1, init_std=0.2), dtype=torch.float32).eval()
    grammar = SkeletonGrammar(tokenizer, max_points=FORMAT.max_points, max_title_bytes=FORMAT.max_title_bytes,
                              max_est_digits=FORMAT.max_est_digits, max_direct_bytes=FORMAT.max_direct_bytes)
    prompt = chat_messages_ids(tokenizer, skeleton_messages("What are some tips for better sleep?", FORMAT))
    return tokenizer, target, draft, grammar, prompt


@pytest.fixture(params=[False, True], ids=["free-start", "forced-plan"])
def start(request, setup) -> tuple[list[int], int]:
    """(forced tokens after the prompt, the grammar state after them)."""
    tokenizer, _, _, grammar, _ = setup
    forced = tokenizer.encode("[PLAN]\n", add_special_tokens=False) if request.param else []
    return forced, grammar.walk(grammar.initial_state(), forced)[-1]


@torch.no_grad()
def rows(model, ids: list[int], num_rows: int) -> torch.Tensor:
    """Logits [num_rows, vocab] at the last num_rows positions of one forward over ids."""
    return model(torch.tensor([ids])).logits[0, -num_rows:].float()


def finished(grammar: SkeletonGrammar, out: list[int]) -> bool:
    return bool(out) and out[-1] in grammar.eos_token_ids


def target_only(setup, start, sampled: bool) -> list[int]:
    _, target, _, grammar, prompt = setup
    generator = torch.Generator().manual_seed(7)
    prompt, state, out = prompt + start[0], start[1], []
    while not finished(grammar, out):
        logits = grammar.constrain_logits(rows(target, prompt + out, 1), [state])
        if sampled:
            uniform = torch.rand(1, generator=generator, dtype=torch.float64)
            token = int(sample_with_uniforms(processed_probs(logits, SAMPLING), uniform)[0])
        else:
            token = int(logits.argmax())
        state = grammar.advance(state, token)
        out.append(token)
    return out


def speculative(setup, start, sampled: bool, constrained_drafter: bool) -> tuple[list[int], int]:
    """The output and how many target rows had a DEAD state (after a draft token the grammar refuses)."""
    _, target, draft, grammar, prompt = setup
    generator = torch.Generator().manual_seed(7)
    prompt, state, out, num_dead_rows = prompt + start[0], start[1], [], 0
    while not finished(grammar, out):
        proposal, draft_state = [], state
        for _ in range(K):  # greedy drafts: one-hot q
            logits = rows(draft, prompt + out + proposal, 1)
            if constrained_drafter:
                logits = grammar.constrain_logits(logits, [draft_state])
            proposal.append(int(logits.argmax()))
            draft_state = grammar.advance(draft_state, proposal[-1])
        states = grammar.walk(state, proposal)  # the row states: the verify side's only grammar work
        num_dead_rows += sum(grammar.is_dead(s) for s in states)
        p_logits = grammar.constrain_logits(rows(target, prompt + out + proposal, K + 1), states)
        if sampled:
            outcome = verify_sampled(proposal, None, processed_probs(p_logits, SAMPLING), generator)
        else:
            outcome = verify_greedy(proposal, p_logits.argmax(-1).tolist())
        new = outcome.token_ids
        if any(t in grammar.eos_token_ids for t in new):
            new = new[:[t in grammar.eos_token_ids for t in new].index(True) + 1]
        state = grammar.walk(state, new)[-1]
        assert not grammar.is_dead(state)
        out += new
    return out, num_dead_rows


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("constrained_drafter", [True, False], ids=["masked-drafter", "free-drafter"])
def test_speculative_equals_target_only_under_the_grammar(setup, start, sampled, constrained_drafter):
    tokenizer, _, _, grammar, _ = setup
    expected = target_only(setup, start, sampled)
    out, num_dead_rows = speculative(setup, start, sampled, constrained_drafter)
    assert out == expected
    assert (num_dead_rows == 0) == constrained_drafter  # the free drafter did propose refused tokens
    text = tokenizer.decode(start[0] + expected, skip_special_tokens=True)
    parsed = parse_skeleton(text, max_points=FORMAT.max_points)
    assert isinstance(parsed, Skeleton) if start[0] else (isinstance(parsed, Skeleton) or parsed.by_model), parsed
    assert len(start[0] + expected) <= grammar.max_tokens
