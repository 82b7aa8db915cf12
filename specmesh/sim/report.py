"""Writing a run's results, and sweeps over config parameters.

    write_result(result, "sim-out/")       # summary.json, requests.csv, devices.csv (+ latency.png)
    rows = sweep(config_data, {"router.name": ["random", "jsq2"], "workload.rate_per_s": [10, 20]})
    write_sweep(rows, "sweep-out/")        # sweep.json, sweep.csv (+ sweep.png)

PNG plots are written only when matplotlib is importable (it is not a dependency).
"""

from __future__ import annotations

import csv
import itertools
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from specmesh.sim.cluster import simulate
from specmesh.sim.config import config_from_dict
from specmesh.sim.results import DeviceRecord, RequestRecord, SimResult


def flatten(summary: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"ttft": {"p50_ms": 3}} -> {"ttft.p50_ms": 3}."""
    out: dict[str, Any] = {}
    for key, value in summary.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_result(result: SimResult, out_dir: str | Path, config: Mapping[str, Any] | None = None) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "summary.json", out / "requests.csv", out / "devices.csv"]
    paths[0].write_text(json.dumps({**result.to_json(), "config": dict(config or {})}, indent=1, default=str) + "\n")
    names = [f.name for f in fields(RequestRecord)]
    with paths[1].open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*names, "ttft_ms", "tpot_ms", "e2e_ms"])
        for r in result.requests:
            latencies = [f"{r.ttft_s * 1e3:.3f}", f"{r.tpot_s * 1e3:.3f}", f"{r.e2e_s * 1e3:.3f}"] if r.end_s >= 0 else ["", "", ""]
            writer.writerow([getattr(r, n) for n in names] + latencies)
    with paths[2].open("w", newline="") as f:
        device_writer = csv.DictWriter(f, [field.name for field in fields(DeviceRecord)])
        device_writer.writeheader()
        for d in result.devices:
            device_writer.writerow(asdict(d))
    plt = _matplotlib()
    if plt is not None:
        finished = [r for r in result.requests if r.end_s >= 0]
        fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
        for ax, (title, values) in zip(axes, [("TTFT (ms)", [r.ttft_s * 1e3 for r in finished]),
                                              ("TPOT (ms)", [r.tpot_s * 1e3 for r in finished if r.num_output_tokens > 1]),
                                              ("end to end (s)", [r.e2e_s for r in finished])]):
            ax.hist(values, bins=50)
            ax.set_title(title)
        fig.tight_layout()
        paths.append(out / "latency.png")
        fig.savefig(paths[-1])
        plt.close(fig)
    return paths


def parse_param(text: str) -> tuple[str, list[Any]]:
    """"workload.rate_per_s=10,20,40" -> ("workload.rate_per_s", [10, 20, 40]); values are YAML scalars.

    >>> parse_param("router.name=random,jsq2")
    ('router.name', ['random', 'jsq2'])
    """
    import yaml

    key, sep, values = text.partition("=")
    if not sep or not key or not values:
        raise ValueError(f"--param wants KEY=V1,V2,..., got {text!r}")
    return key.strip(), [yaml.safe_load(v) for v in values.split(",")]


def sweep(data: Mapping[str, Any], params: Mapping[str, Sequence[Any]], base_dir: str = ".",
          on_progress: Callable[[int, int, dict[str, Any], float], None] | None = None) -> list[dict[str, Any]]:
    """One run per point of the grid `params` (dotted key -> values); a flat summary row per run."""
    keys = list(params)
    points = list(itertools.product(*(params[k] for k in keys)))
    rows = []
    for i, values in enumerate(points):
        overrides = dict(zip(keys, values))
        start = time.perf_counter()
        result = simulate(config_from_dict(dict(data), overrides, base_dir))
        rows.append({**overrides, **flatten(result.summary)})
        if on_progress is not None:
            on_progress(i + 1, len(points), overrides, time.perf_counter() - start)
    return rows


def progress_line(done: int, total: int, overrides: Mapping[str, Any], wall_s: float) -> None:
    """A one-line progress bar on stderr, rewritten in place."""
    width = 24
    filled = width * done // total
    point = " ".join(f"{k}={v}" for k, v in overrides.items())
    end = "\n" if done == total else ""
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {point} ({wall_s:.1f} s)\033[K{end}")
    sys.stderr.flush()


def write_sweep(rows: list[dict[str, Any]], out_dir: str | Path, keys: Sequence[str] = ()) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "sweep.json", out / "sweep.csv"]
    paths[0].write_text(json.dumps(rows, indent=1, default=str) + "\n")
    columns = list(dict.fromkeys(c for row in rows for c in row))
    with paths[1].open("w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)
    plt = _matplotlib()
    if plt is not None and keys:
        x_key, series_keys = keys[-1], list(keys[:-1])
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
        groups: dict[tuple, list[dict[str, Any]]] = {}
        for row in rows:
            groups.setdefault(tuple(row[k] for k in series_keys), []).append(row)
        for label, group in groups.items():
            xs = [r[x_key] for r in group]
            name = " ".join(map(str, label)) or "run"
            axes[0].plot(xs, [r["goodput_tokens_per_s"] for r in group], marker="o", label=name)
            axes[1].plot(xs, [r["e2e.p95_ms"] for r in group], marker="o", label=name)
        for ax, title in zip(axes, ["goodput (tokens/s)", "p95 end to end (ms)"]):
            ax.set_xlabel(x_key)
            ax.set_title(title)
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        paths.append(out / "sweep.png")
        fig.savefig(paths[-1])
        plt.close(fig)
    return paths
