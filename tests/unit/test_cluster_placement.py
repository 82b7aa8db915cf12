"""Cluster YAML `cpus`: a model process pinned to its own cores, its torch threads following."""

from __future__ import annotations

import pytest
import yaml

from client.cluster_config import load_cluster_config


def specs_of(tmp_path, services: dict, defaults: dict | None = None, cores: int = 2) -> dict:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"defaults": defaults or {}, "services": services}))
    return {s.name: s for s in load_cluster_config(path, cores=cores)}


def test_auto_gives_each_model_process_its_own_cores(tmp_path):
    services = {"draft": {"kind": "draft"}, "verify": {"kind": "verify"}, "coordinator": {"kind": "coordinator"}}
    specs = specs_of(tmp_path, services, {"cpus": "auto"})
    assert (specs["draft"].cpus, specs["verify"].cpus, specs["coordinator"].cpus) == ((0,), (1,), ())
    assert (specs["draft"].torch_threads, specs["verify"].torch_threads) == (1, 1)
    specs = specs_of(tmp_path, {**services, "verify": {"kind": "verify", "replicas": 3}}, {"cpus": "auto"}, cores=16)
    assert [specs[n].cpus for n in ("draft", "verify-0", "verify-1", "verify-2")] == [
        (0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15)]
    assert specs["verify-2"].torch_threads == 4
    specs = specs_of(tmp_path, services, {"cpus": "auto"}, cores=1)  # fewer cores than processes: shared
    assert specs["draft"].cpus == specs["verify"].cpus == ()


def test_explicit_cores_per_service_and_per_replica(tmp_path):
    specs = specs_of(tmp_path, {"draft": {"kind": "draft", "cpus": "0"},
                                "verify": {"kind": "verify", "replicas": 2, "cpus": ["2-5", "6,7"], "torch_threads": 2}},
                     cores=8)
    assert (specs["draft"].cpus, specs["draft"].torch_threads) == ((0,), 1)
    assert (specs["verify-0"].cpus, specs["verify-1"].cpus) == ((2, 3, 4, 5), (6, 7))
    assert specs["verify-0"].torch_threads == 2  # torch_threads, when given, wins
    assert "cpus" not in specs["draft"].options  # the launcher's key, never a service flag


@pytest.mark.parametrize("cpus, message", [("9", r"core\(s\) \[9\] this host does not offer"),
                                           ("3-1", "not a core list"), ("x", "not a core list")])
def test_bad_core_lists_are_named(tmp_path, cpus, message):
    with pytest.raises(ValueError, match=message):
        specs_of(tmp_path, {"verify": {"kind": "verify", "cpus": cpus}}, cores=4)
    with pytest.raises(ValueError, match="cpus lists 1 values for 2 replica"):
        specs_of(tmp_path, {"verify": {"kind": "verify", "replicas": 2, "cpus": ["0"]}}, cores=4)


def test_a_verify_service_borrows_the_draft_services_cores(tmp_path):
    """`borrow_cpus: auto`: the cores pinned to the draft services join the verify process's affinity
    (not its own cores, nor its torch threads) and become its `borrow_threads` when the local launcher
    starts it, unless that is given; lender and borrower get slots on the core board."""
    services = {"draft": {"kind": "draft"}, "verify": {"kind": "verify", "borrow_cpus": "auto"},
                "coordinator": {"kind": "coordinator"}}
    specs = specs_of(tmp_path, services, {"cpus": "auto"})
    verify = specs["verify"]
    assert (verify.cpus, verify.borrow_cpus, verify.affinity, verify.torch_threads) == ((1,), (0,), (0, 1), 1)
    assert verify.launch_options == {"borrow_threads": 1, "core_slot": 1, "lender_slots": "0"}
    assert "borrow_cpus" not in verify.options
    assert specs["draft"].affinity == (0,) and specs["draft"].borrow_cpus == ()
    assert specs["draft"].launch_options == {"core_slot": 0, "lender_slots": ""}  # it lends, borrows nothing
    assert specs["coordinator"].core_slot == -1
    specs = specs_of(tmp_path, {"draft": {"kind": "draft", "cpus": "0-1"},
                                "verify": {"kind": "verify", "cpus": "1-3", "borrow_cpus": "0,1", "borrow_threads": 2}},
                     cores=4)
    assert specs["verify"].borrow_cpus == (0,) and specs["verify"].options["borrow_threads"] == 2  # given: it wins
    specs = specs_of(tmp_path, services, {"cpus": "auto"}, cores=1)  # nothing pinned: nothing to borrow
    assert specs["verify"].borrow_cpus == () and specs["verify"].launch_options == {}
    with pytest.raises(ValueError, match="borrow_cpus is for verify, draft services"):
        specs_of(tmp_path, {"stage": {"kind": "stage", "borrow_cpus": "auto"}})
    with pytest.raises(ValueError, match=r"core\(s\) \[7\] this host does not offer"):
        specs_of(tmp_path, {"verify": {"kind": "verify", "borrow_cpus": "7"}})


def test_draft_and_verify_lend_each_other_their_cores(tmp_path):
    """The shipped placement on 2 cores: each pinned to its own core, each borrowing the other's; a
    replica set borrows from every process pinned to the cores it names."""
    services = {"draft": {"kind": "draft", "borrow_cpus": "auto"}, "verify": {"kind": "verify", "borrow_cpus": "auto"}}
    specs = specs_of(tmp_path, services, {"cpus": "auto"})
    draft, verify = specs["draft"], specs["verify"]
    assert (draft.cpus, draft.borrow_cpus, draft.affinity) == ((0,), (1,), (0, 1))
    assert (verify.cpus, verify.borrow_cpus, verify.affinity) == ((1,), (0,), (0, 1))
    assert (draft.core_slot, draft.lender_slots, verify.core_slot, verify.lender_slots) == (0, (1,), 1, (0,))
    specs = specs_of(tmp_path, {"draft": {"kind": "draft", "replicas": 2, "borrow_cpus": "auto"},
                                "verify": {"kind": "verify"}}, {"cpus": "auto"}, cores=3)
    assert specs["draft-0"].lender_slots == specs["draft-1"].lender_slots == (specs["verify"].core_slot,)
    assert specs["draft-0"].borrow_cpus == (2,) and specs["verify"].lender_slots == ()
