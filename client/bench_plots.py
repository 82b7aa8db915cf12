"""PNG plots of a `specmesh bench` run (matplotlib, imported here only: not a specmesh dependency).

    paths = write_plots(Path("out"), levels, rows)   # raises ImportError without matplotlib
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def _latency_cdf(path: Path, rows) -> Path:
    figure, axes = plt.subplots(figsize=(6, 4))
    for concurrency in sorted({r.concurrency for r in rows}):
        latencies = sorted(r.latency_s for r in rows if r.concurrency == concurrency and not r.error)
        if latencies:
            axes.step(latencies, [(i + 1) / len(latencies) for i in range(len(latencies))], where="post",
                      label=f"concurrency {concurrency}")
    axes.set(xlabel="request latency (s)", ylabel="fraction of requests", title="Latency CDF", ylim=(0, 1.02))
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _throughput(path: Path, levels: list[dict]) -> Path:
    figure, axes = plt.subplots(figsize=(6, 4))
    concurrency = [level["concurrency"] for level in levels]
    axes.plot(concurrency, [level["tokens_per_s"] for level in levels], marker="o")
    axes.set(xlabel="concurrent sessions", ylabel="aggregate tokens/s", title="Throughput vs concurrency")
    axes.set_xscale("log", base=2)
    axes.set_xticks(concurrency, [str(c) for c in concurrency])
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _acceptance(path: Path, levels: list[dict]) -> Path:
    figure, axes = plt.subplots(figsize=(6, 4))
    for level in levels:
        values = level["accepted_per_draft_by_position"]
        axes.plot(range(1, len(values) + 1), values, marker="o", label=f"concurrency {level['concurrency']}")
    axes.set(xlabel="draft position", ylabel="accepted / drafts", title="Acceptance per draft position", ylim=(0, 1.02))
    axes.set_xticks(range(1, 1 + max(len(level["accepted_per_draft_by_position"]) for level in levels)))
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def write_plots(out: Path, levels: list[dict], rows) -> list[Path]:
    paths = [_latency_cdf(out / "latency_cdf.png", rows)]
    if len(levels) > 1:
        paths.append(_throughput(out / "tokens_per_s_vs_concurrency.png", levels))
    if any(level["accepted_per_draft_by_position"] for level in levels):
        paths.append(_acceptance(out / "acceptance_per_position.png", levels))
    return paths
