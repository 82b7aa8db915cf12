"""Sampling parameters and the processors that turn logits into the *processed* distributions.

Exact speculative decoding compares the target's processed distribution p with the drafter's
processed distribution q, so both sides must run the very same function: `processed_probs`.

Pipeline (the order of transformers and vLLM):

    logits [n, vocab] --/ temperature--> top-k --softmax--> top-p --renormalise--> probs [n, vocab]

Greedy (temperature == 0) skips all of it: a one-hot row at the argmax (lowest index on ties, like
`torch.argmax`), so greedy and sampled verification share one code path if wanted.

`processed_probs` applies one request's params to all its rows; `processed_probs_rows` gives every
row its own params (a batch of requests in one call) and returns the same bits row by row.

Tie rules (deterministic, independent of how a sort orders equal values):
- top-k keeps every token whose logit is >= the k-th largest logit, so ties at the boundary are all
  kept and the support may exceed k (as transformers' TopKLogitsWarper does).
- top-p keeps token t iff the probability mass of tokens strictly more likely than t is < top_p:
  the smallest nucleus whose mass reaches top_p, plus every token tied with its least likely member.

Randomness is never global: `sample` takes the request's `torch.Generator` (see `make_generator`),
which lives on the same device as the probabilities.

Acceptance rules (`SamplingParams.acceptance_rule`; greedy ignores them). Both are exact:
- STANDARD: rejection sampling with the request's generator (`specmesh.decoding.rejection`). The
  generator's stream is read round by round, so the same seed gives the same text only when the
  rounds are the same (k, batch, placement).
- COUPLED: Gumbel-max sampling with noise that is a pure function of (seed, position)
  (`specmesh.decoding.coupled`): the same seed gives the same tokens in every mode.
- None (the default): COUPLED, for every sampled request, seeded or not (a missing seed is drawn and
  reported, and replaying it must give the same text in any mode). It costs a bf16 self-draft of the
  default model well under 1% of its acceptance and an n-gram draft none
  (bench/results/acceptance_rules.md), and its drafts need no q on the wire.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specmesh.decoding.types import SparseProbs

TOP_K_DISABLED = 0  # top_k == 0: no top-k truncation
TOP_P_DISABLED = 1.0  # top_p == 1: no nucleus truncation
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed accepts 0..2**64-1


class AcceptanceRule(enum.Enum):
    """How a sampled request draws its tokens and judges draft tokens (module docstring)."""

    STANDARD = "standard"  # rejection sampling with the request's generator
    COUPLED = "coupled"  # Gumbel-max under noise that is a pure function of (seed, position)


DEFAULT_ACCEPTANCE_RULE = AcceptanceRule.COUPLED  # a sampled request without a rule of its own (module docstring)


@dataclass
class SamplingParams:
    """Per-request decoding parameters; call `validate()` on anything that came from a client."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = TOP_K_DISABLED  # keep the k most likely tokens (ties kept); 0 = off
    top_p: float = TOP_P_DISABLED  # nucleus mass in (0, 1]; 1 = off
    seed: int | None = None  # None: drawn from OS entropy when the request starts
    max_new_tokens: int = 256
    stop: Sequence[str] = ()  # stop strings; generation ends at the first match
    stop_token_ids: Sequence[int] = ()  # extra stop tokens besides the model's EOS
    ignore_eos: bool = False  # keep generating past EOS (benchmarks)
    acceptance_rule: AcceptanceRule | None = None  # None: DEFAULT_ACCEPTANCE_RULE (module docstring)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def rule(self) -> AcceptanceRule:
        """The acceptance rule this request uses: its own, or the default."""
        return self.acceptance_rule if self.acceptance_rule is not None else DEFAULT_ACCEPTANCE_RULE

    @property
    def is_coupled(self) -> bool:
        """Sampled with the coupled rule: tokens are coupled samples (`specmesh.decoding.coupled`)."""
        return not self.is_greedy and self.rule is AcceptanceRule.COUPLED

    @property
    def needs_q(self) -> bool:
        """Whether verifying a sampled draft needs the q it was drawn from (the standard rule's test);
        greedy and coupled verification read only the draft tokens."""
        return not self.is_greedy and not self.is_coupled

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first bad field; `vocab_size` also bounds stop_token_ids."""
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0 or (vocab_size is not None and self.top_k > vocab_size):
            bound = f" and <= vocab_size {vocab_size}" if vocab_size is not None else ""
            raise ValueError(f"top_k must be an integer >= 0{bound} (0 = off), got {self.top_k!r}")
        if not _is_real(self.top_p) or not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be None or an integer in [0, 2**64 - 1], got {self.seed!r}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if isinstance(self.stop, str):
            raise ValueError("stop must be a list of strings, not a single string")
        for stop in self.stop:
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"every stop string must be a non-empty string, got {stop!r}")
        for token_id in self.stop_token_ids:
            if not _is_int(token_id) or token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
                bound = f" and < vocab_size {vocab_size}" if vocab_size is not None else ""
                raise ValueError(f"stop_token_ids must be integers >= 0{bound}, got {token_id!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.acceptance_rule is not None and not isinstance(self.acceptance_rule, AcceptanceRule):
            raise ValueError(f"acceptance_rule must be None or an AcceptanceRule, got {self.acceptance_rule!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def resolve_seed(params: SamplingParams, seed: int | None = None) -> SamplingParams:
    """The params a request runs with: its rule made explicit (what every service it reaches is told)
    and its seed: `seed` if given, else its own, else one drawn from OS entropy (below 2**63).

    >>> p = resolve_seed(SamplingParams(temperature=1.0))
    >>> p.seed is not None, p.rule.value, p.acceptance_rule.value
    (True, 'coupled', 'coupled')
    >>> resolve_seed(SamplingParams(temperature=1.0, acceptance_rule=AcceptanceRule.STANDARD), seed=5).seed
    5
    """
    chosen = seed if seed is not None else params.seed if params.seed is not None else secrets.randbits(63)
    return dataclasses.replace(params, acceptance_rule=params.rule, seed=chosen)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> tuple[torch.Generator, int]:
    """The request's generator and the seed it uses (drawn from OS entropy when `seed` is None,
    so it can be reported and the request replayed)."""
    resolved = secrets.randbits(63) if seed is None else seed
    generator = torch.Generator(device=device)
    generator.manual_seed(resolved)
    return generator, resolved


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [n, vocab] -> float32 probs [n, vocab], each row summing to 1, per the module pipeline."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [n, vocab], got shape {tuple(logits.shape)}")
    logits = logits.float()
    if params.is_greedy:
        return one_hot_argmax(logits)
    scaled = logits / params.temperature
    if params.top_k != TOP_K_DISABLED and params.top_k < logits.shape[-1]:
        scaled = top_k_mask(scaled, params.top_k)
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < TOP_P_DISABLED:
        probs = top_p_filter(probs, params.top_p)
    return probs


def one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    """[n, vocab] -> float32 one-hot [n, vocab] at the argmax (lowest index among ties)."""
    probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    return probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)


def processed_probs_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
) -> torch.Tensor:
    """`processed_probs` with params per row: logits [n, vocab], temperature [n] (0 = greedy),
    top_k [n] integer (0 = off), top_p [n] (1 = off) -> float32 probs [n, vocab].

    Row i equals `processed_probs(logits[i:i + 1], params_i)` bit for bit: every stage runs on the
    rows that use it, with the same kernels, and the temperature is rounded to float32 as the scalar
    division there rounds it. (One exception, shared by `processed_probs` itself: torch splits the
    top-p renormalising sum of a lone row of >= 32768 entries across CPU threads, so with several
    threads that row's last bits depend on whether other rows came with it.) Pass the three
    parameter tensors on the CPU: they decide which stages run without a device sync.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [n, vocab], got shape {tuple(logits.shape)}")
    num_rows, vocab_size = logits.shape
    for name, values in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        if tuple(values.shape) != (num_rows,):
            raise ValueError(f"{name} must be [n={num_rows}], got shape {tuple(values.shape)}")
    temperature, top_k, top_p = temperature.cpu(), top_k.cpu().long(), top_p.cpu().double()
    device = logits.device
    logits = logits.float()
    greedy = temperature == 0  # [n]
    use_top_k = ~greedy & (top_k != TOP_K_DISABLED) & (top_k < vocab_size)  # [n]
    use_top_p = ~greedy & (top_p < TOP_P_DISABLED)  # [n]
    safe_temperature = torch.where(greedy, 1.0, temperature.double()).float()  # [n]; greedy rows replaced below
    scaled = logits / safe_temperature.to(device)[:, None]  # [n, vocab]
    if bool(use_top_k.any()):
        rows = use_top_k.nonzero().squeeze(-1).to(device)  # [n_top_k]
        scaled[rows] = top_k_mask(scaled[rows], top_k[use_top_k])
    probs = torch.softmax(scaled, dim=-1)  # [n, vocab]
    if bool(use_top_p.any()):
        rows = use_top_p.nonzero().squeeze(-1).to(device)  # [n_top_p]
        probs[rows] = top_p_filter(probs[rows], top_p[use_top_p])
    if bool(greedy.any()):
        rows = greedy.nonzero().squeeze(-1).to(device)  # [n_greedy]
        probs[rows] = one_hot_argmax(logits[rows])
    return probs


def top_k_mask(logits: torch.Tensor, k: int | torch.Tensor) -> torch.Tensor:
    """Set logits below the k-th largest of their row to -inf; ties with the k-th are kept.

    k: one int for every row, or [n] per row (each in 1..vocab; pass it on the CPU to avoid a sync).
    """
    if isinstance(k, int):
        kth_largest = torch.topk(logits, k, dim=-1).values[..., -1:]  # [n, 1]
    else:
        k = k.long()
        largest = torch.topk(logits, int(k.max()), dim=-1).values  # [n, k_max], descending
        kth_largest = largest.gather(-1, (k - 1).to(logits.device)[:, None])  # [n, 1]
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def top_p_filter(probs: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Keep the nucleus of each row (tie rule in the module docstring) and renormalise.

    top_p: one value for every row, or [n] per row.

    Worked example, top_p = 0.5, row [0.1, 0.3, 0.3, 0.2, 0.1]:
        sorted desc        0.3  0.3  0.2  0.1  0.1
        mass strictly above  0  0.3  0.6  0.8  0.9   (< 0.5 for the first two -> cutoff 0.3)
        kept: tokens 1 and 2 -> [0, 0.5, 0.5, 0, 0]
    """
    if isinstance(top_p, torch.Tensor):
        top_p = top_p.to(device=probs.device, dtype=torch.float64)[:, None]  # [n, 1]
    sorted_probs = torch.sort(probs, dim=-1, descending=True).values  # [n, vocab]
    mass_before = sorted_probs.double().cumsum(dim=-1) - sorted_probs.double()  # exclusive cumsum
    num_keep = (mass_before < top_p).sum(dim=-1, keepdim=True)  # [n, 1], >= 1 since top_p > 0
    cutoff = sorted_probs.gather(-1, num_keep - 1)  # [n, 1] smallest kept probability
    kept = torch.where(probs >= cutoff, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Draw one token per row of probs [n, vocab] -> int64 ids [n], using only `generator`."""
    uniforms = torch.rand(probs.shape[0], generator=generator, device=probs.device, dtype=torch.float64)
    return sample_with_uniforms(probs, uniforms)


def sample_with_uniforms(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: row i yields the first token whose cumulative mass exceeds
    uniforms[i] * (row mass). Rows need not be normalised; zero-probability tokens are never chosen.

    probs [n, vocab] (>= 0, each row with positive mass), uniforms [n] in [0, 1) -> ids [n] int64.
    Tests pass rigged uniforms to force an outcome; `sample` passes fresh ones.
    """
    cdf = probs.double().cumsum(dim=-1)  # [n, vocab]
    targets = uniforms.double() * cdf[:, -1]  # [n]
    ids = torch.searchsorted(cdf, targets[:, None], right=True).squeeze(-1)  # [n]
    # u * mass can round up to the full mass: fall back to the last token with positive probability.
    vocab_size = probs.shape[-1]
    last_positive = vocab_size - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)
    return torch.where(ids >= vocab_size, last_positive, ids)


def to_sparse(probs: torch.Tensor) -> SparseProbs:
    """A dense row [vocab] as its support (ids ascending, values unchanged)."""
    if probs.dim() != 1:
        raise ValueError(f"to_sparse takes one row [vocab], got shape {tuple(probs.shape)}")
    token_ids = torch.nonzero(probs > 0).squeeze(-1)
    return SparseProbs(token_ids=token_ids, probs=probs[token_ids])


def to_dense(sparse: SparseProbs, vocab_size: int) -> torch.Tensor:
    """The dense row [vocab_size] back, bit-identical to what `to_sparse` was given.

    Raises ValueError for malformed input (it may come off the wire)."""
    if sparse.token_ids.shape != sparse.probs.shape or sparse.token_ids.dim() != 1:
        raise ValueError("sparse token_ids and probs must be 1-D and of equal length")
    if sparse.token_ids.numel() and (int(sparse.token_ids.min()) < 0 or int(sparse.token_ids.max()) >= vocab_size):
        raise ValueError(f"sparse token ids must lie in [0, {vocab_size})")
    if bool((sparse.probs < 0).any()) or not bool(torch.isfinite(sparse.probs).all()):
        raise ValueError("sparse probabilities must be finite and >= 0")
    dense = torch.zeros(vocab_size, dtype=sparse.probs.dtype, device=sparse.probs.device)
    dense[sparse.token_ids.long()] = sparse.probs
    return dense
