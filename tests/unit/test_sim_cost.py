"""Cost tables (interpolation, JSON), the roofline model, profiling a real engine, and the sim CLI."""

from __future__ import annotations

import json

import pytest
import yaml

from specmesh.sim.cost import MODEL_PRESETS, CostTable, DeviceSpec, ModelDims, RooflineCost, model_dims


def table() -> CostTable:
    # forward_ms = 2 + rows * tokens * 0.5 + context / 100: linear, so interpolation is exact
    rows, tokens, context = [1, 2, 4], [1, 4], [0, 100]
    times = [[[2 + r * t * 0.5 + c / 100 for c in context] for t in tokens] for r in rows]
    return CostTable(rows, tokens, context, times, {"device": "test"})


def test_table_hits_grid_points_and_interpolates():
    t = table()
    assert t.forward_ms(2, 4, 100) == pytest.approx(2 + 4 + 1)
    assert t.forward_ms(1, 1, 50) == pytest.approx(2 + 0.5 + 0.5)  # between contexts
    assert t.forward_ms(3, 1, 0) == pytest.approx(2 + 1.5)  # between rows
    assert t.forward_ms(8, 1, 0) == pytest.approx(2 + 4)  # past the last row: linear extrapolation
    assert t.forward_ms(0, 0, 0) == pytest.approx(2.5)  # extrapolated below the grid: never under the fastest measured


def test_table_json_round_trip(tmp_path):
    t = table()
    t.save(tmp_path / "t.json")
    again = CostTable.load(tmp_path / "t.json")
    assert again.forward_ms(3, 2.5, 70) == pytest.approx(t.forward_ms(3, 2.5, 70))
    assert again.meta == {"device": "test"}
    with pytest.raises(ValueError, match="ascending"):
        CostTable([2, 1], [1], [0], [[[1.0]], [[1.0]]])


def test_roofline_small_batches_are_memory_bound():
    model = MODEL_PRESETS["llama3.1-8b"]
    device = DeviceSpec(flops_per_s=1e15, bandwidth_bytes_per_s=3e12, mfu=0.5, mbu=0.7)
    cost = RooflineCost(model, device)
    one = cost.forward_ms(1, 1, 0)
    assert one == pytest.approx(model.weight_bytes / (3e12 * 0.7) * 1e3, rel=0.01)  # ~16 GB read once
    assert cost.forward_ms(8, 5, 0) < 1.2 * one  # verifying 8 x 5 tokens costs about one decode step
    assert cost.forward_ms(1, 4096, 0) > 10 * one  # a long prefill is compute bound
    assert cost.forward_ms(1, 1, 8000) > one  # the KV read grows with context


def test_model_dims_presets_and_overrides():
    assert model_dims("smollm2-135m").num_layers == 30
    assert model_dims({"preset": "smollm2-135m", "bytes_per_param": 4}).bytes_per_param == 4
    with pytest.raises(ValueError, match="unknown model preset"):
        model_dims("gpt-9")
    # smollm2-135m has about 135M parameters (embedding tied)
    m = model_dims("smollm2-135m")
    assert 120e6 < m.num_layers * m.params_per_layer + m.vocab_size * m.d_model < 150e6


def test_profile_tiny_engine_and_dims(tmp_path):
    from specmesh.models.load import load_engine
    from specmesh.models.tiny import make_tiny_model
    from specmesh.sim.profile import _context_groups, profile_engine

    folder = make_tiny_model("llama", tmp_path / "tiny")
    engine = load_engine(folder)
    t = profile_engine(engine, rows=[1, 2], tokens_per_row=[1, 8], context=[8, 32], repeats=1, warmup=1)
    assert len(t.times_ms) == 2 and all(v > 0 for r in t.times_ms for c in r for v in c)
    assert t.meta["backend"] == "native"
    assert t.forward_ms(2, 8, 32) > 0
    # a grid spanning the logits step (and the fast path's, where it runs) measures both sides of it
    t = profile_engine(engine, rows=[1], tokens_per_row=[1, 40], context=[8], repeats=1, warmup=0)
    assert t.tokens_per_row == [1, 32, 33, 40]
    # every context length's sequences at once where the pool holds them, else in groups that fit
    free = engine.kv_usage().free_blocks
    assert _context_groups(engine, [8, 32], 2, 8) == [[0, 1]]
    block = engine.kv_usage().block_size
    assert _context_groups(engine, [free * block // 2 - 8, free * block // 2 - 8], 1, 8) == [[0, 1]]
    assert _context_groups(engine, [free * block // 2, free * block // 2], 1, 8) == [[0], [1]]
    dims = ModelDims.from_hf_config(str(folder))
    assert dims.vocab_size == engine.vocab_size


def test_cli_run_and_sweep(tmp_path, capsys):
    from client.cli import main

    config = {"duration_s": 20, "burn_in_s": 2, "devices": {"t": {"linear": {"base_ms": 5}}, "d": {"linear": {"base_ms": 1}}},
              "targets": [{"count": 2, "device": "t"}], "drafts": [{"count": 2, "device": "d"}],
              "workload": {"arrival": "poisson", "rate_per_s": 2, "prompt_tokens": 32, "output_tokens": 16}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["sim", "run", str(path), "--out", str(tmp_path / "run"), "--set", "seed=3"]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())["summary"]
    assert summary["num_requests_done"] > 10
    assert (tmp_path / "run" / "requests.csv").read_text().startswith("arrival_s,")
    assert main(["sim", "sweep", str(path), "--param", "router.name=random,jsq2", "--param", "workload.rate_per_s=1,2",
                 "--out", str(tmp_path / "sweep"), "--quiet"]) == 0
    rows = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert [(r["router.name"], r["workload.rate_per_s"]) for r in rows] == [("random", 1), ("random", 2), ("jsq2", 1), ("jsq2", 2)]
    assert main(["sim", "run", str(path), "--set", "workload.rate=1"]) == 2
    assert "unknown keys" in capsys.readouterr().err


def test_shipped_configs_load(tmp_path):
    """configs/sim/*.yaml parse; the fleet runs (briefly); the local one runs on any cost table."""
    from pathlib import Path

    from specmesh.sim import load_config, simulate

    root = Path(__file__).resolve().parents[2] / "configs" / "sim"
    fleet = load_config(root / "fleet.yaml", {"duration_s": 6, "burn_in_s": 1})
    assert simulate(fleet).summary["num_drafts"] == 256
    table().save(tmp_path / "t.json")
    local = load_config(root / "local-cpu.yaml", {"duration_s": 10, "burn_in_s": 1, "devices.cpu-target.table": str(tmp_path / "t.json"),
                                                  "devices.cpu-draft.table": str(tmp_path / "t.json")})
    assert simulate(local).summary["num_requests_done"] > 0
