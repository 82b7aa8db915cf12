"""Adaptive draft length: choose k from measured acceptance and measured costs.

With per-token acceptance rate a (Leviathan et al. 2023), a round that drafts k tokens emits on
average E(k) = (1 - a^(k+1)) / (1 - a) tokens. It costs k * d (d = draft ms per token) plus the
verify forward v(k) = v1 * (1 + beta * k) (v1 = a one-token forward; beta = extra cost per verified
token, a fixed prior: small because decoding is memory-bound; `bench/engine.py` measures it). k = 0 is plain decoding: 1 token for v1.
The policy picks the k in {0} ∪ [k_min, k_max] with the most tokens per ms. When k = 0 wins, a
probe round with k_min is still made every `probe_every` rounds so a change in acceptance
(a repetitive stretch of text, say) is noticed; unless a draft token costs more than the verify time it
could save (`could_pay`), which no acceptance can make up for, or the probe's catch-up costs more than
perfect drafts could win back before the request ends (`probe_pays`): a model drafter first takes in
every token it has not seen (the plain rounds' tokens; the prompt, if it never drafted). Before the first round, the costs this
process has measured of its engines (`prior_costs`) choose the first k, so a drafter that cannot pay on
this hardware (a bf16 self-draft through the torch path on a CPU, say) is never run.

Cost estimates are exponential moving averages. The acceptance estimate treats a round as a run of
Bernoulli trials: n accepted of k drafted is n successes and (n < k) one failure, and it is the share of
successes among the trials, each older trial discounted (`acceptance_memory`), the prior counting as a
few trials (a round of 4 accepted moves it as far as 4 probes of 1 would).

Under load the prior beta is wrong. A batched verify forward of N tokens costs about A + B * N ms
(A: reading the weights, B: compute per token; `TargetVerifier` fits both with a `LinearCostFit` over
its rounds' forwards, starting from the engine's measured chains (`EngineStats.round_timings`), which the
Verify service reports with each round as a `ForwardCost` and the in-process loop passes on). Maximising the batch's tokens per ms, each
of n sessions should count its share of the forward, A / n + B * (1 + k): so beta = B / (A / n + B).
One session on a GPU: A >> B, beta ~ 0 (draft long). Sixteen sessions on a CPU, which is compute-bound
already: beta near 1, and a draft token must be accepted with probability > beta to pay its way,
which a selfish session seeing only its own round time (its k is 1/16 of the batch) would not learn.

Worked example: A = 24 ms, B = 2 ms
    n = 1:  beta = 2 / (24 + 2) = 0.08      n = 16:  beta = 2 / (1.5 + 2) = 0.57
    with a = 0.5 and free drafts, k=1 vs k=0: n = 1: 1.5 / 1.08 = 1.39 > 1 (draft); n = 16: 1.5 / 1.57 = 0.96 < 1 (plain)

Worked example: a = 0.8, d = 1 ms, v1 = 10 ms, beta = 0.1
    k=0: 1 / 10 = 0.100 tok/ms      k=4: 3.36 / (4 + 14) = 0.187      k=8: 4.33 / (8 + 18) = 0.167
    -> k = 4 (k=5: 3.69 / 20 = 0.184 is already worse)

Drafting ahead (`set_drafting_ahead`: a Draft service with `draft_ahead`, on cores of its own). While
the target verifies a round, the drafter makes its guess at the target's next token and drafts the
next round from it. The next round waits only for what is not done by then when the guess held (every
draft accepted and the guess right: p = a^(k+1)), and for its k drafts when it did not:
    round(k) = v(k) + p * max(0, (k+1) d - v(k)) + (1 - p) * k d + o
d is then what one of the drafter's forwards costs as it reports it with each proposal (a round's
draft wait says how much of the drafting was hidden, not what a forward costs), o the measured
wait beyond that model (the Propose round trip, a forward ahead still running): the mean of the
rounds' draft ms less their modelled wait. v(k) comes from drafting rounds only, beta too (fitted on
their verify ms against k + 1, once their k vary; the verifier's own fit is not taken): the drafter's
forwards beside the verify forward slow it (on a 2-core CPU, 40 ms for 2 tokens against a 23 ms plain
step), which a fit over plain and drafting forwards together reads as a dear token (beta 1: no draft
ever pays). Worked example, o = 0: a = 0.9, d = 16 ms, v1 = 24 ms, beta = 0.125 (a bf16 self-draft
and an fp32 target, a core each):
    k=0: 1 / 24 = 0.042 tok/ms
    drafts not ahead: k=1: 1.9 / (16 + 27) = 0.044      k=4: 4.10 / (64 + 36) = 0.041
    drafting ahead:   k=1: 1.9 / (27 + 0.81 * 5 + 0.19 * 16) = 0.056      k=4: 4.10 / 88.2 = 0.046
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Outlook:
    """What the next round faces, as the driver's state knows it after this one: `catch_up_tokens`
    the drafter must take in before it can draft (tokens of plain rounds it was not told; the prompt,
    if it never drafted), `tokens_left` the request may still emit."""

    catch_up_tokens: int
    tokens_left: int


@dataclass(frozen=True)
class ForwardCost:
    """What the verify forward a round rode in costs: about fixed_ms + ms_per_token * tokens, shared
    by batch_size sessions (fitted by the Verify service; see the module docstring)."""

    fixed_ms: float
    ms_per_token: float
    batch_size: int = 1

    def beta(self) -> float:
        """This session's verify cost growth per draft token, relative to its share of the forward."""
        share = self.fixed_ms / max(1, self.batch_size) + self.ms_per_token
        return self.ms_per_token / share if share > 0 else 0.0


