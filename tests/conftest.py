"""Shared fixtures: tiny random models (built once per session) and the default model's folder."""

from __future__ import annotations

import os

import pytest
import torch

# One thread: tiny models gain nothing from two, and on a shared 2-core machine (tests also start
# service processes) every OpenMP barrier waits for a descheduled sibling thread (measured: a tiny
# decode step 16 ms with 2 threads, 0.4 ms with 1).
torch.set_num_threads(1)
# Long float32 prefills on the fast path, as tests expect (a machine measures where they go otherwise, once per
# model shape: specmesh/models/fastpath.py, long_prefill_on_fast_path; tested on its own). Service processes
# started by tests inherit it.
os.environ.setdefault("SPECMESH_FASTPATH_PREFILL", "fast")


def pytest_collection_modifyitems(config, items):
    """SPECMESH_TEST_ORDER=reverse runs the tests in reverse order (`tests/isolation.py`): a test that
    needs what an earlier one left behind fails there."""
    if os.environ.get("SPECMESH_TEST_ORDER") == "reverse":
        items.reverse()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """`tiny_model_dir(family, **kw)` -> folder of a tiny random model, cached per session."""
    from specmesh.models.tiny import make_tiny_model

    cache: dict = {}

    def build(family: str, **kwargs):
        key = (family, tuple(sorted(kwargs.items())))
        if key not in cache:
            name = "-".join([family] + [f"{k}{v}" for k, v in sorted(kwargs.items())])
            cache[key] = make_tiny_model(family, tmp_path_factory.mktemp(name), **kwargs)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def default_model_dir():
    """The embedded default model (SmolLM2-135M-Instruct) as an HF folder; converted on first use."""
    from specmesh.models.resolve import resolve_model_spec

    return resolve_model_spec("default")
