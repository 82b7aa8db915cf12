"""Ranking and calibration of predicted probabilities: AUC, Brier score, ECE, reliability bins.

    auc        P(a random positive scores above a random negative), ties counting one half; computed
               from average ranks (Mann-Whitney U / (n_pos * n_neg)). 0.5 = no skill, 1 = perfect.
    brier      mean (p - y)^2. 0 = perfect; always predicting the base rate r gives r (1 - r).
    reliability equal-width bins over [0, 1]: per bin the count, mean prediction and observed rate
    ece        sum over bins of count / n * |mean prediction - observed rate|

Worked example: p = [0.9, 0.8, 0.3, 0.2], y = [1, 0, 1, 0]
    auc: pairs (pos, neg) = (0.9, 0.8) win, (0.9, 0.2) win, (0.3, 0.8) loss, (0.3, 0.2) win -> 3/4
    brier: (0.01 + 0.64 + 0.49 + 0.04) / 4 = 0.295
    two bins [0, .5), [.5, 1]: means 0.25 / 0.85, rates 0.5 / 0.5 -> ece = 0.5 * 0.25 + 0.5 * 0.35 = 0.3
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import rankdata


@dataclass
class ReliabilityBin:
    low: float
    high: float
    count: int
    mean_prediction: float  # nan when empty
    observed_rate: float  # nan when empty


@dataclass
class CalibrationReport:
    num_rows: int
    positive_rate: float
    auc: float  # nan when only one class is present
    brier: float
    ece: float
    bins: list[ReliabilityBin]

    def lines(self) -> list[str]:
        out = [f"rows {self.num_rows}, agreement rate {self.positive_rate:.3f}, AUC {self.auc:.3f}, "
               f"Brier {self.brier:.4f} (base rate alone {self.positive_rate * (1 - self.positive_rate):.4f}), ECE {self.ece:.4f}",
               "  bin           count  mean p  observed"]
        for b in self.bins:
            if b.count:
                out.append(f"  [{b.low:.1f}, {b.high:.1f}) {b.count:>8}  {b.mean_prediction:.3f}   {b.observed_rate:.3f}")
        return out


def _arrays(probs: Sequence[float] | np.ndarray, labels: Sequence[float] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    p = np.asarray(probs, dtype=np.float64).reshape(-1)
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    if p.shape != y.shape:
        raise ValueError(f"{p.size} predictions for {y.size} labels")
    if p.size == 0:
        raise ValueError("no rows")
    if not np.all((y == 0) | (y == 1)):
        raise ValueError("labels must be 0 or 1")
    return p, y


def auc(scores: Sequence[float] | np.ndarray, labels: Sequence[float] | np.ndarray) -> float:
    s, y = _arrays(scores, labels)
    num_pos = int(y.sum())
    num_neg = y.size - num_pos
    if num_pos == 0 or num_neg == 0:
        return float("nan")
    ranks = rankdata(s)  # average ranks: ties share the mean of their ranks, so a tie counts 1/2
    u = ranks[y == 1].sum() - num_pos * (num_pos + 1) / 2
    return float(u / (num_pos * num_neg))


def brier(probs: Sequence[float] | np.ndarray, labels: Sequence[float] | np.ndarray) -> float:
    p, y = _arrays(probs, labels)
    return float(np.mean((p - y) ** 2))


def reliability_bins(probs: Sequence[float] | np.ndarray, labels: Sequence[float] | np.ndarray,
                     num_bins: int = 10) -> list[ReliabilityBin]:
    p, y = _arrays(probs, labels)
    index = np.minimum((p * num_bins).astype(np.int64), num_bins - 1)  # p = 1 goes to the last bin
    bins = []
    for b in range(num_bins):
        mask = index == b
        count = int(mask.sum())
        bins.append(ReliabilityBin(b / num_bins, (b + 1) / num_bins, count,
                                   float(p[mask].mean()) if count else float("nan"),
                                   float(y[mask].mean()) if count else float("nan")))
    return bins


def ece(probs: Sequence[float] | np.ndarray, labels: Sequence[float] | np.ndarray, num_bins: int = 10) -> float:
    bins = reliability_bins(probs, labels, num_bins)
    n = sum(b.count for b in bins)
    return float(sum(b.count / n * abs(b.mean_prediction - b.observed_rate) for b in bins if b.count))


def calibration_report(probs: Sequence[float] | np.ndarray, labels: Sequence[float] | np.ndarray,
                       num_bins: int = 10) -> CalibrationReport:
    p, y = _arrays(probs, labels)
    return CalibrationReport(int(p.size), float(y.mean()), auc(p, y), brier(p, y), ece(p, y, num_bins),
                             reliability_bins(p, y, num_bins))