class LinearCostFit:
    """Least squares fit of forward ms = fixed + per_token * tokens, over recent forwards.

    Sums decay by `decay` per observation (recent batches weigh more: the load and the context
    lengths move). Until the token counts seen vary enough to tell the slope, `estimate` is None;
    once they have, a stretch of same-sized forwards (plain decoding) keeps the last estimate instead
    of forgetting what a token costs.

    >>> fit = LinearCostFit()
    >>> for tokens in (1, 5, 9, 17, 33):
    ...     fit.observe(tokens, 20.0 + 2.0 * tokens)
    >>> fixed, per_token = fit.estimate()
    >>> round(fixed, 6), round(per_token, 6)
    (20.0, 2.0)
    """

    def __init__(self, decay: float = 0.995, min_spread_tokens: float = 1.0):
        self.decay = decay
        self.min_spread_tokens = min_spread_tokens  # standard deviation of the token counts needed
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._last: tuple[float, float] | None = None  # the last determined estimate

    def observe(self, tokens: int, ms: float) -> None:
        d = self.decay
        self._w = d * self._w + 1.0
        self._x = d * self._x + tokens
        self._y = d * self._y + ms
        self._xx = d * self._xx + tokens * tokens
        self._xy = d * self._xy + tokens * ms

    def seed(self, timings: Sequence[tuple[int, float]], weight: float) -> None:
        """Start from measured forwards (`EngineStats.round_timings`: (tokens, ms) each), `weight` observations of
        each, which the forwards observed after outweigh as they come (the sums decay). Without it the first rounds
        decide alone: a probe's two-token forwards read as 4.1-4.7 ms a token where chains of 5-9 cost 1.4,
        a beta of 0.25 that kept a bf16 self-draft from ever drafting again."""
        for count, ms in timings:
            self._w += weight
            self._x += weight * count
            self._y += weight * ms
            self._xx += weight * count * count
            self._xy += weight * count * ms

    def estimate(self) -> tuple[float, float] | None:
        """(fixed ms, ms per token), both >= 0; None until the fit is determined."""
        if self._w <= 0:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        if var_x < self.min_spread_tokens**2:
            return self._last
        slope = max(0.0, (self._xy / self._w - mean_x * mean_y) / var_x)
        self._last = (max(0.0, mean_y - slope * mean_x), slope)
        return self._last

    def cost(self, batch_size: int) -> ForwardCost | None:
        fitted = self.estimate()
        return None if fitted is None else ForwardCost(fitted[0], fitted[1], batch_size)


