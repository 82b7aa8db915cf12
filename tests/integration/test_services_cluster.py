"""Real service processes started by the cluster launcher (as `make run-cluster` does), driven over
loopback by the wire loop; exact greedy output; clean shutdown."""

from __future__ import annotations

import yaml

from client.cluster import Cluster
from servicekit.wire_loop import run_wire_generation
from specmesh.decoding.adaptive import FixedK
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.speculative import generate
from specmesh.decoding.verifier import TargetVerifier
from specmesh.drafters.model import ModelDrafter
from specmesh.models.load import load_engine


def test_launcher_runs_services_as_processes_and_stops_them(tiny_model_dir, tmp_path):
    folder = str(tiny_model_dir("llama", init_std=0.2))
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({
        "defaults": {"model": folder, "device": "cpu", "port": 0},
        "services": {"draft": {"kind": "draft", "dtype": "float32", "drafter": "model"},
                     "verify": {"kind": "verify", "dtype": "float64", "metrics_port": 0}},
    }))
    prompt, params = [5, 17, 33, 5, 17, 33, 5, 17], SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    cluster = Cluster.from_yaml(config, log_dir=tmp_path)
    with cluster:
        processes = list(cluster.processes.values())
        assert all(p.poll() is None for p in processes)
        tokens, stats = run_wire_generation(cluster.addresses["draft"], cluster.addresses["verify"], prompt, params, k=4)
    assert all(p.poll() is not None for p in processes)  # stopped
    ref = generate(TargetVerifier(load_engine(folder, dtype="float64")), ModelDrafter(load_engine(folder, dtype="float32")),
                   prompt, params, k_policy=FixedK(4))
    assert tokens == ref.token_ids
    assert stats.num_target_forwards == ref.stats.num_target_forwards
