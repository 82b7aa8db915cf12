"""Whether `default_mode: auto` may pick Skeleton-of-Thought on this target: measured, not assumed.

SoT wins only where the target writes a usable plan and its branches, decoded together, beat one
plain answer's time per token. Neither is known for a model before it runs (the embedded 135M model
copies the prompt's example into its plan, which is then rejected: the plan's seconds buy nothing).
So the coordinator measures, and the router's "list of points" verdict is obeyed only while SoT has
not lost on this target:

  - before anything is measured, with a probe configured (`skeleton_probe`, on by default under
    `default_mode: auto`), auto answers plainly while the probe (one plain answer and one SoT answer
    of a list question, at start) runs; without a probe, the first routed question tries SoT;
  - a SoT answer loses when its plan was rejected or the model chose a direct answer, or when its
    wall time per answer token is above the median of the last plain answers' (the mode auto runs
    instead); auto then stops picking SoT, and says why in each routed request's reason;
  - a SoT answer that wins (one asked for by name counts too) lets auto pick SoT again.

>>> gate = SkeletonGate(probing=False)
>>> gate.closed_reason() is None
True
>>> gate.record_plain(wall_ms=2000.0, num_tokens=100)
>>> gate.record_skeleton(wall_ms=1500.0, num_tokens=100)      # 15 ms per token against 20: SoT won
>>> gate.closed_reason() is None
True
>>> gate.record_skeleton(wall_ms=6000.0, num_tokens=100, direct_reason="plan rejected, points repeat")
>>> gate.closed_reason()
'SoT lost on this target: plan rejected, points repeat'
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

PROBE_QUESTION = "What are some tips for better sleep?"
PROBE_MAX_NEW_TOKENS = 96
PROBING = "SoT not measured on this target yet (the start-up probe is running)"
LOST = "SoT lost on this target: {why}"


@dataclass
class SkeletonGate:
    probing: bool  # a probe is running: closed until it records its answers
    window: int = 16  # plain answers the median is taken over
    plain_ms_per_token: deque[float] = field(default_factory=deque)
    lost: str = ""  # why the last SoT answer lost ("" = it won, or none ran yet)
    num_skeleton_answers: int = 0

    def closed_reason(self) -> str | None:
        """None when auto may pick SoT; else why it answers plainly."""
        if self.lost:
            return LOST.format(why=self.lost)
        if self.probing:
            return PROBING
        return None

    @property
    def plain_median_ms(self) -> float | None:
        return statistics.median(self.plain_ms_per_token) if self.plain_ms_per_token else None

    def record_plain(self, wall_ms: float, num_tokens: int) -> None:
        """A finished plain answer (the mode auto runs when SoT does not fit)."""
        if num_tokens > 0:
            self.plain_ms_per_token.append(wall_ms / num_tokens)
            while len(self.plain_ms_per_token) > self.window:
                self.plain_ms_per_token.popleft()

    def record_skeleton(self, wall_ms: float, num_tokens: int, direct_reason: str = "") -> None:
        """A finished SoT answer: `num_tokens` of answer (the plan's not counted), `direct_reason` set
        when it answered directly instead of in branches."""
        self.num_skeleton_answers += 1
        plain_ms = self.plain_median_ms
        if direct_reason:
            self.lost = direct_reason
        elif num_tokens <= 0:
            self.lost = "an answer of no tokens"
        elif plain_ms is not None and wall_ms / num_tokens > plain_ms:
            self.lost = f"{wall_ms / num_tokens:.1f} ms per answer token against plain answers' {plain_ms:.1f}"
        else:
            self.lost = ""

    def probe_done(self, error: str = "") -> None:
        """The probe's answers are recorded (or it failed: `error`, and auto answers plainly)."""
        self.probing = False
        if error:
            self.lost = f"the start-up probe failed ({error})"