class KPolicy(Protocol):
    """Chooses the draft length of the next round from what the previous rounds measured."""

    def next_k(self) -> int: ...

    def update(self, num_drafted: int, num_accepted: int, draft_ms: float, verify_ms: float,
               cost: ForwardCost | None = None, catch_up: int = 0, outlook: Outlook | None = None) -> None:
        """`catch_up`: tokens the drafter first took in that a round after a draft would not have
        brought (plain rounds' tokens, the prompt; its draft_ms includes them); `outlook`: the next round's."""
        ...

    def pays(self, acceptance: float) -> bool:
        """Whether a draft whose first token is accepted with probability `acceptance` is worth verifying."""
        ...

    def plain_rounds_ahead(self) -> int | None:
        """Rounds from the next one on (counting it) that this policy keeps at k = 0 while only plain
        rounds come and its costs hold: 0 when it drafts next; None when no bound is known (it would
        stay at 0 to the end). A driver may hand that many rounds to the verifier in one go."""
        ...


def expected_tokens(acceptance: float, k: int) -> float:
    """E(k) = 1 + a + ... + a^k: tokens per round with k drafts at per-token acceptance a."""
    return sum(acceptance**i for i in range(k + 1))


class AcceptanceMemory:
    """One drafter's acceptance as its last generations measured it, for the next one's `AdaptiveK` to start from
    (instead of the prior 0.7): the estimate and the verdicts it stands on, those capped at `max_trials` so that
    a new generation's first rounds still move it."""

    def __init__(self, max_trials: float = 8.0):
        self.max_trials = max_trials
        self.acceptance: float | None = None
        self.trials = 0.0

    def record(self, acceptance: float, trials: float) -> None:
        self.acceptance, self.trials = acceptance, min(trials, self.max_trials)

    def seed(self, policy: AdaptiveK) -> bool:
        """Start `policy` from the remembered acceptance; False when there is none yet."""
        if self.acceptance is None:
            return False
        policy.acceptance, policy._trials = self.acceptance, max(self.trials, policy.acceptance_prior_trials)
        return True


class AcceptanceMemories(dict):
    """A process's `AcceptanceMemory` per drafter, greedy and sampled requests apart (their acceptance differs):
    keys (drafter, greedy)."""

    def policy(self, drafter: str, greedy: bool) -> AdaptiveK:
        """An adaptive k for a request drafted by `drafter`, starting from what the earlier ones measured."""
        return AdaptiveK(memory=self.setdefault((drafter, greedy), AcceptanceMemory()))


