"""The cluster launcher's process environment: threads per service, and short OpenMP spinning when
several model processes share the host's cores (client/cluster.py docstring)."""

from client.cluster import SHARED_CORES_SPINCOUNT, Cluster
from client.cluster_config import ServiceSpec


def specs(*kinds):
    return [ServiceSpec(f"{kind}-{i}", kind, torch_threads=2 if kind != "coordinator" else 0) for i, kind in enumerate(kinds)]


def test_model_processes_sharing_the_host_spin_briefly(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    cluster = Cluster(specs("draft", "verify", "coordinator"), log_dir="/tmp")
    draft, verify, coordinator = (cluster.environment(s) for s in cluster.specs)
    assert draft["GOMP_SPINCOUNT"] == verify["GOMP_SPINCOUNT"] == SHARED_CORES_SPINCOUNT
    assert "GOMP_SPINCOUNT" not in coordinator
    assert draft["OMP_NUM_THREADS"] == "2" and "OMP_NUM_THREADS" not in coordinator


def test_a_lone_model_process_or_the_users_setting_keeps_libgomps_spinning(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    alone = Cluster(specs("verify", "coordinator"), log_dir="/tmp")
    assert "GOMP_SPINCOUNT" not in alone.environment(alone.specs[0])
    monkeypatch.setenv("GOMP_SPINCOUNT", "123")
    shared = Cluster(specs("draft", "verify"), log_dir="/tmp")
    assert shared.environment(shared.specs[0])["GOMP_SPINCOUNT"] == "123"
