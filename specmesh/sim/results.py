"""What one simulated run measured, and its summary (throughput, goodput, latency percentiles, ...).

Every figure covers the window after burn-in. A request counts in the latency figures when it
arrived inside the window and finished before the end of the run; tokens count in throughput when
they were emitted inside the window. TTFT: arrival to the first token at the client. TPOT: the
mean time per output token after the first, (e2e - ttft) / (output tokens - 1). Goodput: tokens/s
of the requests (counted as above) that met both SLOs. `in_system_mean` is the time-average number
of requests in flight, so Little's law reads in_system_mean ~= arrival_rate_per_s * e2e mean.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    arrival_s: float
    num_prompt_tokens: int
    max_new_tokens: int
    target: str = ""
    draft: str = ""
    first_token_s: float = -1.0  # -1: not yet
    end_s: float = -1.0
    num_output_tokens: int = 0
    num_rounds: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        return (self.end_s - self.first_token_s) / (self.num_output_tokens - 1) if self.num_output_tokens > 1 else 0.0


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN for no values.

    >>> percentile([1.0, 2.0, 3.0, 4.0], 50), percentile([5.0], 99)
    (2.5, 5.0)
    """
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (pos - lo) * (s[hi] - s[lo])


def latency_stats(values_s: list[float]) -> dict[str, float]:
    ms = [v * 1e3 for v in values_s]
    return {"mean_ms": sum(ms) / len(ms) if ms else float("nan"), "p50_ms": percentile(ms, 50), "p90_ms": percentile(ms, 90),
            "p95_ms": percentile(ms, 95), "p99_ms": percentile(ms, 99)}


@dataclass
class DeviceRecord:
    name: str
    kind: str  # target | draft
    busy_s: float
    num_jobs: int
    utilisation: float  # busy_s / window
    num_batches: int = 0
    mean_batch_rows: float = 0.0
    mean_batch_tokens: float = 0.0
    batch_token_utilisation: float = 0.0  # mean batch tokens / max_batch_tokens
    queue_depth_mean: float = 0.0
    queue_depth_max: int = 0


@dataclass
class SimResult:
    summary: dict[str, Any]
    requests: list[RequestRecord] = field(default_factory=list)
    devices: list[DeviceRecord] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"summary": self.summary, "devices": [asdict(d) for d in self.devices]}


def summarize(requests: list[RequestRecord], window_start_s: float, window_end_s: float, num_emitted_tokens: int,
              in_system_area: float, ttft_slo_ms: float, tpot_slo_ms: float) -> dict[str, Any]:
    length_s = window_end_s - window_start_s
    arrived = [r for r in requests if window_start_s <= r.arrival_s < window_end_s]
    done = [r for r in arrived if 0 <= r.end_s <= window_end_s]
    good = [r for r in done if r.ttft_s * 1e3 <= ttft_slo_ms and r.tpot_s * 1e3 <= tpot_slo_ms]
    drafted = sum(r.num_draft_tokens for r in done)
    accepted = sum(r.num_accepted_tokens for r in done)
    rounds = sum(r.num_rounds for r in done)
    return {
        "window_s": length_s,
        "num_requests_arrived": len(arrived),
        "num_requests_done": len(done),
        "arrival_rate_per_s": len(arrived) / length_s,
        "throughput_tokens_per_s": num_emitted_tokens / length_s,
        "goodput_tokens_per_s": sum(r.num_output_tokens for r in good) / length_s,
        "slo_attainment": len(good) / len(done) if done else float("nan"),
        "ttft": latency_stats([r.ttft_s for r in done]),
        "tpot": latency_stats([r.tpot_s for r in done if r.num_output_tokens > 1]),
        "e2e": latency_stats([r.e2e_s for r in done]),
        "in_system_mean": in_system_area / length_s,
        "acceptance_rate": accepted / drafted if drafted else float("nan"),
        "mean_tokens_per_round": (sum(r.num_output_tokens for r in done) - len(done)) / rounds if rounds else float("nan"),
    }