@dataclass
class AdaptiveK:
    k_init: int = 4
    k_min: int = 1
    k_max: int = 16
    allow_zero: bool = True  # may fall back to plain decoding when drafting does not pay
    ema_weight: float = 0.3  # weight of the newest observation (of a cost)
    # `acceptance` is the share accepted of the draft tokens judged, each older verdict discounted by this
    # factor a token (a memory of about ten), the prior counting as `acceptance_prior_trials` tokens
    acceptance_memory: float = 0.9
    acceptance_prior_trials: float = 2.0
    beta: float = 0.1  # verify cost growth per verified token: the prior, until a round reports its ForwardCost
    probe_every: int = 8  # rounds at k = 0 before the first probe; doubles after each failed probe
    max_probe_every: int = 64  # ... up to this many (a drafter that never helps costs one probe per 64 rounds)
    min_gain: float = 0.25  # drafting is tried only where perfect drafts would save this much of a step (`could_pay`)
    # ... or where, at this generation's measured costs and acceptance, the best k is modelled this much faster than
    # plain decoding (`pays_as_measured`)
    min_measured_gain: float = 0.10
    # earlier generations' acceptance of this drafter (`AcceptanceMemory`): the prior instead of 0.7, and told this one's
    memory: AcceptanceMemory | None = None

    def __post_init__(self):
        if not 1 <= self.k_min <= self.k_init <= self.k_max:
            raise ValueError(f"need 1 <= k_min <= k_init <= k_max, got {self.k_min}, {self.k_init}, {self.k_max}")
        self.acceptance = 0.7  # prior until rounds are observed
        self._trials = self.acceptance_prior_trials  # the verdicts `acceptance` stands on, discounted (`update`)
        self._beta_measured = False  # beta is still the prior
        self.draft_ms_per_token: float | None = None
        self.decode_ms: float | None = None  # v1
        self.catch_up_ms_per_token: float | None = None  # measured on catch-up rounds (`probe_pays`)
        self._catch_up_prior: float | None = None  # the drafter's prefill ms per token, until measured
        self._rounds_at_zero = 0
        self._probe_interval = self.probe_every
        self._k = self.k_init
        self.drafts_ahead = False  # the drafter drafts each next round while the last is verified (module docstring)
        self.ahead_overhead_ms: float | None = None  # o: a drafted-ahead round's draft wait beyond the model (mean)
        self.ahead_decode_ms: float | None = None  # v1 as drafting rounds measure it while the drafter runs beside
        self._ahead_fit = LinearCostFit(min_spread_tokens=0.5)  # those rounds' verify ms ~ fixed + per token * (k + 1)
        self._last_drafted = 0  # the round before's drafts: how far the drafter drafted ahead of this round
        self._draft_cost_measured = False  # a drafting round of this generation timed a draft token (else: a prior)
        self._prior_checked = False  # the probe `could_pay` allowed on prior costs alone was made (`may_probe`)
        self._probe_due = 0  # the k of a probe chosen and not yet asked for by a round (`_choose`, `next_k`)
        self._seeded = self.memory is not None and self.memory.seed(self)  # the prior is earlier generations' acceptance

    def next_k(self) -> int:
        if self._probe_due and self._k == self._probe_due:
            self._probe_due = 0  # a round asks for the probe: it is made, whatever the drafter has
        return self._k

    def prior_costs(self, draft_ms_per_token: float | None, decode_ms: float | None,
                    catch_up_ms_per_token: float | None = None, forward_cost: ForwardCost | None = None) -> None:
        """Costs known before this generation's first round (the engines' own one-token forward times
        in this process, `EngineStats.step_ms`): they stand in until rounds measure them, and choose
        the first k, which is 0 when drafting cannot pay at these costs. Ignored once rounds measured.
        `catch_up_ms_per_token` (the drafter's engine's prefill ms per token) prices a probe's catch-up
        until a catch-up round measures it (`catch_up_ms`). `forward_cost` (the verifier's fit over its
        earlier requests' rounds) replaces the prior beta: without it a request's first gated draft is
        priced at beta 0.1, where a CPU's verify forward grows 15-17% a token (measured: an n-gram draft
        of 4 tokens let through on its first round, rejected, on every request of a prompt with no matches)."""
        if catch_up_ms_per_token is not None and self.catch_up_ms_per_token is None:
            self._catch_up_prior = catch_up_ms_per_token
        if forward_cost is not None and not self._beta_measured:
            self.beta, self._beta_measured = forward_cost.beta(), True
        if draft_ms_per_token is None or decode_ms is None or self.draft_ms_per_token is not None:
            return
        self.draft_ms_per_token, self.decode_ms = draft_ms_per_token, decode_ms
        self._k = self._gated(self._best())
        if self._seeded:  # an acceptance remembered from other prompts: this one's first round risks k_init at most
            self._k = min(self._k, self.k_init)

    def set_drafting_ahead(self, on: bool, forward_ms: float | None = None) -> None:
        """Whether the drafter drafts each next round while the last one is verified, and (`forward_ms`) what
        one of its forwards costs now, as it says: rounds are then priced by what drafting ahead hides
        (module docstring). Set before `prior_costs`, the first k is priced so too, at the prior acceptance: the
        Draft service prefills a drafting-ahead session's prompt when it opens, beside the target's prefill, so
        the first round waits for its drafts only (draft_service/servicer.py). Priced in turn, a bf16 self-draft
        on a core of its own never drafted (bench/draft_ahead.py)."""
        self.drafts_ahead = on
        if on and forward_ms is not None:
            self.draft_ms_per_token = forward_ms

    def could_pay(self) -> bool:
        """Whether some k > 0 would beat plain decoding by a margin were every draft token accepted:
        the best k in [k_min, k_max] must save `min_gain` of a plain step per emitted token
        (`_most_saved_per_token`). When it does not, probing (which only measures acceptance) cannot
        find a k that pays; and a drafter whose best case is a few percent (a bf16 self-draft at 0.7 of
        the target's step, with verify forwards growing 14% a token: 15% at best) loses that and more to
        what the costs miss (measured: 0.87-0.98x plain on the held-out prompts, bench/never_costs.py)."""
        saved = self._most_saved_per_token()
        return saved is None or saved > self.min_gain * (self.decode_ms or 0.0)

    def may_probe(self) -> bool:
        """Whether a probe may come at k = 0: `could_pay`, or once a generation where only priors say it
        cannot (no drafting round of this generation timed a draft token) and perfect drafts would still save
        something at them. A prior is a figure the drafter's service timed earlier, perhaps while the machine
        was busy (measured: a Draft service's lent step read 16.3 ms after the cluster's start and 12.6 after
        a request's last forwards, where its forwards take 10; against an 18-20 ms target step the gate stayed
        shut, and a plain request drafts nothing that could correct it: 4 of 5 cluster chat requests
        decoded plainly, 1.4x the time). The probe's forwards refresh the drafter's figure
        (`refresh_draft_cost`)."""
        if self.could_pay():
            return True
        saved = self._most_saved_per_token()
        return not (self._draft_cost_measured or self._prior_checked) and saved is not None and saved > 0

    def pays_as_measured(self, k: int) -> bool:
        """Whether drafting k tokens is modelled `min_measured_gain` faster than plain decoding at the acceptance
        and draft cost this generation's drafting rounds measured. The gate (`could_pay`) asks for perfect
        drafts to save `min_gain` of a step, because at a modest acceptance the model's few percent are lost
        to what it misses; a drafter that keeps being accepted makes its best case real. Measured: a bf16
        self-draft at 0.66 of the target's step (perfect drafts save 23%, below the gate), accepted 95-98% on
        the demo's chat prompt, decoded plainly after its probes, where a fixed k of 8 ran 1.13x faster. The
        acceptance estimate starts from its prior (0.7), so a few accepted probe tokens do not open it:
        at 0.66 of the step it takes about 0.95."""
        if not (self._draft_cost_measured or self._prior_checked or self._seeded) or k <= 0:
            return False
        return self.speed(k) >= (1.0 + self.min_measured_gain) * self.speed(0)

    def refresh_draft_cost(self, ms_per_token: float | None) -> None:
        """The drafter's own figure for a draft token now (its engine's recent one-token forwards), after a
        round it drafted in: it replaces a prior no round of this generation has measured."""
        if ms_per_token is not None and not self._draft_cost_measured and not self.drafts_ahead:
            self.draft_ms_per_token = ms_per_token

    def _most_saved_per_token(self) -> float | None:
        """What an emitted token costs less than a plain step at best: every draft accepted, at the best k
        in [k_min, k_max] (k draft tokens and a verify forward of v1 (1 + beta k) for k + 1 tokens); None
        until both costs are known."""
        if self.draft_ms_per_token is None or self.decode_ms is None:
            return None
        return self.decode_ms - min(self._round_ms(k, 1.0) / (k + 1) for k in range(self.k_min, self.k_max + 1))

    def probe_pays(self, outlook: Outlook | None) -> bool:
        """Whether a probe could win back its catch-up: the most an emitted token can save
        (`_most_saved_per_token`: every draft accepted), over the tokens the request may still emit,
        against the catch-up's cost (`catch_up_ms`). A bf16 self-draft on a CPU, probed after a plain
        stretch, would prefill the whole context in bf16 for one token."""
        saved = self._most_saved_per_token()
        if outlook is None or saved is None:
            return True
        return outlook.tokens_left * saved > outlook.catch_up_tokens * self.catch_up_ms()

    def catch_up_ms(self) -> float:
        """ms per token a drafter takes to catch up: measured on catch-up rounds, else the drafter's
        engine's prefill cost per token (`prior_costs`), else the prior: a token of a forward costs
        what the target's verify forward adds per token, beta of a step."""
        if self.catch_up_ms_per_token is not None:
            return self.catch_up_ms_per_token
        if self._catch_up_prior is not None:
            return self._catch_up_prior
        return (self.draft_ms_per_token or 0.0) * self.beta

    def update(self, num_drafted: int, num_accepted: int, draft_ms: float, verify_ms: float,
               cost: ForwardCost | None = None, catch_up: int = 0, outlook: Outlook | None = None) -> None:
        """Fold one round in and choose the next k; `cost` (when the verifier reports it) replaces
        the prior beta by the measured, load-aware one. A `catch_up` round's draft time (a model
        drafter feeding the tokens of the plain rounds before it) says little of a draft token's
        cost, and would keep a policy at k = 0 there: it is used only while nothing better is known;
        what it took beyond its drafts' cost, per token taken in, is the catch-up cost (`probe_pays`)."""
        if cost is not None and not self.drafts_ahead:  # the first report replaces the prior; later ones are averaged in
            self.beta = self._ema(self.beta if self._beta_measured else None, cost.beta())
            self._beta_measured = True
        if self.drafts_ahead and num_drafted > 0:  # (module docstring: drafting ahead, beta from these rounds alone)
            self._ahead_fit.observe(num_drafted + 1, verify_ms)
            fitted = self._ahead_fit.cost(1)
            if fitted is not None:
                self.beta, self._beta_measured = fitted.beta(), True
        if num_drafted > 0:
            # the token verdicts of the round (its accepted tokens, then the rejected one, if any) into the
            # discounted share accepted. An exponential average of the verdicts (weight 0.3) halved a drafter's
            # estimate in three tokens: one rejection after 30 accepted tokens sent it from 1.0 to 0.7 and k from
            # 16 to 1, and a bf16 self-draft accepting 97% of its tokens spent five rounds climbing back (the demo's
            # chat prompt: 14 target forwards where 12 would do). Here that rejection moves it to about 0.9;
            # while few verdicts are in, each weighs more, so a first round's climb is as quick as before
            for verdict in [1.0] * num_accepted + [0.0] * (num_accepted < num_drafted):
                kept = self.acceptance_memory * self._trials
                self._trials = kept + 1.0
                self.acceptance = (kept * self.acceptance + verdict) / self._trials
            if catch_up and self.draft_ms_per_token is not None:
                extra = max(0.0, draft_ms - num_drafted * self.draft_ms_per_token)
                self.catch_up_ms_per_token = self._ema(self.catch_up_ms_per_token, extra / catch_up)
            elif self.drafts_ahead:  # the wait, not a forward's cost (which the drafter reports)
                if num_drafted <= self._last_drafted:  # else it drafted ahead fewer than this round's: o would
                    # take in the rest of its drafts (the model's round(k) is that of a run of rounds at k)
                    modelled = self._round_ms(num_drafted, self.acceptance, overhead=False) - self._verify_ms(num_drafted)
                    self.ahead_overhead_ms = self._ema(self.ahead_overhead_ms, draft_ms - modelled)
            else:
                self.draft_ms_per_token = self._ema(self.draft_ms_per_token, draft_ms / num_drafted)
                self._draft_cost_measured = True
        step_ms = verify_ms / (1.0 + self.beta * num_drafted)
        if self.drafts_ahead and num_drafted > 0:  # the verify forward shares the machine with the drafting
            self.ahead_decode_ms = self._ema(self.ahead_decode_ms, step_ms)
        else:
            self.decode_ms = self._ema(self.decode_ms, step_ms)
        self._last_drafted = num_drafted
        if self.memory is not None and num_drafted > 0:
            self.memory.record(self.acceptance, self._trials)
        self._k = self._choose(num_drafted, outlook)

    def pays(self, acceptance: float) -> bool:
        """A first draft token pays for its verification when it is accepted with probability above
        beta: E(1) / cost(1) = (1 + a) / (1 + beta) > 1 (a draft's later tokens only add to a first
        one that pays). Drafting costs nothing here: the drafters that estimate `acceptance` (n-gram
        lookups) take microseconds."""
        return acceptance > self.beta

    def plain_rounds_ahead(self) -> int | None:
        """`KPolicy.plain_rounds_ahead`: at k = 0, the rounds until the next probe (each plain round
        brings it one closer); None when no probe can come at these costs: drafting cannot pay
        (`could_pay`), or a probe is due and was not made, because it could not win back its catch-up
        (`probe_pays`), which holds the more as the request's tokens run out and its catch-up grows."""
        if self._k != 0:
            return 0
        due_in = self._probe_interval - self._rounds_at_zero
        if due_in <= 0 or not self.may_probe():
            return None
        return due_in

    def speed(self, k: int) -> float:
        """Expected tokens per ms at draft length k under the current estimates."""
        acceptance = min(self.acceptance, 0.999)
        return expected_tokens(acceptance, k) / self._round_ms(k, acceptance)

    def _verify_ms(self, k: int) -> float:
        """A verify forward of k + 1 tokens: a plain step growing by beta a token (drafting ahead, the step as
        drafting rounds measured it: the drafter's forwards beside it contend for the memory, and a plain
        round's step, which they do not, would price it low)."""
        step = self.ahead_decode_ms if self.drafts_ahead and k > 0 and self.ahead_decode_ms is not None else self.decode_ms
        return (step or 1.0) * (1 + self.beta * k)

    def _round_ms(self, k: int, acceptance: float, overhead: bool = True) -> float:
        """Expected ms of a round at draft length k: its verify forward and its k drafts, or, drafting ahead, the
        part of them not hidden behind the last round's verify forward (module docstring; `overhead`: o counted)."""
        d, verify = self.draft_ms_per_token or 0.0, self._verify_ms(k)
        if not self.drafts_ahead or k == 0:
            return verify + d * k
        held = acceptance ** (k + 1)  # every draft accepted and the guess at the target's token right
        extra = max(0.0, self.ahead_overhead_ms or 0.0) if overhead else 0.0
        return verify + held * max(0.0, (k + 1) * d - verify) + (1 - held) * k * d + extra

    def _best(self) -> int:
        """The k of the highest `speed`: over k_min..k_max, the lowest on a tie, then 0 (when allowed)
        only if strictly faster. One pass, E(k) summed as k grows: every round asks."""
        acceptance = min(self.acceptance, 0.999)
        best_k, best_speed = -1, float("-inf")
        power, expected = 1.0, 1.0
        for k in range(1, self.k_max + 1):
            power *= acceptance
            expected += power
            if k >= self.k_min:
                speed = expected / self._round_ms(k, acceptance)
                if speed > best_speed:
                    best_k, best_speed = k, speed
        if self.allow_zero and (best_k < 0 or 1.0 / self._round_ms(0, acceptance) > best_speed):
            return 0
        return best_k

    def _gated(self, best: int) -> int:
        """`best`, or 0 where the gate keeps the drafter off: once the check of a prior confirmed it (`may_probe`),
        or from the start when the acceptance comes from earlier generations (`AcceptanceMemory`), the acceptance
        measured would otherwise let a drafter run whose best case is small (`could_pay`), unless it pays by a
        margin as measured (`pays_as_measured`)."""
        if best and (self._prior_checked or self._seeded) and not self.could_pay() and not self.pays_as_measured(best):
            return 0
        return best

    def _choose(self, last_k: int, outlook: Outlook | None = None) -> int:
        best = self._gated(self._best())
        if (self.drafts_ahead or self._seeded) and last_k > 0:  # at most double: it drafted last_k ahead of the next
            best = min(best, 2 * last_k)  # round; or the acceptance it stands on began as other prompts' (`prior_costs`)
        if best != 0:
            self._probe_interval = self.probe_every
            self._probe_due = 0
        elif self._probe_due:  # chosen, and a driver's plain run (`plain_rounds_ahead`: the stretches it spans may end
            return self._probe_due  # past the probe) went on: made at the next round that can draft, not lost
        else:
            self._rounds_at_zero = self._rounds_at_zero + 1 if last_k == 0 else 1
            if self._rounds_at_zero >= self._probe_interval and self.may_probe() and self.probe_pays(outlook):
                self._rounds_at_zero = 0
                self._probe_interval = min(2 * self._probe_interval, max(self.probe_every, self.max_probe_every))
                self._probe_due = self.k_min
                if not self.could_pay():  # the check of a prior (`may_probe`): two drafts, so that the drafter
                    self._prior_checked = True  # times a one-token forward after taking in what it was not told
                    self._probe_due = min(self.k_max, max(self.k_min, 2))
                return self._probe_due
        return best

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.ema_weight) * old + self.ema_weight * new


@dataclass
class FixedK:
    """Always the same k (benchmarks, tests, or a user who knows best)."""

    k: int

    def next_k(self) -> int:
        return self.k

    def update(self, num_drafted: int, num_accepted: int, draft_ms: float, verify_ms: float,
               cost: ForwardCost | None = None, catch_up: int = 0, outlook: Outlook | None = None) -> None:
        return None

    def pays(self, acceptance: float) -> bool:
        """A fixed k is verified as drafted."""
        return True

    def plain_rounds_ahead(self) -> int | None:
        return None if self.k == 0 else 0
