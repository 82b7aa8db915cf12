"""Shared fixtures: tiny random models of each family, built once per test session."""

import pytest
import torch

from specmesh.models.tiny import make_tiny_model

# One thread: tiny models gain nothing from two, and on a shared 2-core machine every OpenMP barrier
# waits for a descheduled sibling thread (measured: a tiny decode step 16 ms with 2 threads, 0.4 ms with 1).
torch.set_num_threads(1)

NATIVE_FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3", "smollm2")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """tiny_model_dir(family, **make_tiny_model kwargs) -> folder of that tiny model (made once per kwargs)."""
    made = {}

    def make(family: str, **kwargs):
        key = (family, tuple(sorted(kwargs.items())))
        if key not in made:
            made[key] = make_tiny_model(family, tmp_path_factory.mktemp(family), **kwargs)
        return made[key]

    return make
